"""The routes' dependencies, as module-level ``Annotated`` types (full-stack-fastapi-template style).

Authentication happens before a route runs, in services.api.guard (before the body is read); these
only hand the route what the guard found, and declare the bearer scheme in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from services.api.context import ApiContext
from services.auth import Principal
from services.catalog.database import session_scope
from services.jobs import Forbidden

bearer = HTTPBearer(auto_error=False, description="a token from `exportfarm token` or POST /tokens")


def get_context(request: Request) -> ApiContext:
    return request.app.state.context


ContextDep = Annotated[ApiContext, Depends(get_context)]


def get_session(context: ContextDep) -> Iterator[Session]:
    with session_scope(context.settings.catalog_url) as session:  # one transaction per request
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def _principal(request: Request, _credentials=Security(bearer)) -> Principal:
    return request.state.principal  # set by the guard; a route never runs without one


def _admin(principal: Principal = Depends(_principal)) -> Principal:
    # The guard already refused non-admin tokens for methods that change things (before the body);
    # this covers the few reads that need admin (the token list).
    if not principal.allows("admin"):
        raise Forbidden(f"this token has the {principal.scope} scope; this needs admin")
    return principal


ReaderDep = Annotated[Principal, Depends(_principal)]
AdminDep = Annotated[Principal, Depends(_admin)]
