"""The catalog's views: models and their exports, regressions, workers; re-exports by hand."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from services import jobs
from services.api.deps import AdminDep, ContextDep, ReaderDep, SessionDep
from services.api.schemas import ReexportRequest
from services.catalog.models import RuntimeReport, Worker
from services.catalog.views import latest_ready
from services.regressions import regressions_view
from services.scheduler import newest_runtimes, plan_and_queue_reexports
from services.sweeper import SweepReport

router = APIRouter(tags=["catalog"])


@router.get("/catalog/models", operation_id="catalog_models")
def catalog_models(session: SessionDep, _: ReaderDep) -> dict:
    return latest_ready(session)


@router.get("/catalog/models/{model:path}", operation_id="catalog_model")
def catalog_model(model: str, session: SessionDep, _: ReaderDep) -> dict:
    views = latest_ready(session, model)
    if model not in views:
        raise jobs.NotFound(f"no ready export of {model}")
    return {"model": model, "variants": views[model]}


@router.get("/catalog/regressions", operation_id="catalog_regressions")
def catalog_regressions(session: SessionDep, _: ReaderDep) -> list:
    return regressions_view(session)


@router.get("/workers", operation_id="workers")
def workers(session: SessionDep, context: ContextDep, _: ReaderDep) -> dict:
    """Workers, the runtimes they report, what each has and which GPU it is bound to, the worker
    classes jobs are placed on, and the newest runtime per queue among live ones."""
    from services.placement import queue_classes

    return {
        "newest_live_runtime": newest_runtimes(session, context.settings),
        "queue_classes": {c.name: {"ep": c.ep.value, **c.capacity.to_dict()} for c in queue_classes(context.settings)},
        "workers": [{"hostname": w.hostname, "queues": w.queues, "onnxruntime": w.onnxruntime, "cuda": w.cuda,
                     "gpu": w.gpu, "gpu_device": w.gpu_device, "capacity": w.capacity, "last_seen": w.last_seen}
                    for w in session.scalars(select(Worker))],
        "history": [{"hostname": r.hostname, "onnxruntime": r.onnxruntime, "cuda": r.cuda, "gpu": r.gpu,
                     "queues": r.queues, "reported_at": r.reported_at}
                    for r in session.scalars(select(RuntimeReport).order_by(RuntimeReport.id.desc()).limit(200))],
    }


@router.post("/reexports", operation_id="reexports")
def reexports(session: SessionDep, context: ContextDep, _: AdminDep, body: ReexportRequest | None = None) -> dict:
    """Re-export what the newest worker runtimes made stale (beat's check, by hand)."""
    body = body or ReexportRequest()
    plan = plan_and_queue_reexports(session, context.settings, policy=body.policy, models=body.models, limit=body.limit)
    session.commit()
    sent = SweepReport()
    context.sweeper.dispatch(sent, grace_s=0)  # users' exports first: a re-export may wait for them
    return {**plan.to_dict(), "sent": sent.dispatched,
            "waiting": [q["export_id"] for q in plan.queued if q["export_id"] not in sent.dispatched]}
