"""Submitting, describing and cancelling exports: the logic behind the API's routes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from exporter import __version__
from exporter.build import check_request_against_config
from exporter.config import load_model_config
from exporter.architectures import ARCHITECTURES
from exporter.errors import ExportError
from exporter.request import ExportRequest, cache_key
from services.catalog import exports as catalog
from services.catalog.models import Export, ExportStatus
from services.settings import Settings
from services.sources import directory_signature, local_model_dir, resolve_revision
from workers.config import QUEUE_FOR_EP, RUN_EXPORT


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


class BrokerUnavailable(Exception):
    pass


def target_ort_version(session: Session, settings: Settings, ep: str) -> str:
    """The newest onnxruntime among live workers of the request's queue (else the API's own)."""
    from workers.registry import live_workers
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
    session: Session, settings: Settings, request: ExportRequest, *, force: bool = False, send=None,
    reason: str = "request", predecessor_id: str | None = None,
) -> tuple[Export, bool]:
    """Create and queue an export; an identical live one is returned instead unless ``force``.

    Returns (export, created). ``send(export)`` queues the Celery task (after the row commits).
    """
    check_against_local_config(settings, request)
    variant = request.resolved_variant()
    revision = resolve_revision(settings, request.model)
    ort = target_ort_version(session, settings, request.ep.value)
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
        reason=reason, predecessor_id=predecessor_id,
    )
    session.add(export)
    session.flush()
    session.add(catalog.ExportEvent(export_id=export.id, to_status="queued", message=reason))
    return export, True


def request_of(export: Export) -> ExportRequest:
    return ExportRequest(model=export.model, dtype=export.dtype, ep=export.ep, static_cache=export.static_cache,
                         max_seq_len=export.max_seq_len, variant=export.variant)


def record_runtime(export: Export, ort_version: str) -> None:
    """Stamp the onnxruntime that really built and validated ``export`` (and so its cache key)."""
    export.ort_version = ort_version
    export.cache_key = cache_key(request_of(export), export.revision, export.exporter_version, ort_version)


def queue_export(celery_app, export: Export) -> None:
    try:
        celery_app.send_task(RUN_EXPORT, args=[export.id], queue=QUEUE_FOR_EP[export.ep])
    except Exception as err:  # kombu raises many connection error types
        raise BrokerUnavailable(f"the job queue is unreachable ({type(err).__name__}): try again shortly") from err


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


def cancel_export(session: Session, export_id: str) -> Export:
    """Queued: cancelled at once. Running: the worker stops at its next checkpoint."""
    export = session.get(Export, export_id, with_for_update=True)
    if export is None:
        raise NotFound(f"no export {export_id}")
    if export.status.terminal:
        raise Conflict(f"export {export_id} is already {export.status.value}")
    export.cancel_requested = True
    if export.status is ExportStatus.QUEUED:
        catalog.transition(session, export, ExportStatus.CANCELLED, message="cancelled while queued")
    else:
        session.add(catalog.ExportEvent(export_id=export.id, from_status="running", to_status="running",
                                        stage=export.stage, message="cancel requested"))
    return export


def published_files(export: Export) -> dict[str, dict]:
    if not export.manifest:
        return {}
    files = dict(export.manifest.get("files", {}))
    files["manifest.json"] = None  # size/sha256 of the manifest itself are in the store
    return files


def to_json(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


__all__ = ["submit_export", "queue_export", "get_export", "list_exports", "cancel_export", "ExportError"]
