"""Bearer tokens: ``read`` and ``admin`` scopes, expiry, last use, revocation; only sha256 is stored.

A token is checked against the catalog and then trusted by this process for TOKEN_CACHE_S (every
request carries one), so a revocation takes effect at once in the process that made it and within
TOKEN_CACHE_S everywhere else. ADMIN_TOKEN becomes the bootstrap token; changing it revokes the
previous one.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import secrets
import threading
import time

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from exporter.errors import ExportError
from services.catalog.models import ApiToken, UiSession, utcnow
from services.catalog.workers import aware
from services.settings import MIN_TOKEN_LENGTH

SCOPES = ("read", "admin")
UI_SESSION_S = 12 * 3600  # a signed-in browser's session ends this long after sign-in
LAST_USED_EVERY_S = 60.0  # last_used_at is written at most this often per token


@dataclasses.dataclass(frozen=True)
class Principal:
    token_id: int
    name: str
    scope: str

    def allows(self, needed: str) -> bool:
        return self.scope == "admin" or self.scope == needed


class _Known:
    """Tokens this process checked recently: digest -> (principal, checked at, expires at)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Principal, float, float | None]] = {}
        self._last_used: dict[int, float] = {}

    def get(self, digest: str, ttl: float) -> Principal | None:
        with self._lock:
            hit = self._entries.get(digest)
        if hit is None:
            return None
        principal, checked, expires = hit
        now = time.monotonic()
        if now - checked > ttl or (expires is not None and time.time() >= expires):
            return None
        return principal

    def put(self, digest: str, principal: Principal, expires_at: datetime.datetime | None) -> None:
        with self._lock:
            self._entries[digest] = (principal, time.monotonic(), expires_at.timestamp() if expires_at else None)

    def forget_id(self, token_id: int) -> None:
        with self._lock:
            self._entries = {d: e for d, e in self._entries.items() if e[0].token_id != token_id}

    def due_for_last_used(self, token_id: int) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last_used.get(token_id, -1e9) < LAST_USED_EVERY_S:
                return False
            self._last_used[token_id] = now
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._last_used.clear()


KNOWN = _Known()


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ExportError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")


def create_token(session: Session, name: str, scope: str, token: str | None = None,
                 expires_in_s: float | None = None, bootstrap: bool = False) -> tuple[ApiToken, str]:
    """Store a new token (hashed); returns the row and the plaintext, which is shown once."""
    check_scope(scope)
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ExportError(f"a token must be at least {MIN_TOKEN_LENGTH} characters")
    if expires_in_s is not None and expires_in_s <= 0:
        raise ExportError("expires_in_s must be positive (or left out for a token that does not expire)")
    token = token or "ef_" + secrets.token_urlsafe(32)
    expires = utcnow() + datetime.timedelta(seconds=expires_in_s) if expires_in_s is not None else None
    row = ApiToken(name=name, token_hash=hash_token(token), scope=scope, expires_at=expires, bootstrap=bootstrap)
    session.add(row)
    session.flush()
    return row, token


def install_bootstrap(session: Session, admin_token: str) -> str | None:
    """Make ADMIN_TOKEN the bootstrap admin token; returns why it was not (None: it is).

    A token new to the catalog becomes the one bootstrap token and the earlier ones are revoked
    (a rotation). A token the catalog already holds, active, stays as it is. A revoked token never
    comes back: an old pod restarting mid-rollout with the rotated-out ADMIN_TOKEN neither revives
    it nor revokes the new one."""
    digest = hash_token(admin_token)
    existing = session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first()
    if existing is not None and existing.revoked_at is not None:
        return ("ADMIN_TOKEN was revoked (rotated out, or revoked by hand) and stays revoked: set ADMIN_TOKEN to a "
                "new value, or use a token from `exportfarm token`")
    if existing is not None:
        if not existing.bootstrap:  # the same secret as a token created by hand: it becomes the bootstrap
            existing.bootstrap, existing.scope = True, "admin"
        return None
    for row in session.scalars(select(ApiToken).where(ApiToken.bootstrap.is_(True), ApiToken.revoked_at.is_(None))):
        row.revoked_at = utcnow()
        KNOWN.forget_id(row.id)
    create_token(session, "bootstrap-admin", "admin", admin_token, bootstrap=True)
    return None


def authenticate(session_factory, token: str, ttl: float) -> Principal | None:
    """The principal a bearer token stands for, or None (unknown, revoked, expired)."""
    digest = hash_token(token)
    known = KNOWN.get(digest, ttl)
    if known is not None:
        touch = KNOWN.due_for_last_used(known.token_id)
        if touch:
            _touch(session_factory, known.token_id)
        return known
    with session_factory.begin() as session:
        row = session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first()
        if row is None or row.revoked_at is not None:
            return None
        expires = aware(row.expires_at)
        if expires is not None and expires <= utcnow():
            return None
        principal = Principal(row.id, row.name, row.scope)
        if KNOWN.due_for_last_used(row.id):
            row.last_used_at = utcnow()
    KNOWN.put(digest, principal, expires)
    return principal


def _touch(session_factory, token_id: int) -> None:
    with session_factory.begin() as session:
        session.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=utcnow()))


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_token(session: Session, token_id: int) -> ApiToken | None:
    row = session.get(ApiToken, token_id)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    KNOWN.forget_id(token_id)
    return row


# --- the pages' sessions ---------------------------------------------------------------------------


def start_ui_session(session_factory, principal: Principal, per_token: int) -> str:
    """A new session for a browser that signed in with ``principal``'s token: its id (shown once, in
    the cookie; only its sha256 is stored). The token itself never reaches the browser's cookie.

    Each sign-in also deletes the sessions that are over (expired or signed out) and this token's
    oldest beyond ``per_token`` (UI_SESSIONS_PER_TOKEN): however often a token signs in, the table
    holds only sessions that can still be used, at most that many for each token.
    """
    session_id = "efs_" + secrets.token_urlsafe(32)
    now = utcnow()
    with session_factory.begin() as session:
        session.execute(delete(UiSession).where(or_(UiSession.expires_at <= now, UiSession.revoked_at.is_not(None))))
        session.add(UiSession(session_hash=hash_token(session_id), token_id=principal.token_id,
                              expires_at=now + datetime.timedelta(seconds=UI_SESSION_S)))
        session.flush()
        newest = (select(UiSession.id).where(UiSession.token_id == principal.token_id)
                  .order_by(UiSession.id.desc()).limit(per_token))
        session.execute(delete(UiSession).where(UiSession.token_id == principal.token_id, UiSession.id.not_in(newest)))
    return session_id


def ui_principal(session_factory, session_id: str) -> Principal | None:
    """Who a browser's session stands for: None once it is signed out or expired, or its token is
    revoked or expired."""
    now = utcnow()
    with session_factory() as session:
        row = session.execute(
            select(UiSession, ApiToken).join(ApiToken, ApiToken.id == UiSession.token_id)
            .where(UiSession.session_hash == hash_token(session_id))).first()
    if row is None:
        return None
    ui, token = row
    token_expires = aware(token.expires_at)
    if ui.revoked_at is not None or aware(ui.expires_at) <= now or token.revoked_at is not None or (
            token_expires is not None and token_expires <= now):
        return None
    return Principal(token.id, token.name, token.scope)


def end_ui_session(session_factory, session_id: str) -> None:
    """Sign-out: the session is revoked in the catalog, so its cookie is worthless everywhere."""
    with session_factory.begin() as session:
        session.execute(update(UiSession).where(UiSession.session_hash == hash_token(session_id),
                                                UiSession.revoked_at.is_(None)).values(revoked_at=utcnow()))
