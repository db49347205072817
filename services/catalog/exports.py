"""Export rows and their lifecycle: every change of status or stage leaves an audit event."""

from __future__ import annotations

import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.catalog.models import LIVE_STATUSES, Export, ExportEvent, ExportStatus, utcnow

# Which status may follow which. Anything else is a bug in the caller, not a user error.
TRANSITIONS = {
    ExportStatus.QUEUED: {ExportStatus.RUNNING, ExportStatus.CANCELLED, ExportStatus.FAILED},
    ExportStatus.RUNNING: {
        ExportStatus.RUNNING, ExportStatus.READY, ExportStatus.QUARANTINED, ExportStatus.FAILED,
        ExportStatus.CANCELLED, ExportStatus.QUEUED,
    },
    ExportStatus.READY: set(),
    ExportStatus.QUARANTINED: set(),
    ExportStatus.FAILED: set(),
    ExportStatus.CANCELLED: set(),
}


class TransitionError(RuntimeError):
    pass


def transition(
    session: Session, export: Export, to: ExportStatus, *, stage: str | None = None,
    message: str | None = None, worker: str | None = None,
) -> None:
    """Move ``export`` to status ``to`` and record the event."""
    if to not in TRANSITIONS[export.status]:
        raise TransitionError(f"export {export.id}: {export.status.value} -> {to.value} is not allowed")
    now = utcnow()
    session.add(ExportEvent(
        export_id=export.id, at=now, from_status=export.status.value, to_status=to.value, stage=stage,
        message=message, worker=worker,
    ))
    export.status = to
    if stage is not None:
        export.stage = stage
    if to is ExportStatus.RUNNING and export.started_at is None:
        export.started_at = now
    if to.terminal:
        export.finished_at = now
    export.updated_at = now


def record_stage(session: Session, export_id: str, stage: str, percent: int, worker: str | None) -> bool:
    """Update stage and percent of a running export; False if it is no longer running (cancelled)."""
    export = session.get(Export, export_id)
    if export is None or export.status is not ExportStatus.RUNNING or export.cancel_requested:
        return False
    if export.stage != stage:
        session.add(ExportEvent(export_id=export_id, from_status="running", to_status="running", stage=stage, worker=worker))
    export.stage, export.percent = stage, percent
    export.heartbeat_at = export.updated_at = utcnow()
    return True


def heartbeat(session: Session, export_id: str, worker: str) -> bool:
    """Renew the running job's lease; False when the job was cancelled (the worker should stop)."""
    result = session.execute(
        update(Export)
        .where(Export.id == export_id, Export.status == ExportStatus.RUNNING, Export.worker == worker,
               Export.cancel_requested.is_(False))
        .values(heartbeat_at=utcnow())
    )
    return result.rowcount == 1


def find_live_duplicate(session: Session, cache_key: str) -> Export | None:
    """The newest queued / running / ready export with this cache key, if any."""
    return session.scalars(
        select(Export).where(Export.cache_key == cache_key, Export.status.in_(LIVE_STATUSES))
        .order_by(Export.created_at.desc()).limit(1)
    ).first()


def lease_expired(export: Export, lease_s: float, now: datetime.datetime | None = None) -> bool:
    now = now or utcnow()
    beat = export.heartbeat_at or export.started_at
    if beat is None:
        return True
    if beat.tzinfo is None:  # SQLite hands back naive datetimes
        beat = beat.replace(tzinfo=datetime.timezone.utc)
    return (now - beat).total_seconds() > lease_s
