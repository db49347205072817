"""Re-exports when the workers' ONNX Runtime moves on: the beat's check, also callable by hand.

An export is stale when a live worker of its queue runs a newer onnxruntime than the one it was
built and validated with. The check queues one re-export per stale export (reason ``ort-upgrade``,
linked to its predecessor), under a policy (all / listed models / dry run) and a per-run cap so an
upgrade does not flood the GPUs. It is idempotent: a predecessor that already has a live successor
is skipped, and the new request's cache key (which includes the ORT version) deduplicates too.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.catalog.models import Export, ExportStatus
from services.jobs import request_of, submit_export
from services.settings import Settings
from workers.config import QUEUE_FOR_EP
from workers.registry import live_workers

POLICIES = ("all", "listed", "dry-run")


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split("."))


def newest_runtimes(session: Session, settings: Settings) -> dict[str, str]:
    """{queue: newest onnxruntime version among its live workers}."""
    newest: dict[str, str] = {}
    for worker in live_workers(settings, session):
        for queue in worker.queues.split(","):
            if queue not in newest or version_key(worker.onnxruntime) > version_key(newest[queue]):
                newest[queue] = worker.onnxruntime
    return newest


@dataclasses.dataclass
class ReexportPlan:
    policy: str
    newest: dict[str, str]
    queued: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    deferred: list[dict] = dataclasses.field(default_factory=list)  # over the rate cap: next run

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _has_live_successor(session: Session, export: Export) -> bool:
    return session.scalars(
        select(Export.id).where(Export.predecessor_id == export.id,
                                Export.status.in_((ExportStatus.QUEUED, ExportStatus.RUNNING, ExportStatus.READY)))
    ).first() is not None


def _is_latest_of_its_slot(session: Session, export: Export) -> bool:
    """Only the newest ready export of a (model, variant, dtype, ep, max_seq_len) is re-exported."""
    newer = session.scalars(
        select(Export.id).where(
            Export.model == export.model, Export.variant == export.variant, Export.dtype == export.dtype,
            Export.ep == export.ep, Export.max_seq_len == export.max_seq_len if export.max_seq_len is not None
            else Export.max_seq_len.is_(None), Export.status == ExportStatus.READY,
            Export.finished_at > export.finished_at,
        )
    ).first()
    return newer is None


def plan_and_queue_reexports(
    session: Session, settings: Settings, *, policy: str | None = None, models: list[str] | None = None,
    limit: int | None = None,
) -> ReexportPlan:
    """Find stale ready exports and add their re-exports to the catalog as queued.

    The caller commits, then sends each ``plan.queued`` job to the broker: a worker must never see
    a job id before its row exists.
    """
    policy = policy or settings.reexport_policy
    if policy not in POLICIES:
        raise ValueError(f"re-export policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    models = models if models is not None else settings.reexport_models
    limit = settings.reexport_max_per_run if limit is None else limit
    plan = ReexportPlan(policy, newest_runtimes(session, settings))
    candidates = session.scalars(
        select(Export).where(Export.status == ExportStatus.READY).order_by(Export.finished_at.asc()).with_for_update()
    ).all()
    for export in candidates:
        target = plan.newest.get(QUEUE_FOR_EP[export.ep])
        entry = {"predecessor_id": export.id, "model": export.model, "variant": export.variant,
                 "dtype": export.dtype, "ep": export.ep, "from_ort": export.ort_version, "to_ort": target}
        if target is None or version_key(target) <= version_key(export.ort_version):
            continue  # up to date, or no live worker for its queue
        if not _is_latest_of_its_slot(session, export):
            continue
        if _has_live_successor(session, export):
            plan.skipped.append({**entry, "why": "a re-export is already queued, running or ready"})
            continue
        if policy == "listed" and export.model not in models:
            plan.skipped.append({**entry, "why": "model not in REEXPORT_MODELS"})
            continue
        if policy == "dry-run":
            plan.skipped.append({**entry, "why": "dry run"})
            continue
        if len(plan.queued) >= limit:
            plan.deferred.append({**entry, "why": f"rate cap of {limit} per run"})
            continue
        new, created = submit_export(session, settings, request_of(export), reason="ort-upgrade", predecessor_id=export.id)
        if not created:
            plan.skipped.append({**entry, "why": f"an identical export exists ({new.id})"})
            continue
        session.flush()
        plan.queued.append({**entry, "export_id": new.id})
    return plan


def send_queued(celery_app, plan: ReexportPlan) -> None:
    from workers.config import RUN_EXPORT

    for job in plan.queued:
        celery_app.send_task(RUN_EXPORT, args=[job["export_id"]], queue=QUEUE_FOR_EP[job["ep"]])
