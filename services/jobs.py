"""Submitting, describing and cancelling exports: the logic behind the API's routes."""

from __future__ import annotations

import functools
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from exporter import __version__
from exporter.build import check_request_against_config
from exporter.config import load_model_config
from exporter.architectures import ARCHITECTURES
from exporter.errors import ExportError
from exporter.request import ExportRequest, cache_key
from exporter.validate import check_validatable
from services.catalog import exports as catalog
from services.catalog.exports import lease_expired, request_of
from services.catalog.models import Export, ExportStatus
from services.catalog.workers import live_workers
from services.queue import QUEUE_FOR_EP
from services.settings import Settings
from services.sources import directory_signature, local_model_dir, resolve_revision


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


def target_ort_version(session: Session, settings: Settings, ep: str) -> str:
    """The newest onnxruntime among live workers of the request's queue (else the API's own)."""
    from exporter.versions import ort_version

    queue = QUEUE_FOR_EP[ep]
    versions = [w.onnxruntime for w in live_workers(settings, session) if queue in w.queues.split(",")]
    return max(versions, key=_version_tuple) if versions else ort_version()


def _version_tuple(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split("."))


def check_against_local_config(settings: Settings, request: ExportRequest) -> None:
    """Refuse what a local model cannot do (max_seq_len above its positions, ...) before queueing."""
    directory = local_model_dir(settings, request.model)
    if directory is not None:
        config = _model_config(str(directory), directory_signature(directory))
        check_request_against_config(request, request.resolved_variant(), config)


@functools.lru_cache(maxsize=256)
def _model_config(directory: str, signature: tuple):
    """config.json read through transformers, once per version of the directory (it is not cheap)."""
    return load_model_config(Path(directory), ARCHITECTURES)


def submit_export(
    session: Session, settings: Settings, request: ExportRequest, *, force: bool = False,
    reason: str = "request", predecessor_id: str | None = None, target_ort: str | None = None,
) -> tuple[Export, bool]:
    """Add an export to the catalog as queued; an identical live one is returned instead unless ``force``.

    Returns (export, created). The row is the outbox entry: the caller commits it, then sends it
    (services.sweeper.Sweeper.ring); if that send never happens, the sweeper sends it. A re-export
    names the onnxruntime it must be built on (``target_ort``); only workers running it take it.
    """
    check_against_local_config(settings, request)
    check_validatable(request.max_seq_len)  # the farm validates every export
    variant = request.resolved_variant()
    revision = resolve_revision(settings, request.model)
    ort = target_ort or target_ort_version(session, settings, request.ep.value)
    key = cache_key(request, revision, __version__, ort)
    if session.get_bind().dialect.name == "postgresql":
        # Identical concurrent POSTs: serialize check-then-insert per cache key (until commit).
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": key})
    if not force:
        existing = catalog.find_live_duplicate(session, key)
        if existing is not None:
            return existing, False
    export = Export(
        cache_key=key, model=request.model, revision=revision, dtype=request.dtype.value, ep=request.ep.value,
        static_cache=request.static_cache, max_seq_len=request.max_seq_len, variant=variant.value,
        ort_version=ort, exporter_version=__version__, status=ExportStatus.QUEUED, stage=None, percent=0,
        reason=reason, predecessor_id=predecessor_id, target_ort=target_ort,
    )
    session.add(export)
    session.flush()
    session.add(catalog.ExportEvent(export_id=export.id, to_status="queued", message=reason))
    return export, True


def get_export(session: Session, export_id: str) -> Export:
    export = session.get(Export, export_id)
    if export is None:
        raise NotFound(f"no export {export_id}")
    return export


def list_exports(session: Session, *, model=None, status=None, variant=None, limit=50, offset=0) -> tuple[list[Export], int]:
    query = select(Export)
    if model:
        query = query.where(Export.model == model)
    if status:
        query = query.where(Export.status == ExportStatus(status))
    if variant:
        query = query.where(Export.variant == variant)
    total = session.scalar(select(func.count()).select_from(query.subquery()))
    rows = session.scalars(query.order_by(Export.created_at.desc(), Export.id).limit(limit).offset(offset)).all()
    return list(rows), int(total or 0)


def request_cancel(session: Session, settings: Settings, export_id: str) -> tuple[Export, bool]:
    """Ask for an export to be cancelled; returns it and whether someone must settle the cancel now.

    Queued without anything published: cancelled at once. Running with a live lease: its worker
    stops at its next checkpoint (within HEARTBEAT_S), deletes what it uploaded and cancels. A
    queued export an earlier attempt began publishing, or a running one whose worker is gone, needs
    its uploads deleted before it may say cancelled: ``True``, and the caller runs
    ``Sweeper.settle_cancel`` after committing (the sweeper does it too, if the store is down).
    """
    export = session.get(Export, export_id, with_for_update=True)
    if export is None:
        raise NotFound(f"no export {export_id}")
    if export.status.terminal:
        raise Conflict(f"export {export_id} is already {export.status.value}")
    if not export.cancel_requested:
        export.cancel_requested = True
        session.add(catalog.ExportEvent(export_id=export.id, from_status=export.status.value,
                                        to_status=export.status.value, stage=export.stage, message="cancel requested"))
    if export.status is ExportStatus.QUEUED and not export.storage_prefix:
        catalog.transition(session, export, ExportStatus.CANCELLED, message="cancelled while queued")
        export.error = "cancelled"
        return export, False
    live = export.status is ExportStatus.RUNNING and not lease_expired(export, settings.lease_s)
    return export, not live


__all__ = ["submit_export", "request_cancel", "get_export", "list_exports", "request_of", "ExportError"]
