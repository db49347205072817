"""The API: one router per resource (services/api/routes), logic in services.*, errors in one place.

The catalog schema must be current (``exportfarm db-upgrade``; the Helm migration job; embedded
``serve`` runs it once at start): the app refuses to start on an older one rather than migrate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI

from services.api import errors
from services.api.context import ApiContext
from services.api.guard import Guard
from services.api.routes import catalog, exports, health, tokens
from services.ui import routes as pages
from services.auth import install_bootstrap
from services.catalog.database import check_schema, session_scope
from services.metrics import Metrics
from services.queue import CeleryQueue, JobQueue
from services.settings import Settings, get_settings
from services.storage import StorageError
from services.storage_factory import make_store
from services.sweeper import Sweeper

log = logging.getLogger(__name__)


class Timed:
    """Request latency by method, route template and status, as a plain ASGI middleware."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope["method"], route, str(status)).observe(time.perf_counter() - start)


def create_app(settings: Settings | None = None, job_queue: JobQueue | None = None,
               on_shutdown: tuple[Callable[[], None], ...] = ()) -> FastAPI:
    """The API app. ``on_shutdown`` runs when the server shuts down (embedded serve stops its worker there)."""
    settings = settings or get_settings()
    check_schema(settings.catalog_url)
    if settings.admin_token:
        with session_scope(settings.catalog_url) as session:
            refused = install_bootstrap(session, settings.admin_token)
        if refused:
            log.warning(refused)
    store = make_store(settings, patient=False)  # a request waits seconds for the store, never minutes
    try:
        store.ensure_bucket()
    except StorageError:
        pass  # reported by /readyz until storage is reachable; the API still serves the catalog
    job_queue = job_queue or CeleryQueue(settings)
    context = ApiContext(settings, store, job_queue, Sweeper(settings, job_queue, store), Metrics())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        for stop in on_shutdown:
            await asyncio.to_thread(stop)

    app = FastAPI(
        title="exportfarm", version="0.1.0", lifespan=lifespan, max_body_size=settings.max_body_bytes,
        description="Export Hugging Face LLMs to ONNX, proven against transformers, benchmarked, published.",
    )
    app.state.context = context
    errors.register(app)
    for router in (exports.router, catalog.router, tokens.router, health.router, pages.router):
        app.include_router(router)

    app.add_middleware(Timed, metrics=context.metrics)
    app.add_middleware(Guard, context=context)  # outermost: authenticate before anything reads the body
    return app
