"""FastAPI application factory: routes stay thin, the logic is in services.jobs and friends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from exporter.errors import ExportError
from services import jobs
from services.api.schemas import (
    Artifact, Artifacts, ExportCreate, ExportEventOut, ExportList, ExportOut, Links, ReexportRequest,
)
from services.auth import allows, create_token, token_scope
from services.catalog.database import session_factory, session_scope, upgrade_schema
from services.catalog.exports import PUBLISHED_STATUSES
from services.catalog.models import Export
from services.catalog.views import latest_ready
from services.metrics import Metrics
from services.queue import BrokerUnavailable, CeleryQueue, JobQueue, queue_for
from services.settings import Settings, get_settings
from services.storage import LocalStore, StorageError, verify_local_signature
from services.storage_factory import make_store
from services.sweeper import SweepReport, Sweeper

bearer = HTTPBearer(auto_error=False)
EXPORT_FIELDS = tuple(name for name in ExportOut.model_fields if name not in ("links", "events"))


def create_app(settings: Settings | None = None, job_queue: JobQueue | None = None,
               on_shutdown: tuple[Callable[[], None], ...] = ()) -> FastAPI:
    """The API. ``on_shutdown`` runs when the server shuts down (embedded serve stops its worker there)."""
    settings = settings or get_settings()
    upgrade_schema(settings.catalog_url)
    sessions = session_factory(settings.catalog_url)
    if settings.admin_token:
        with sessions.begin() as session:
            create_token(session, "bootstrap-admin", "admin", settings.admin_token)
    store = make_store(settings)
    try:
        store.ensure_bucket()
    except StorageError:
        pass  # reported by /readyz until storage is reachable; the API still serves the catalog
    metrics = Metrics()
    job_queue = job_queue or CeleryQueue(settings)
    sweeper = Sweeper(settings, job_queue, store)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        for stop in on_shutdown:
            await asyncio.to_thread(stop)

    app = FastAPI(
        title="exportfarm",
        version="0.1.0",
        description="Export Hugging Face LLMs to ONNX, proven against transformers, benchmarked, published.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.store, app.state.job_queue = settings, store, job_queue

    def db() -> Session:
        with session_scope(settings.catalog_url) as session:  # one transaction per request
            yield session

    def scope_of(credentials: HTTPAuthorizationCredentials | None, session: Session) -> str:
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        scope = token_scope(session, credentials.credentials)
        if scope is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
        return scope

    def reader(credentials=Depends(bearer), session: Session = Depends(db, scope="function")) -> str:
        return scope_of(credentials, session)

    def admin(credentials=Depends(bearer), session: Session = Depends(db, scope="function")) -> str:
        scope = scope_of(credentials, session)
        if not allows(scope, "admin"):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "this token has the read scope; the action needs admin")
        return scope

    @app.middleware("http")
    async def limit_and_time(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return JSONResponse({"detail": f"request body over {settings.max_body_bytes} bytes"}, status_code=413)
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(request.method, getattr(route, "path", "unmatched"), str(response.status_code)).observe(
            time.perf_counter() - start)
        return response

    @app.exception_handler(RequestValidationError)
    async def readable_422(_request: Request, err: RequestValidationError):
        messages = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            text_ = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            messages.append(f"{where}: {text_}" if where else text_)
        return JSONResponse({"detail": "; ".join(messages), "errors": [m for m in messages]}, status_code=422)

    def links(export: Export) -> Links:
        base = f"/exports/{export.id}"
        return Links(self=base, artifacts=f"{base}/artifacts" if export.status in PUBLISHED_STATUSES else None)

    def out(export: Export, with_events: bool = False) -> ExportOut:
        # Column fields only: touching ``events`` would lazy-load a relationship per row.
        data = {c: getattr(export, c) for c in EXPORT_FIELDS}
        data["status"] = export.status.value
        events = [ExportEventOut.model_validate(e, from_attributes=True) for e in export.events] if with_events else []
        return ExportOut(**data, links=links(export), events=events)

    @app.post("/exports", status_code=202, response_model=ExportOut, tags=["exports"],
              responses={200: {"description": "an identical export exists; it is returned"}})
    def create_export(body: ExportCreate, response: Response, session: Session = Depends(db, scope="function"), _=Depends(admin)):
        try:
            export, created = jobs.submit_export(session, settings, body.to_request(), force=body.force)
        except ExportError as err:
            raise HTTPException(422, str(err)) from None
        # Commit here, in this thread: it releases the per-cache-key lock at once, without waiting
        # for the dependency teardown to find a free worker thread under load.
        session.commit()
        if not created:
            metrics.submissions.labels("duplicate").inc()
            response.status_code = 200
            return out(export)
        # The row is committed (the outbox); if the broker does not take the message now, the
        # sweeper sends it once the broker is back, so the request is accepted either way.
        sent = sweeper.ring(export.id, queue_for(export.ep, export.target_ort), first=True)
        metrics.submissions.labels("queued" if sent else "queued-unsent").inc()
        session.refresh(export)
        response.headers["Location"] = f"/exports/{export.id}"
        return out(export)

    @app.get("/exports/{export_id}", response_model=ExportOut, tags=["exports"])
    def read_export(export_id: str, session: Session = Depends(db, scope="function"), _=Depends(reader)):
        try:
            return out(jobs.get_export(session, export_id), with_events=True)
        except jobs.NotFound as err:
            raise HTTPException(404, str(err)) from None

    @app.get("/exports", response_model=ExportList, tags=["exports"])
    def search_exports(
        model: str | None = None, status_: str | None = Query(None, alias="status"), variant: str | None = None,
        limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0),
        session: Session = Depends(db, scope="function"), _=Depends(reader),
    ):
        from services.catalog.models import ExportStatus

        if status_ is not None and status_ not in {s.value for s in ExportStatus}:
            raise HTTPException(422, f"status must be one of {', '.join(s.value for s in ExportStatus)}")
        rows, total = jobs.list_exports(session, model=model, status=status_, variant=variant, limit=limit, offset=offset)
        return ExportList(items=[out(r) for r in rows], total=total, limit=limit, offset=offset)

    @app.delete("/exports/{export_id}", response_model=ExportOut, status_code=202, tags=["exports"])
    def cancel(export_id: str, session: Session = Depends(db, scope="function"), _=Depends(admin)):
        """Cancel: at once when queued or when its worker is gone; a live worker stops within HEARTBEAT_S."""
        try:
            export, settle = jobs.request_cancel(session, settings, export_id)
        except jobs.NotFound as err:
            raise HTTPException(404, str(err)) from None
        except jobs.Conflict as err:
            raise HTTPException(409, str(err)) from None
        session.commit()
        if settle:
            sweeper.settle_cancel(export_id)
            session.refresh(export)
        return out(export)

    @app.get("/exports/{export_id}/artifacts", response_model=Artifacts, tags=["exports"])
    def artifacts(export_id: str, session: Session = Depends(db, scope="function"), _=Depends(reader)):
        try:
            export = jobs.get_export(session, export_id)
        except jobs.NotFound as err:
            raise HTTPException(404, str(err)) from None
        if export.status not in PUBLISHED_STATUSES or not export.manifest:
            raise HTTPException(409, f"export {export_id} is {export.status.value}: nothing is published yet")
        files = {}
        for name, entry in {**export.manifest["files"], "manifest.json": None}.items():
            key = export.storage_prefix + name
            info = store.head(key) if entry is None else None
            files[name] = Artifact(
                url=store.presigned_url(key, settings.presign_expires_s),
                size=entry["size"] if entry else (info.size if info else 0),
                sha256=entry["sha256"] if entry else ((info.sha256 or "") if info else ""),
            )
        return Artifacts(export_id=export.id, prefix=export.storage_prefix, expires_in_s=settings.presign_expires_s, files=files)

    @app.post("/reexports", tags=["catalog"])
    def reexports(body: ReexportRequest | None = None, session: Session = Depends(db, scope="function"), _=Depends(admin)):
        """Re-export what the newest worker runtimes made stale (the beat's check, by hand)."""
        from services.scheduler import plan_and_queue_reexports

        body = body or ReexportRequest()
        plan = plan_and_queue_reexports(session, settings, policy=body.policy, models=body.models, limit=body.limit)
        session.commit()
        sent = SweepReport()
        sweeper.dispatch(sent, grace_s=0)  # users' exports first: a re-export may wait for them
        return {**plan.to_dict(), "sent": sent.dispatched, "waiting": [q["export_id"] for q in plan.queued
                                                                       if q["export_id"] not in sent.dispatched]}

    @app.get("/exports/{export_id}/diff", tags=["exports"])
    def export_diff(export_id: str, session: Session = Depends(db, scope="function"), _=Depends(reader)):
        try:
            export = jobs.get_export(session, export_id)
        except jobs.NotFound as err:
            raise HTTPException(404, str(err)) from None
        if export.diff is None:
            raise HTTPException(404, f"export {export_id} has no diff (it is not a re-export, or is not finished)")
        return export.diff

    @app.get("/catalog/regressions", tags=["catalog"])
    def catalog_regressions(session: Session = Depends(db, scope="function"), _=Depends(reader)):
        from services.regressions import regressions_view

        return regressions_view(session)

    @app.get("/workers", tags=["catalog"])
    def workers_view(session: Session = Depends(db, scope="function"), _=Depends(reader)):
        """Workers, the runtimes they report, and the newest runtime per queue among live ones."""
        from services.catalog.models import RuntimeReport, Worker
        from services.scheduler import newest_runtimes

        return {
            "newest_live_runtime": newest_runtimes(session, settings),
            "workers": [{"hostname": w.hostname, "queues": w.queues, "onnxruntime": w.onnxruntime, "cuda": w.cuda,
                         "gpu": w.gpu, "last_seen": w.last_seen} for w in session.scalars(select(Worker))],
            "history": [{"hostname": r.hostname, "onnxruntime": r.onnxruntime, "cuda": r.cuda, "gpu": r.gpu,
                         "queues": r.queues, "reported_at": r.reported_at}
                        for r in session.scalars(select(RuntimeReport).order_by(RuntimeReport.id.desc()).limit(200))],
        }

    @app.get("/catalog/models", tags=["catalog"])
    def catalog_models(session: Session = Depends(db, scope="function"), _=Depends(reader)):
        return latest_ready(session)

    @app.get("/catalog/models/{model:path}", tags=["catalog"])
    def catalog_model(model: str, session: Session = Depends(db, scope="function"), _=Depends(reader)):
        views = latest_ready(session, model)
        if model not in views:
            raise HTTPException(404, f"no ready export of {model}")
        return {"model": model, "variants": views[model]}

    @app.get("/files/{key:path}", include_in_schema=False)
    def local_file(key: str, expires: int, signature: str):
        if not isinstance(store, LocalStore) or not verify_local_signature(settings.signing_secret, key, expires, signature):
            raise HTTPException(403, "invalid or expired link")
        path = store.open_file(key)
        if path is None:
            raise HTTPException(404, "no such object")
        return FileResponse(path)

    @app.get("/healthz", tags=["health"])
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz(session: Session = Depends(db, scope="function")):
        checks = {}
        try:
            session.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as err:
            checks["database"] = f"error: {err}"
        try:
            job_queue.check()
            checks["broker"] = "ok"
        except BrokerUnavailable as err:
            checks["broker"] = f"error: {err}"
        try:
            store.check()
            checks["storage"] = "ok"
        except StorageError as err:
            checks["storage"] = f"error: {err}"
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["health"])
    def prometheus(session: Session = Depends(db, scope="function"), _=Depends(reader)):
        counts = dict(session.execute(select(Export.status, func.count()).group_by(Export.status)).all())
        return Response(metrics.render({k.value: v for k, v in counts.items()}), media_type="text/plain; version=0.0.4")

    return app
