"""/tokens: create, list and revoke bearer tokens (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from services import auth, jobs
from services.api.deps import AdminDep, SessionDep
from services.api.schemas import TokenCreate, TokenCreated, TokenOut
from services.catalog.models import ApiToken

router = APIRouter(prefix="/tokens", tags=["tokens"])
_BY_ID = {"token_id": "$response.body#/id"}


@router.post("", status_code=201, response_model=TokenCreated, operation_id="create_token",
             responses={201: {"description": "created; the token is shown only now",
                              "links": {"RevokeToken": {"operationId": "revoke_token", "parameters": _BY_ID}}}})
def create_token(body: TokenCreate, session: SessionDep, _: AdminDep):
    row, token = auth.create_token(session, body.name, body.scope, expires_in_s=body.expires_in_s)
    return TokenCreated(**TokenOut.of(row).model_dump(), token=token)


@router.get("", response_model=list[TokenOut], operation_id="list_tokens")
def list_tokens(session: SessionDep, _: AdminDep):
    return [TokenOut.of(row) for row in auth.list_tokens(session)]


@router.delete("/{token_id}", response_model=TokenOut, operation_id="revoke_token")
def revoke_token(token_id: Annotated[int, Path(ge=1, le=2**62)], session: SessionDep, _: AdminDep):
    """Revoke now in this process, within TOKEN_CACHE_S in every other. The bootstrap token is
    ADMIN_TOKEN's: change that setting to replace it."""
    row = session.get(ApiToken, token_id)
    if row is None:
        raise jobs.NotFound(f"no token {token_id}")
    if row.bootstrap and row.revoked_at is None:
        raise jobs.Conflict(f"token {token_id} is the bootstrap token: change ADMIN_TOKEN (and restart) to replace it")
    return TokenOut.of(auth.revoke_token(session, token_id))
