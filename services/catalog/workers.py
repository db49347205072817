"""Which workers are alive, what they consume and whether they are busy (from their reports)."""

from __future__ import annotations

import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.catalog.models import Export, ExportStatus, Worker, db_now
from services.settings import Settings


def aware(moment: datetime.datetime | None) -> datetime.datetime | None:
    """SQLite hands back naive datetimes; every time the catalog stores is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=datetime.timezone.utc)


def live_workers(settings: Settings, session: Session, within_s: float | None = None) -> list[Worker]:
    """Workers that reported within three report intervals (or ``within_s``)."""
    horizon = db_now(session) - datetime.timedelta(seconds=within_s or 3 * settings.worker_report_s)
    return [w for w in session.scalars(select(Worker)).all() if aware(w.last_seen) >= horizon]


def consumers(settings: Settings, session: Session) -> dict[str, list[Worker]]:
    """{queue name: live workers consuming it}."""
    by_queue: dict[str, list[Worker]] = {}
    for worker in live_workers(settings, session):
        for queue in worker.queues.split(","):
            by_queue.setdefault(queue, []).append(worker)
    return by_queue


def busy_workers(session: Session) -> set[str]:
    """Names of workers that hold a running job's lease now."""
    return set(session.scalars(select(Export.worker).where(Export.status == ExportStatus.RUNNING)).all())
