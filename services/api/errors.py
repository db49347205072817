"""One mapping from what can go wrong to what the client is told.

- A request the farm cannot serve (``ExportError``, not found, conflict, bad fields): 4xx with a
  message saying what to change.
- The catalog or the object store unavailable (or the catalog locked past its 5 s busy timeout):
  503 with Retry-After, so a client or a load balancer retries instead of giving up.
- Anything else is a bug: a logged 500 whose body carries only an id to quote, never internals.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from exporter.errors import ExportError
from services.jobs import Conflict, Forbidden, NotFound
from services.queue import BrokerUnavailable
from services.storage import StorageError

log = logging.getLogger("exportfarm.api")
RETRY_AFTER_S = "5"


def _respond(request: Request, body: dict, status_code: int, headers: dict | None = None):
    """JSON for the API; for the pages (/ui) the same message as a page a person can read."""
    if request.url.path == "/ui" or request.url.path.startswith("/ui/"):
        from services.ui.routes import error_page

        return error_page(request, status_code, body["detail"], body.get("error_id"), headers)
    return JSONResponse(body, status_code=status_code, headers=headers)


def _unavailable(request: Request, what: str):
    return _respond(request, {"detail": f"{what} is unavailable right now: try again shortly"}, 503,
                    {"Retry-After": RETRY_AFTER_S})


def register(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def readable_422(request: Request, err: RequestValidationError):
        messages = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            text = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            messages.append(f"{where}: {text}" if where else text)
        return _respond(request, {"detail": "; ".join(messages), "errors": messages}, 422)

    @app.exception_handler(ExportError)
    async def refused(request: Request, err: ExportError):
        return _respond(request, {"detail": str(err)}, 422)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, err: NotFound):
        return _respond(request, {"detail": str(err)}, 404)

    @app.exception_handler(Forbidden)
    async def forbidden(request: Request, err: Forbidden):
        return _respond(request, {"detail": str(err)}, 403)

    @app.exception_handler(Conflict)
    async def conflict(request: Request, err: Conflict):
        return _respond(request, {"detail": str(err)}, 409)

    @app.exception_handler(StorageError)
    async def store_down(request: Request, err: StorageError):
        log.warning("%s %s: object store: %s", request.method, request.url.path, err)
        return _unavailable(request, "the object store")

    @app.exception_handler(BrokerUnavailable)
    async def broker_down(request: Request, err: BrokerUnavailable):
        log.warning("%s %s: broker: %s", request.method, request.url.path, err)
        return _unavailable(request, "the job queue")

    for kind in (OperationalError, InterfaceError, PoolTimeout):
        @app.exception_handler(kind)
        async def catalog_down(request: Request, err: Exception):
            log.warning("%s %s: catalog: %s", request.method, request.url.path, type(err).__name__)
            return _unavailable(request, "the catalog")

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception):
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s in %s %s", error_id, request.method, request.url.path, exc_info=err)
        return _respond(request, {"detail": "internal error: quote this id when reporting it", "error_id": error_id}, 500)
