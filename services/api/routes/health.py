"""Health (public), readiness (public, no internals), metrics (read scope); signed local downloads."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import func, select, text

from services import jobs
from services.api.deps import ContextDep, ReaderDep, SessionDep
from services.catalog.database import session_scope
from services.catalog.models import Export
from services.queue import BrokerUnavailable
from services.storage import LocalStore, StorageError

log = logging.getLogger("exportfarm.api")
router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", operation_id="readyz")
def readyz(context: ContextDep):
    """Whether the catalog, the broker and the object store answer now. Details go to the log, not
    to the (unauthenticated) caller."""
    def database() -> None:
        with session_scope(context.settings.catalog_url) as session:
            session.execute(text("SELECT 1"))

    checks = {}
    for name, check, failure in (("database", database, Exception), ("broker", context.queue.check, BrokerUnavailable),
                                 ("storage", context.store.check, StorageError)):
        try:
            check()
            checks[name] = "ok"
        except failure as err:
            log.warning("readyz: %s: %s", name, err)
            checks[name] = "unavailable"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks}, status_code=200 if ready else 503,
                        headers=None if ready else {"Retry-After": "5"})


@router.get("/metrics", operation_id="metrics")
def prometheus(session: SessionDep, context: ContextDep, _: ReaderDep):
    counts = dict(session.execute(select(Export.status, func.count()).group_by(Export.status)).all())
    return Response(context.metrics.render({k.value: v for k, v in counts.items()}), media_type="text/plain; version=0.0.4")


@router.get("/files/{key:path}", include_in_schema=False)
def local_file(key: str, context: ContextDep, expires: str = Query(..., max_length=20),
               signature: str = Query(..., max_length=128)):
    store = context.store
    if not isinstance(store, LocalStore) or not store.verify_link(key, expires, signature):
        raise jobs.Forbidden("invalid or expired link")
    path = store.open_file(key)
    if path is None:
        raise jobs.NotFound("no such object")
    return FileResponse(path)
