"""The sweeper: whatever dies, every accepted export ends published once or failed with the reason.

One ``sweep`` (beat runs it in a deployment, ``serve`` in embedded mode; running two at once is safe,
every change is a conditional UPDATE) does, in order:

1. Settles running exports whose lease ran out (or was released because the worker is known dead).
   The attempt is over, and the store decides the rest: a complete manifest of this export under
   the prefix the attempt recorded means it was published, and the row becomes ready from it; a
   pending cancel deletes what was uploaded and cancels; after ``max_attempts`` the export fails,
   naming the stage and how the last attempt died; otherwise it is queued again (attempt + 1).
2. Finishes cancels that are waiting for the store (it was down when the cancel came).
3. Fails re-exports no worker of their target runtime started within ``reexport_timeout_s``.
4. Sends what was committed but never sent (the outbox): users' exports first; a re-export only
   while no user export waits for its execution provider.
5. Rings again for queued exports whose message was lost: sent more than ``redispatch_s`` ago while
   a live worker of their queue sits idle (a filesystem queue drops a message its reader died with;
   a restarted Redis keeps nothing).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from exporter.contract import BENCH_FILE, DIFF_JSON, REPORT_JSON
from services.catalog.database import session_scope
from services.catalog.exports import ended_fields, lease_expired, outcome_fields, runtime_fields
from services.catalog.models import Export, ExportEvent, ExportStatus, db_now, lease_live
from services.catalog.workers import busy_workers, consumers
from services.lifecycle import release_lost, running_on
from services.publish import files_match_store, read_published, read_published_manifest, unpublish
from services.placement import current_queue
from services.queue import BrokerUnavailable, JobQueue, queue_for
from services.settings import Settings
from services.storage import ArtifactStore, StorageError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SweepReport:
    requeued: list[str] = dataclasses.field(default_factory=list)
    adopted: list[str] = dataclasses.field(default_factory=list)  # found published by their last attempt
    failed: list[str] = dataclasses.field(default_factory=list)
    cancelled: list[str] = dataclasses.field(default_factory=list)
    dispatched: list[str] = dataclasses.field(default_factory=list)
    redispatched: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)  # what has to wait for the next sweep

    def changed(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "problems")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _event(session: Session, export_id: str, from_status: ExportStatus, to: ExportStatus, stage: str | None,
           message: str) -> None:
    session.add(ExportEvent(export_id=export_id, from_status=from_status.value, to_status=to.value, stage=stage,
                            message=message, worker="sweeper"))


class Sweeper:
    def __init__(self, settings: Settings, queue: JobQueue, store: ArtifactStore):
        self.settings, self.queue, self.store = settings, queue, store

    @property
    def _url(self) -> str:
        return self.settings.catalog_url

    def sweep(self) -> SweepReport:
        report = SweepReport()
        self.settle_lost_attempts(report)
        self.settle_pending_cancels(report)
        self.expire_reexports(report)
        self.dispatch(report)
        self.redispatch(report)
        if report.changed():
            log.info("sweep: %s", {k: v for k, v in report.to_dict().items() if v})
        return report

    # --- 1. attempts whose lease ran out ---------------------------------------------------------

    def _heartbeat_older_than_lease(self):
        """The lease has run out, by the catalog's clock, as the statement runs (a condition of the
        UPDATE that settles the attempt: a worker that renewed meanwhile keeps its job)."""
        return ~lease_live(self._url, self.settings.lease_s)

    def _lost_attempts(self) -> list[tuple[str, int]]:
        with session_scope(self._url) as session:
            rows = session.execute(
                select(Export.id, Export.attempts).where(Export.status == ExportStatus.RUNNING,
                                                        self._heartbeat_older_than_lease())
            ).all()
        return [(row.id, row.attempts) for row in rows]

    def settle_lost_attempts(self, report: SweepReport) -> None:
        for export_id, attempt in self._lost_attempts():
            try:
                self._settle_lost(export_id, attempt, report)
            except StorageError as err:
                report.problems.append(f"{export_id}: object store unavailable, settling it next sweep ({err})")

    def _settle_lost(self, export_id: str, attempt: int, report: SweepReport) -> None:
        with session_scope(self._url) as session:
            export = session.get(Export, export_id)
            if export is None or export.status is not ExportStatus.RUNNING or export.attempts != attempt:
                return
            if not lease_expired(export, self.settings.lease_s, db_now(session)):
                return
            prefix, cancel, stage, lost_before = (export.storage_prefix, export.cancel_requested, export.stage,
                                                  export.lost_attempts)
            cause = export.lost_reason or (
                f"worker {export.worker} stopped renewing its lease during {stage} (no heartbeat for over "
                f"{self.settings.lease_s:g} s)")
        # The store is read outside any transaction; every change below is conditional on the row
        # still being this expired attempt, so a worker that renewed meanwhile keeps its job.
        manifest = read_published_manifest(self.store, prefix) if prefix else None
        if manifest is not None and (manifest.get("export_id") != export_id
                                     or not files_match_store(self.store, prefix, manifest)):
            manifest = None  # another export's, or one whose files a later write changed: not adopted
        lost = (Export.id == export_id, Export.status == ExportStatus.RUNNING, Export.attempts == attempt,
                self._heartbeat_older_than_lease())
        if manifest is not None and not cancel and manifest.get("status") in ("ready", "quarantined"):
            fields = outcome_fields(prefix, manifest, read_published(self.store, prefix, REPORT_JSON),
                                    read_published(self.store, prefix, BENCH_FILE),
                                    read_published(self.store, prefix, DIFF_JSON))
            status = ExportStatus(manifest["status"])
            if self._end(lost, status, f"published by attempt {attempt}, which was lost before it recorded that ({cause})",
                         stage, fields | {"percent": 100}, runtime=manifest["versions"]["onnxruntime"]):
                report.adopted.append(export_id)
            return
        lost = lost + (Export.lost_attempts == lost_before,)
        counted = {"lost_attempts": lost_before + 1}
        if cancel or lost_before + 1 >= self.settings.max_attempts:
            if prefix:
                unpublish(self.store, prefix, export_id=export_id,  # a cancelled or failed export is never published
                          reason="cancelled" if cancel else f"gave up after {lost_before + 1} lost attempts")
            if cancel:
                ended = self._end(lost, ExportStatus.CANCELLED, f"cancelled; its worker was gone ({cause})", stage, counted)
                (report.cancelled if ended else report.problems).append(export_id)
            else:
                message = (f"gave up after {lost_before + 1} lost attempts (MAX_ATTEMPTS {self.settings.max_attempts}): "
                           f"attempt {attempt} was lost during {stage}: {cause}")
                if self._end(lost, ExportStatus.FAILED, message, stage, counted):
                    report.failed.append(export_id)
            return
        with session_scope(self._url) as session:
            result = session.execute(
                update(Export).where(*lost).values(status=ExportStatus.QUEUED, dispatched_at=None, heartbeat_at=None,
                                                   lost_reason=cause, updated_at=db_now(session), **counted)
                .execution_options(synchronize_session=False))
            if result.rowcount == 1:
                _event(session, export_id, ExportStatus.RUNNING, ExportStatus.QUEUED, stage,
                       f"attempt {attempt} lost ({lost_before + 1} of at most {self.settings.max_attempts}): "
                       f"{cause}; queued again")
                report.requeued.append(export_id)

    def _end(self, conditions: tuple, status: ExportStatus, message: str, stage: str | None, fields: dict,
             runtime: str | None = None) -> bool:
        """One conditional UPDATE to a terminal status (+ its event); False if the row moved on. Ready
        and quarantined (adopting what a lost attempt published) also need no cancel to have been
        requested meanwhile, as ``lifecycle.finish`` does: a cancel that lands between the read and
        this write leaves the row to the cancel, which unpublishes it."""
        if status in (ExportStatus.READY, ExportStatus.QUARANTINED):
            conditions = (*conditions, Export.cancel_requested.is_(False))
        with session_scope(self._url) as session:
            export = session.scalars(select(Export).where(*conditions)).first()
            if export is None:
                return False
            from_status, now = export.status, db_now(session)
            values = {"status": status, "finished_at": now, "updated_at": now, "heartbeat_at": None,
                      **ended_fields(status), **fields}
            if status in (ExportStatus.FAILED, ExportStatus.CANCELLED):
                values["error"] = message
            if runtime is not None:
                values |= runtime_fields(export, runtime)
            result = session.execute(update(Export).where(*conditions).values(**values)
                                     .execution_options(synchronize_session=False))
            if result.rowcount != 1:
                return False
            _event(session, export.id, from_status, status, stage, message)
            return True

    def recover_worker(self, worker: str, pid: int | None, cause: str) -> SweepReport:
        """Settle at once the jobs of a worker known to be dead (no waiting for their leases)."""
        with session_scope(self._url) as session:
            for export_id in running_on(session, worker, pid):
                release_lost(session, export_id, worker, pid, cause)
        report = SweepReport()
        self.settle_lost_attempts(report)
        return report

    def hand_back(self, worker: str, pid: int | None, why: str) -> list[str]:
        """Queue again, without counting it as lost, what a worker that was stopped on purpose held.

        Only for a worker whose processes are known to have exited (the embedded supervisor
        stopped it), so no write of its attempt can still come.
        """
        returned = []
        with session_scope(self._url) as session:
            for export_id in running_on(session, worker, pid):
                export = session.get(Export, export_id)
                result = session.execute(
                    update(Export).where(Export.id == export_id, Export.status == ExportStatus.RUNNING,
                                         Export.attempts == export.attempts)
                    .values(status=ExportStatus.QUEUED, dispatched_at=None, heartbeat_at=None, updated_at=db_now(session))
                    .execution_options(synchronize_session=False))
                if result.rowcount == 1:
                    _event(session, export_id, ExportStatus.RUNNING, ExportStatus.QUEUED, export.stage,
                           f"attempt {export.attempts} handed back: {why}; queued again")
                    returned.append(export_id)
        return returned

    # --- 2. cancels waiting for the store ---------------------------------------------------------

    def settle_cancel(self, export_id: str) -> bool:
        """Finish a requested cancel of an export no live worker holds: unpublish, then cancel.

        False when it cannot finish now (a live worker holds it and will stop, or the store is down:
        the next sweep tries again).
        """
        with session_scope(self._url) as session:
            export = session.get(Export, export_id)
            if export is None or export.status.terminal or not export.cancel_requested:
                return False
            if export.status is ExportStatus.RUNNING and not lease_expired(export, self.settings.lease_s,
                                                                          db_now(session)):
                return False  # its worker stops at its next checkpoint and cleans up itself
            status, attempt, prefix, stage = export.status, export.attempts, export.storage_prefix, export.stage
        if prefix:
            try:
                unpublish(self.store, prefix, export_id=export_id, reason="cancelled")
            except StorageError as err:
                log.warning("cancel of %s waits for the object store: %s", export_id, err)
                return False
        conditions = (Export.id == export_id, Export.status == status, Export.attempts == attempt,
                      Export.cancel_requested.is_(True))
        if status is ExportStatus.RUNNING:
            conditions += (self._heartbeat_older_than_lease(),)
        where = "while queued" if status is ExportStatus.QUEUED else "its worker was gone"
        return self._end(conditions, ExportStatus.CANCELLED, f"cancelled ({where})", stage, {})

    def settle_pending_cancels(self, report: SweepReport) -> None:
        with session_scope(self._url) as session:
            ids = list(session.scalars(select(Export.id).where(
                Export.status == ExportStatus.QUEUED, Export.cancel_requested.is_(True))))
        for export_id in ids:
            (report.cancelled if self.settle_cancel(export_id) else report.problems).append(export_id)

    # --- 3. re-exports nobody can run -------------------------------------------------------------

    def expire_reexports(self, report: SweepReport) -> None:
        """Fail a re-export no worker of its target runtime can take: queued past REEXPORT_TIMEOUT_S
        while no live worker consumes its runtime queue. One that waits behind users' exports on
        live workers of that runtime is held back, not stale: it stays queued."""
        with session_scope(self._url) as session:
            horizon = db_now(session) - datetime.timedelta(seconds=self.settings.reexport_timeout_s)
            old = session.execute(select(Export.id, Export.attempts, Export.target_ort, Export.queue, Export.ep).where(
                Export.status == ExportStatus.QUEUED, Export.target_ort.is_not(None), Export.created_at < horizon)).all()
            served = set(consumers(self.settings, session)) if old else set()
        stale = [row for row in old if queue_for(row.ep, row.target_ort, row.queue) not in served]
        for row in stale:
            conditions = (Export.id == row.id, Export.status == ExportStatus.QUEUED, Export.attempts == row.attempts)
            message = (f"no worker running onnxruntime {row.target_ort} started this re-export within "
                       f"{self.settings.reexport_timeout_s:g} s")
            if self._end(conditions, ExportStatus.FAILED, message, None, {}):
                report.failed.append(row.id)

    # --- 4. and 5. sending -------------------------------------------------------------------------

    def ring(self, export_id: str, queue: str, *, first: bool, placed_on: str | None, attempts: int) -> bool:
        """Send one export's message and note when; False (and nothing noted) if the broker refused.

        The send is noted only while the row is still the one the message was addressed from: queued
        at ``attempts``, on worker class ``placed_on`` (None: a row that names no class, an older
        one), unsent for a ``first`` send and sent for a ring again. A worker may hand the job to
        another class between the read and the note (the row then names that class and is unsent):
        noting this send over it would mark the job sent to a class that was never sent a message."""
        try:
            self.queue.send(export_id, queue)
        except BrokerUnavailable as err:
            log.warning("could not send export %s to %s: %s", export_id, queue, err)
            return False
        with session_scope(self._url) as session:
            session.execute(update(Export).where(
                Export.id == export_id, Export.status == ExportStatus.QUEUED, Export.attempts == attempts,
                Export.queue.is_(None) if placed_on is None else Export.queue == placed_on,
                Export.dispatched_at.is_(None) if first else Export.dispatched_at.is_not(None),
            ).values(dispatched_at=db_now(session)).execution_options(synchronize_session=False))
        return True

    def dispatch(self, report: SweepReport, grace_s: float | None = None) -> None:
        """The outbox: send committed exports that were never sent (the API sends its own at once;
        ``grace_s`` keeps the sweeper from racing it)."""
        grace = min(5.0, self.settings.redispatch_s) if grace_s is None else grace_s
        with session_scope(self._url) as session:
            horizon = db_now(session) - datetime.timedelta(seconds=grace)
            pending = session.scalars(
                select(Export).where(Export.status == ExportStatus.QUEUED, Export.dispatched_at.is_(None),
                                     Export.cancel_requested.is_(False),
                                     # a queued-again export is the sweeper's own to send, at once
                                     or_(Export.updated_at <= horizon, Export.attempts > 0))
                .order_by(Export.target_ort.is_not(None), Export.created_at)  # users' exports first
            ).all()
            waiting_user_eps = set(session.scalars(select(Export.ep).where(
                Export.status == ExportStatus.QUEUED, Export.target_ort.is_(None))))
        for export in pending:
            if export.target_ort and export.ep in waiting_user_eps:
                continue  # a re-export waits while any user export of its EP does
            placed = current_queue(self.settings, export.queue, export.ep)
            if not self.ring(export.id, queue_for(export.ep, export.target_ort, placed), first=True,
                             placed_on=export.queue, attempts=export.attempts):
                report.problems.append(f"{export.id}: the broker is unavailable; sending it next sweep")
                return
            report.dispatched.append(export.id)

    def redispatch(self, report: SweepReport) -> None:
        with session_scope(self._url) as session:
            horizon = db_now(session) - datetime.timedelta(seconds=self.settings.redispatch_s)
            waiting = session.execute(select(
                Export.id, Export.ep, Export.target_ort, Export.queue, Export.attempts).where(
                Export.status == ExportStatus.QUEUED, Export.dispatched_at < horizon,
                Export.cancel_requested.is_(False))).all()
            if not waiting:
                return
            busy = busy_workers(session)
            idle_queues = {queue for queue, workers in consumers(self.settings, session).items()
                           if any(w.hostname not in busy for w in workers)}
        for row in waiting:
            queue = queue_for(row.ep, row.target_ort, current_queue(self.settings, row.queue, row.ep))
            if queue in idle_queues:
                if not self.ring(row.id, queue, first=False, placed_on=row.queue, attempts=row.attempts):
                    report.problems.append(f"{row.id}: the broker is unavailable; ringing again next sweep")
                    return
                report.redispatched.append(row.id)
