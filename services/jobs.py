"""Submitting, describing and cancelling exports: the logic behind the API's routes."""

from __future__ import annotations

import functools
import time
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from exporter import __version__, contract
from exporter.graph.build import check_request_against_config
from exporter.graph.config import load_model_config
from exporter.graph.architectures import ARCHITECTURES
from exporter.errors import ExportError
from exporter.graph.language_model import check_image_text_request, image_text_type, language_model
from exporter.graph.traced import check_traced_request, resolve_builder
from exporter.request import ExportRequest, Variant, cache_key
from exporter.validation.validate import check_validatable
from services.catalog import exports as catalog
from services.catalog.exports import lease_expired, request_of
from services.catalog.models import Export, ExportStatus, db_now
from services.catalog.workers import live_workers
from services import placement
from services.settings import Settings
from services.sources import UNRESOLVED_PREFIX, ModelSource, directory_signature, locate_model, request_revision


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


class Forbidden(Exception):
    pass


_TARGETS: dict[tuple[str, str], tuple[float, str]] = {}
TARGET_CACHE_S = 5.0  # a newly started worker's runtime is targeted within this long


def target_ort_version(session: Session, settings: Settings, queue: str) -> str:
    """The newest onnxruntime among live workers of the job's queue (else the API's own).

    Read at most every TARGET_CACHE_S per catalog and queue: every POST needs it, workers change rarely.
    """
    from exporter.versions import ort_version

    key, now = (settings.catalog_url, queue), time.monotonic()
    hit = _TARGETS.get(key)
    if hit is not None and now - hit[0] < TARGET_CACHE_S:
        return hit[1]
    versions = [w.onnxruntime for w in live_workers(settings, session) if queue in w.queues.split(",")]
    target = max(versions, key=_version_tuple) if versions else ort_version()
    _TARGETS[key] = (now, target)
    return target


def _version_tuple(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split("."))


def check_against_local_config(source: ModelSource, request: ExportRequest) -> None:
    """Refuse what a local model cannot do (max_seq_len above its positions, ...) before queueing."""
    if traced_locally(source, request):
        check_traced_request(request)  # transformers' config is read by the trace itself, on the worker
    elif source.local:
        if image_text_type(source.directory):  # an image-text export's refusals, before queueing
            check_image_text_request(request, source.directory)
        config = _model_config(str(source.directory), directory_signature(source.directory))
        check_request_against_config(request, request.resolved_variant(), config)


def traced_locally(source: ModelSource, request: ExportRequest) -> bool:
    """Whether a local model is exported through transformers.exporters (no hand-built architecture, or
    builder traced); ExportError for builder hand on a model without one. A hub model's worker decides."""
    return source.local and resolve_builder(request, source.directory) == contract.BUILDER_TRACED


@functools.lru_cache(maxsize=256)
def _model_config(directory: str, signature: tuple):
    """config.json read through transformers, once per version of the directory (it is not cheap); an image-text
    checkpoint's: its language model's (the decoder, which the request's limits and the estimate are about)."""
    if image_text_type(Path(directory)):
        return language_model(Path(directory)).config
    return load_model_config(Path(directory), ARCHITECTURES)


def submit_export(
    session: Session, settings: Settings, request: ExportRequest, *, force: bool = False,
    reason: str = "request", predecessor_id: str | None = None, target_ort: str | None = None,
    revision: str | None = None,
) -> tuple[Export, bool]:
    """Add an export to the catalog as queued; an identical live one is returned instead unless ``force``.

    Returns (export, created). Identity is the request key (request + revision + exporter + target
    onnxruntime); a unique constraint on the live key makes concurrent identical requests share one
    export on SQLite and PostgreSQL alike. The row is the outbox entry: the caller commits it, then
    sends it (Sweeper.ring); if that send never happens, the sweeper sends it. A re-export names the
    onnxruntime it must be built on (``target_ort``); only workers running it take it. ``revision``
    pins the weights (a re-export is built from its predecessor's): a hub commit is downloaded as
    it is; a local checkpoint whose files changed since is refused, since a runtime diff on other
    weights would blame onnxruntime for them.
    """
    source = locate_model(settings, request.model)
    check_against_local_config(source, request)
    check_validatable(request.max_seq_len)  # the farm validates every export
    # a traced graph is mapped onto attn_dynamic whatever the request's EP would choose
    variant = Variant.ATTN_DYNAMIC if traced_locally(source, request) else request.resolved_variant()
    current = request_revision(source)
    if revision is None or revision.startswith(UNRESOLVED_PREFIX):
        revision = current
    elif source.local and revision != current:
        raise ExportError(f"{request.model} changed since it was exported ({revision} -> {current}): a re-export "
                          "compares runtimes on the same weights; export the new weights as a new request")
    # What the job needs, before anything runs: the smallest worker class that holds it, or a
    # refusal with the figures when none can (a hub model's config is read by its worker).
    estimate = placement.job_estimate(settings, request, source)
    queue = placement.place(settings, request, estimate)
    ort = target_ort or target_ort_version(session, settings, queue)
    key = cache_key(request, revision, __version__, ort)
    if not force:
        existing = catalog.find_live_duplicate(session, key)
        if existing is not None:
            return existing, False
    export = Export(
        cache_key=key, request_key=key, live_key=None if force else key, model=request.model, revision=revision,
        dtype=request.dtype.value, ep=request.ep.value, static_cache=request.static_cache,
        max_seq_len=request.max_seq_len, variant=variant.value, ort_version=ort, exporter_version=__version__,
        quant=request.quant.to_dict() if request.quant else None, layout=request.layout, compat=request.compat,
        builder=request.builder, queue=queue,
        estimate=estimate.to_dict() if estimate is not None else None,
        status=ExportStatus.QUEUED, stage=None, percent=0, reason=reason, predecessor_id=predecessor_id,
        target_ort=target_ort,
    )
    try:
        with session.begin_nested():
            session.add(export)
            session.flush()
    except IntegrityError:
        existing = catalog.find_live_duplicate(session, key) if not force else None
        if existing is None:
            raise
        return existing, False  # an identical request committed first
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
    if export.status is ExportStatus.QUEUED and not export.storage_prefix:
        # One conditional UPDATE: SQLite takes no row lock on the read above, so a worker may have
        # claimed the row since; then this changes nothing and the cancel goes to its worker.
        now, attempts = db_now(session), export.attempts
        done = session.execute(
            update(Export).where(Export.id == export_id, Export.status == ExportStatus.QUEUED,
                                 Export.attempts == attempts, Export.storage_prefix.is_(None))
            .values(status=ExportStatus.CANCELLED, cancel_requested=True, error="cancelled", live_key=None,
                    finished_at=now, updated_at=now)
            .execution_options(synchronize_session=False))
        session.expire(export)
        if done.rowcount == 1:
            for message, to in (("cancel requested", ExportStatus.QUEUED), ("cancelled while queued",
                                                                            ExportStatus.CANCELLED)):
                session.add(catalog.ExportEvent(export_id=export_id, at=now, from_status=ExportStatus.QUEUED.value,
                                                to_status=to.value, message=message))
            return session.get(Export, export_id), False
        export = session.get(Export, export_id)
        if export.status.terminal:
            raise Conflict(f"export {export_id} is already {export.status.value}")
    if not export.cancel_requested:
        session.execute(update(Export).where(Export.id == export_id).values(cancel_requested=True)
                        .execution_options(synchronize_session=False))
        session.expire(export)
        export = session.get(Export, export_id)
        session.add(catalog.ExportEvent(export_id=export.id, from_status=export.status.value,
                                        to_status=export.status.value, stage=export.stage, message="cancel requested"))
    live = export.status is ExportStatus.RUNNING and not lease_expired(export, settings.lease_s,
                                                                        db_now(session))
    return export, not live


__all__ = ["submit_export", "request_cancel", "get_export", "list_exports", "request_of", "ExportError"]
