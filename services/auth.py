"""Bearer tokens with ``read`` and ``admin`` scopes; only their sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.catalog.models import ApiToken

SCOPES = ("read", "admin")


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
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    return row.scope if row else None


def allows(scope: str, needed: str) -> bool:
    return scope == "admin" or scope == needed
