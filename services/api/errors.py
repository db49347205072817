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


def _unavailable(what: str) -> JSONResponse:
    return JSONResponse({"detail": f"{what} is unavailable right now: try again shortly"}, status_code=503,
                        headers={"Retry-After": RETRY_AFTER_S})


def register(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def readable_422(_request: Request, err: RequestValidationError):
        messages = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            text = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            messages.append(f"{where}: {text}" if where else text)
        return JSONResponse({"detail": "; ".join(messages), "errors": messages}, status_code=422)

    @app.exception_handler(ExportError)
    async def refused(_request: Request, err: ExportError):
        return JSONResponse({"detail": str(err)}, status_code=422)

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, err: NotFound):
        return JSONResponse({"detail": str(err)}, status_code=404)

    @app.exception_handler(Forbidden)
    async def forbidden(_request: Request, err: Forbidden):
        return JSONResponse({"detail": str(err)}, status_code=403)

    @app.exception_handler(Conflict)
    async def conflict(_request: Request, err: Conflict):
        return JSONResponse({"detail": str(err)}, status_code=409)

    @app.exception_handler(StorageError)
    async def store_down(request: Request, err: StorageError):
        log.warning("%s %s: object store: %s", request.method, request.url.path, err)
        return _unavailable("the object store")

    @app.exception_handler(BrokerUnavailable)
    async def broker_down(request: Request, err: BrokerUnavailable):
        log.warning("%s %s: broker: %s", request.method, request.url.path, err)
        return _unavailable("the job queue")

    for kind in (OperationalError, InterfaceError, PoolTimeout):
        @app.exception_handler(kind)
        async def catalog_down(request: Request, err: Exception):
            log.warning("%s %s: catalog: %s", request.method, request.url.path, type(err).__name__)
            return _unavailable("the catalog")

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception):
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s in %s %s", error_id, request.method, request.url.path, exc_info=err)
        return JSONResponse({"detail": "internal error: quote this id when reporting it", "error_id": error_id},
                            status_code=500)
