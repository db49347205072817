"""A worker's writes to the catalog, each fenced by the attempt it owns (DESIGN.md, Job lifecycle).

A worker owns a running export for one attempt: ``claim`` turns a queued row into running with
``attempts + 1`` and hands back a ``Lease``. Every later write (renew, stage, publish start, finish)
is one conditional UPDATE on (id, status running, attempts == the lease's attempt). A refused write
raises ``Fenced``: the sweeper has given the job to another attempt, and the worker must stop and
write nothing else, to the catalog or to the object store. ``release_lost`` is the one write made
for a worker by someone else (its own main process, or the embedded supervisor), and only marks the
lease expired, so the sweeper settles the job.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from services.catalog.exports import ended_fields, request_of, runtime_fields
from exporter.request import cache_key
from services.catalog.models import Export, ExportEvent, ExportStatus, db_now, lease_live


class Fenced(Exception):
    """This attempt no longer owns the export: stop, and write nothing more anywhere."""


class CancelRequested(Exception):
    """The export was cancelled while this attempt finished it: undo the publish, then finish cancelled."""


@dataclasses.dataclass(frozen=True)
class Lease:
    export_id: str
    attempt: int
    worker: str
    pid: int
    # A lease not renewed for this long (the catalog's clock) cannot be renewed or written with any
    # more: the sweeper may settle it, so the two never both act on one attempt. None: no limit.
    lease_s: float | None = None

    def __str__(self) -> str:
        return f"export {self.export_id} attempt {self.attempt} ({self.worker}, pid {self.pid})"


@dataclasses.dataclass
class Claim:
    lease: Lease | None
    export: Export | None
    why: str = ""  # why nothing was claimed


def _owned(session: Session, lease: Lease) -> tuple:
    """The row is still this attempt's, and its lease still live by the catalog's clock: once it ran
    out the sweeper may be settling it (withdrawing uploads, ending the row), and a worker that
    comes back then must not revive it (renew) or finish it under the sweeper."""
    owned = (Export.id == lease.export_id, Export.status == ExportStatus.RUNNING, Export.attempts == lease.attempt)
    if lease.lease_s is None:
        return owned
    return (*owned, lease_live(session.get_bind().dialect.name, lease.lease_s))


def _event(session: Session, lease: Lease, to: ExportStatus, stage: str | None, message: str | None,
           from_status: ExportStatus = ExportStatus.RUNNING) -> None:
    session.add(ExportEvent(export_id=lease.export_id, from_status=from_status.value, to_status=to.value,
                            stage=stage, message=message, worker=lease.worker))


def claim(session: Session, export_id: str, worker: str, pid: int, ort_version: str,
          lease_s: float | None = None) -> Claim:
    """Start the next attempt of a queued export on this worker; a Claim without a lease says why not.

    Only a queued row can be claimed, so a duplicate or stale message finds nothing to do. A
    re-export is only claimed by a worker running the onnxruntime it targets.
    """
    export = session.get(Export, export_id)
    if export is None:
        return Claim(None, None, "there is no such export")
    if export.status is not ExportStatus.QUEUED:
        return Claim(None, export, f"it is {export.status.value}")
    if export.cancel_requested:
        return Claim(None, export, "its cancellation is pending")
    if export.target_ort and export.target_ort != ort_version:
        return Claim(None, export, f"it targets onnxruntime {export.target_ort}; this worker runs {ort_version}")
    attempt, now = export.attempts + 1, db_now(session)
    result = session.execute(
        update(Export)
        .where(Export.id == export_id, Export.status == ExportStatus.QUEUED, Export.attempts == export.attempts,
               Export.cancel_requested.is_(False))
        .values(status=ExportStatus.RUNNING, attempts=attempt, worker=worker, worker_pid=pid, heartbeat_at=now,
                started_at=func.coalesce(Export.started_at, now), stage="resolve", percent=0, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return Claim(None, None, "another worker claimed it first")
    lease = Lease(export_id, attempt, worker, pid, lease_s)
    previous = f" (attempt {attempt - 1}: {export.lost_reason})" if attempt > 1 and export.lost_reason else ""
    _event(session, lease, ExportStatus.RUNNING, "resolve", f"attempt {attempt} started{previous}", ExportStatus.QUEUED)
    session.refresh(export)
    return Claim(lease, export)


def _queued(export: Export) -> tuple:
    """Still the queued row this decision was made on: same attempt count, same class, no cancel."""
    queue = Export.queue.is_(None) if export.queue is None else Export.queue == export.queue
    return (Export.id == export.id, Export.status == ExportStatus.QUEUED, Export.attempts == export.attempts,
            Export.cancel_requested.is_(False), queue)


def reroute(session: Session, export: Export, queue: str, worker: str, why: str, tried: list[str]) -> bool:
    """Send a queued export to another worker class without starting an attempt: this worker cannot
    hold it (``why`` has the figures); ``tried`` lists the classes it is not sent back to. The
    sweeper sends the message (the row is unsent again)."""
    estimate = {**(export.estimate or {}), "refused_on": tried}
    result = session.execute(
        update(Export).where(*_queued(export))
        .values(queue=queue, dispatched_at=None, updated_at=db_now(session), estimate=estimate)
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return False
    session.add(ExportEvent(export_id=export.id, from_status=ExportStatus.QUEUED.value,
                            to_status=ExportStatus.QUEUED.value, message=f"sent to worker class {queue}: {why}",
                            worker=worker))
    return True


def defer(session: Session, export: Export, worker: str, why: str) -> bool:
    """Leave a queued export for another worker of its class: this one has less room now than its
    class is sized for. Said once in the audit trail (a later message finds it said); the sweeper
    rings again for it while the class has an idle worker."""
    said = f"waiting for a worker with room: {why}"
    if session.scalar(select(ExportEvent.id).where(ExportEvent.export_id == export.id, ExportEvent.message == said)):
        return False
    session.add(ExportEvent(export_id=export.id, from_status=ExportStatus.QUEUED.value,
                            to_status=ExportStatus.QUEUED.value, message=said, worker=worker))
    return True


def refuse(session: Session, export: Export, worker: str, why: str) -> bool:
    """Fail a queued export no worker class can hold, once, with the figures, before any attempt."""
    export_id = export.id
    now = db_now(session)
    result = session.execute(
        update(Export).where(*_queued(export))
        .values(status=ExportStatus.FAILED, error=why, finished_at=now, updated_at=now,
                **ended_fields(ExportStatus.FAILED))
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return False
    session.add(ExportEvent(export_id=export_id, from_status=ExportStatus.QUEUED.value,
                            to_status=ExportStatus.FAILED.value, message=why, worker=worker))
    return True


def renew(session: Session, lease: Lease) -> bool:
    """Extend the lease; returns whether a cancel was requested. Raises Fenced if it is no longer ours."""
    row = session.execute(
        update(Export).where(*_owned(session, lease)).values(heartbeat_at=db_now(session))
        .returning(Export.cancel_requested).execution_options(synchronize_session=False)
    ).first()
    if row is None:
        raise Fenced(f"{lease}: the lease was taken away")
    return bool(row[0])


def record_stage(session: Session, lease: Lease, stage: str, percent: int) -> bool:
    """Stage and percent of the running attempt (an event when the stage changes); returns cancel requested."""
    current = session.execute(select(Export.stage).where(*_owned(session, lease))).first()
    if current is None:
        raise Fenced(f"{lease}: refused to record stage {stage}")
    row = session.execute(
        update(Export).where(*_owned(session, lease)).values(stage=stage, percent=percent, heartbeat_at=db_now(session),
                                                  updated_at=db_now(session))
        .returning(Export.cancel_requested).execution_options(synchronize_session=False)
    ).first()
    if row is None:
        raise Fenced(f"{lease}: refused to record stage {stage}")
    if current[0] != stage:
        _event(session, lease, ExportStatus.RUNNING, stage, None)
    return bool(row[0])


def record_revision(session: Session, lease: Lease, revision: str) -> None:
    """The exact revision the attempt downloaded (a hub ref becomes its commit), and the key it makes."""
    export = session.get(Export, lease.export_id)
    result = session.execute(
        update(Export).where(*_owned(session, lease)).values(
            revision=revision, cache_key=cache_key(request_of(export), revision, export.exporter_version,
                                                   export.ort_version), heartbeat_at=db_now(session))
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        raise Fenced(f"{lease}: refused to record revision {revision}")


def begin_publish(session: Session, lease: Lease, prefix: str) -> str | None:
    """Record where this attempt publishes, before its first upload; returns an earlier attempt's prefix.

    Every object an attempt writes is under the prefix recorded here, so whoever settles the job
    later (a cancel, the sweeper) knows what the store may hold for it.
    """
    current = session.execute(select(Export.storage_prefix, Export.cancel_requested).where(*_owned(session, lease))).first()
    if current is None:
        raise Fenced(f"{lease}: refused to start publishing")
    if current.cancel_requested:
        raise CancelRequested(lease.export_id)
    result = session.execute(
        update(Export).where(*_owned(session, lease), Export.cancel_requested.is_(False))
        .values(storage_prefix=prefix, heartbeat_at=db_now(session), updated_at=db_now(session))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        raise Fenced(f"{lease}: refused to start publishing")
    return current.storage_prefix


def finish(session: Session, lease: Lease, status: ExportStatus, *, message: str | None = None,
           runtime: str | None = None, **fields) -> None:
    """End the attempt with a terminal status and its results, if the attempt still owns the export.

    Ready and quarantined are also refused once a cancel was requested (``CancelRequested``): a
    cancelled export must not end published. ``runtime`` is the onnxruntime that built and
    validated it, which also re-keys the export for deduplication.
    """
    if not status.terminal:
        raise ValueError(f"finish needs a terminal status, not {status.value}")
    export = session.get(Export, lease.export_id)
    conditions = list(_owned(session, lease))
    if status in (ExportStatus.READY, ExportStatus.QUARANTINED):
        conditions.append(Export.cancel_requested.is_(False))
        fields["percent"] = 100
    if runtime is not None and export is not None:
        fields |= runtime_fields(export, runtime)
    now = db_now(session)
    result = session.execute(
        update(Export).where(*conditions)
        .values(status=status, finished_at=now, updated_at=now, heartbeat_at=None, error=message,
                **{**ended_fields(status), **fields})
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        session.expire_all()
        still_ours = session.execute(select(Export.cancel_requested).where(*_owned(session, lease))).first()
        if still_ours is not None and still_ours.cancel_requested:
            raise CancelRequested(lease.export_id)
        raise Fenced(f"{lease}: refused to finish {status.value}")
    _event(session, lease, status, fields.get("stage"), message)


def release_lost(session: Session, export_id: str, worker: str, pid: int | None, cause: str) -> bool:
    """Expire the lease of a job whose worker process is known dead, and say how it died.

    Called by the worker's main process when its pool process was killed, and by the embedded
    supervisor when its worker exited; ``pid`` (the worker's main process) keeps it from touching
    a job another process of the same name holds. The sweeper does the rest.
    """
    conditions = [Export.id == export_id, Export.status == ExportStatus.RUNNING, Export.worker == worker]
    if pid is not None:
        conditions.append(Export.worker_pid == pid)
    result = session.execute(
        update(Export).where(*conditions).values(heartbeat_at=None, lost_reason=cause)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def running_on(session: Session, worker: str, pid: int | None = None) -> list[str]:
    """Ids of the running exports whose lease ``worker`` (main process ``pid``) holds."""
    query = select(Export.id).where(Export.status == ExportStatus.RUNNING, Export.worker == worker)
    if pid is not None:
        query = query.where(Export.worker_pid == pid)
    return list(session.scalars(query))
