"""Bearer tokens with ``read`` and ``admin`` scopes; only their sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.catalog.models import ApiToken

SCOPES = ("read", "admin")
KNOWN_TOKEN_TTL_S = 30.0
_known: dict[str, tuple[str, float]] = {}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, scope: str, token: str | None = None) -> str:
    """Store a new token (hashed) and return the plaintext, which is shown once."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}")
    token = token or "ef_" + secrets.token_urlsafe(32)
    digest = hash_token(token)
    if session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first() is None:
        session.add(ApiToken(name=name, token_hash=digest, scope=scope))
    return token


def token_scope(session: Session, token: str) -> str | None:
    """The token's scope, or None. Known tokens are remembered briefly: every request carries one."""
    digest = hash_token(token)
    hit = _known.get(digest)
    if hit is not None and time.monotonic() - hit[1] < KNOWN_TOKEN_TTL_S:
        return hit[0]
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first()
    if row is None:
        return None
    _known[digest] = (row.scope, time.monotonic())
    return row.scope


def allows(scope: str, needed: str) -> bool:
    return scope == "admin" or scope == needed
