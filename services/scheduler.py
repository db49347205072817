"""Re-exports when the workers' ONNX Runtime moves on: the beat's check, also callable by hand.

An export is stale when a live worker of its queue runs a newer onnxruntime than the one it was
built and validated with. The check adds one re-export per stale export (reason ``ort-upgrade``,
linked to its predecessor, targeting that runtime) under a policy (all / listed models / dry run),
and it is bounded (DESIGN.md, Job lifecycle):

- at most one re-export per (predecessor, target onnxruntime), whatever became of it: a
  quarantined or failed one is reported in the catalog, not retried on every run (a unique
  constraint holds this even for two checks at once);
- at most ``REEXPORT_MAX_IN_FLIGHT`` re-exports queued or running at once; the rest wait for a
  later run (``deferred``);
- a re-export only runs on a worker of its target runtime (it is sent to that runtime's queue),
  so it is never stamped with the runtime it was meant to replace;
- users' exports go first: the sweeper sends a re-export only while no user export waits for the
  same execution provider.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import and_, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from exporter.errors import ExportError
from services.catalog.exports import request_of
from services.catalog.models import Export, ExportStatus
from services.catalog.workers import live_workers
from services.jobs import submit_export
from services.queue import QUEUE_FOR_EP, RUNTIME_QUEUE_SEPARATOR
from services.settings import Settings

POLICIES = ("all", "listed", "dry-run")
IN_FLIGHT = (ExportStatus.QUEUED, ExportStatus.RUNNING)


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split("."))


def newest_runtimes(session: Session, settings: Settings) -> dict[str, str]:
    """{queue: newest onnxruntime version among its live workers} (runtime queues left out)."""
    newest: dict[str, str] = {}
    for worker in live_workers(settings, session):
        for queue in worker.queues.split(","):
            if RUNTIME_QUEUE_SEPARATOR in queue:
                continue
            if queue not in newest or version_key(worker.onnxruntime) > version_key(newest[queue]):
                newest[queue] = worker.onnxruntime
    return newest


@dataclasses.dataclass
class ReexportPlan:
    policy: str
    newest: dict[str, str]
    in_flight: int = 0  # re-exports queued or running before this run
    cap: int = 0
    queued: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    deferred: list[dict] = dataclasses.field(default_factory=list)  # over the in-flight cap: a later run

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _successor(session: Session, export: Export, target: str) -> Export | None:
    """The re-export of ``export`` onto onnxruntime ``target``, if there ever was one."""
    return session.scalars(
        select(Export).where(Export.predecessor_id == export.id, or_(
            Export.target_ort == target,
            # re-exports made before targets were recorded: the runtime they ended on
            and_(Export.target_ort.is_(None), Export.reason == "ort-upgrade", Export.ort_version == target)))
        .limit(1)
    ).first()


def reexports_in_flight(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Export).where(
        Export.target_ort.is_not(None), Export.status.in_(IN_FLIGHT))) or 0)


def _is_latest_of_its_slot(session: Session, export: Export) -> bool:
    """Only the newest ready export of a (model, variant, dtype, quant options, ep, max_seq_len, layout,
    compat) is re-exported (quant compared here, not in SQL: PostgreSQL's json type has no equality)."""
    newer = session.scalars(
        select(Export).where(
            Export.model == export.model, Export.variant == export.variant, Export.dtype == export.dtype,
            Export.ep == export.ep, Export.max_seq_len == export.max_seq_len if export.max_seq_len is not None
            else Export.max_seq_len.is_(None), Export.layout == export.layout, Export.compat == export.compat,
            Export.builder == export.builder,
            Export.status == ExportStatus.READY,
            Export.finished_at > export.finished_at,
        )
    ).all()
    return not any((row.quant or None) == (export.quant or None) for row in newer)


def plan_and_queue_reexports(
    session: Session, settings: Settings, *, policy: str | None = None, models: list[str] | None = None,
    limit: int | None = None,
) -> ReexportPlan:
    """Find stale ready exports and add their re-exports to the catalog as queued (not yet sent).

    The caller commits; the sweeper sends them, users' exports first. ``limit`` lowers the
    in-flight cap for this run only.
    """
    policy = policy or settings.reexport_policy
    if policy not in POLICIES:
        raise ValueError(f"re-export policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    models = models if models is not None else settings.reexport_models
    cap = settings.reexport_max_in_flight if limit is None else min(limit, settings.reexport_max_in_flight)
    plan = ReexportPlan(policy, newest_runtimes(session, settings), reexports_in_flight(session), cap)
    room = cap - plan.in_flight
    candidates = session.scalars(
        select(Export).where(Export.status == ExportStatus.READY).order_by(Export.finished_at.asc())
    ).all()
    for export in candidates:
        target = plan.newest.get(export.queue or QUEUE_FOR_EP[export.ep])
        entry = {"predecessor_id": export.id, "model": export.model, "variant": export.variant,
                 "dtype": export.dtype, "ep": export.ep, "from_ort": export.ort_version, "to_ort": target}
        if target is None or version_key(target) <= version_key(export.ort_version):
            continue  # up to date, or no live worker for its queue
        if not _is_latest_of_its_slot(session, export):
            continue
        successor = _successor(session, export, target)
        if successor is not None:
            plan.skipped.append({**entry, "why": f"re-exported to onnxruntime {target} already "
                                                 f"({successor.id}, {successor.status.value})"})
            continue
        if policy == "listed" and export.model not in models:
            plan.skipped.append({**entry, "why": "model not in REEXPORT_MODELS"})
            continue
        if policy == "dry-run":
            plan.skipped.append({**entry, "why": "dry run"})
            continue
        if room <= 0:
            plan.deferred.append({**entry, "why": f"{cap - room} re-exports in flight (cap {cap})"})
            continue
        try:
            with session.begin_nested():  # another check may add the same successor at the same moment
                # the predecessor's weights: a hub export's commit, not wherever its branch is now
                new, created = submit_export(session, settings, request_of(export), reason="ort-upgrade",
                                             predecessor_id=export.id, target_ort=target, revision=export.revision)
                session.flush()
        except IntegrityError:
            plan.skipped.append({**entry, "why": f"re-exported to onnxruntime {target} already (concurrently)"})
            continue
        except ExportError as err:  # e.g. no worker class holds it any more: this one is skipped, not the run
            plan.skipped.append({**entry, "why": str(err)})
            continue
        if not created:
            plan.skipped.append({**entry, "why": f"an identical export exists ({new.id})"})
            continue
        room -= 1
        plan.queued.append({**entry, "export_id": new.id})
    return plan
