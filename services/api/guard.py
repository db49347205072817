"""The API's front door, as ASGI middleware: authentication before anything reads the body.

The body limit is Starlette's RequestBodyLimitMiddleware (``FastAPI(max_body_size=...)``): a
Content-Length over MAX_BODY_BYTES, or a body without one that grows past it as it streams in, is
a 413 the moment it is seen; it only runs once a route reads the body, so after this guard.

- Public: health, the OpenAPI documents and signed download links (they carry their own signature).
- Everything else needs a bearer token; reading (GET, HEAD) needs ``read``, every other method
  ``admin``. A missing, unknown, revoked or expired token is a 401, a token without the scope a
  403, in both cases before a byte of the body is read. A client with AUTH_FAILURES_PER_MINUTE
  failed authentications in the last minute gets 429 with Retry-After for its next failures until
  they age out; a valid token is never refused for them (the failures of others behind the same
  proxy, or of a fuzzer, never lock out the admin). The client is the connection's address, or,
  from a proxy named in TRUSTED_PROXIES, the last address X-Forwarded-For adds that is not one.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import anyio
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import cookie_parser
from starlette.responses import JSONResponse, RedirectResponse

from services.api.context import ApiContext
from services.auth import authenticate, ui_principal

PUBLIC_PATHS = {"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/ui/login"}
UI_PREFIX = "/ui"
UI_COOKIE = "exportfarm_session"
PUBLIC_PREFIXES = ("/files/",)
READ_METHODS = {"GET", "HEAD"}
WINDOW_S = 60.0


class FailureLimiter:
    """Failed authentications per client address over the last minute."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._failures: dict[str, collections.deque] = {}

    def retry_after(self, client: str) -> int | None:
        """Seconds until ``client`` may try again, or None if it may now."""
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get(client)
            if not failures:
                return None
            while failures and now - failures[0] > WINDOW_S:
                failures.popleft()
            if len(failures) < self.per_minute:
                return None
            return max(1, math.ceil(WINDOW_S - (now - failures[0])))

    def count_failure(self, client: str) -> int | None:
        """Count a failed authentication of ``client``: the seconds it must wait (a 429) where it had
        already failed too often in the last minute, else None. Asked only once a credential has
        failed, so a valid one is never refused for the failures before it."""
        wait = self.retry_after(client)
        self.failed(client)
        return wait

    def failed(self, client: str) -> None:
        with self._lock:
            failures = self._failures.setdefault(client, collections.deque())
            failures.append(time.monotonic())
            if len(self._failures) > 10_000:  # bounded memory under a scan from many addresses
                self._failures.pop(next(iter(self._failures)))


def client_address(scope, trusted_proxies: tuple[str, ...] | list[str] = ()) -> str:
    """Who is asking: the connection's address, or, where that is a trusted proxy, the last address
    in X-Forwarded-For that is not one (what the nearest untrusted hop said it was; anything
    before it is the client's own word)."""
    peer = (scope.get("client") or ("unknown", 0))[0]
    if peer not in trusted_proxies:
        return peer
    forwarded = ",".join(v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-forwarded-for")
    hops = [h.strip() for h in forwarded.split(",") if h.strip()]
    for hop in reversed(hops):
        if hop not in trusted_proxies:
            return hop
    return peer


def _error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def _cookie(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """``name``'s value from the Cookie header, parsed as Starlette parses it for the routes."""
    for key, value in headers:
        if key == b"cookie":
            return cookie_parser(value.decode("latin-1")).get(name) or None
    return None


def same_origin(headers: list[tuple[bytes, bytes]]) -> bool:
    """A form post from the pages themselves: Origin (when the browser sends one) names this host."""
    values = {k: v.decode("latin-1") for k, v in headers if k in (b"origin", b"host")}
    origin = values.get(b"origin")
    if origin is None or origin == "null":
        return origin is None
    return origin.split("://", 1)[-1] == values.get(b"host", "")


def _to_login() -> RedirectResponse:
    return RedirectResponse("/ui/login", status_code=303)


class Guard:
    def __init__(self, app, context: ApiContext):
        self.app, self.context = app, context
        self.limiter = FailureLimiter(context.settings.auth_failures_per_minute)
        context.auth_limiter = self.limiter

    def _public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._public(scope["path"]):
            refused = await self._authenticate(scope)
            if refused is not None:
                return await refused(scope, receive, send)
        await self.app(scope, receive, send)

    def _refuse(self, client: str, response: JSONResponse | RedirectResponse):
        """A failed authentication: counted against ``client``, and answered 429 once it has failed
        too often in the last minute (checked after the token, so a valid one always gets in)."""
        wait = self.limiter.count_failure(client)
        if wait is not None:
            return _error(429, f"too many failed authentications from {client}: try again in {wait} s",
                          {"Retry-After": str(wait)})
        return response

    async def _authenticate(self, scope) -> JSONResponse | None:
        client = client_address(scope, self.context.settings.trusted_proxies)
        token = _bearer(scope["headers"])
        page = scope["path"] == UI_PREFIX or scope["path"].startswith(UI_PREFIX + "/")
        session_id = None
        if token is None and page:
            session_id = _cookie(scope["headers"], UI_COOKIE)
            if session_id is None:
                return _to_login()
            if scope["method"] not in READ_METHODS and not same_origin(scope["headers"]):
                return _error(403, "a cross-origin form post to the pages is refused: use the pages themselves")
        if token is None and session_id is None:
            return self._refuse(client, _error(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                               {"WWW-Authenticate": "Bearer"}))
        try:
            if session_id is not None:  # a signed-in browser: its session, not a token, is in the cookie
                principal = await anyio.to_thread.run_sync(ui_principal, self.context.sessions, session_id)
            else:
                principal = await anyio.to_thread.run_sync(
                    authenticate, self.context.sessions, token, self.context.settings.token_cache_s)
        except SQLAlchemyError:
            return _error(503, "the catalog is unavailable: try again shortly", {"Retry-After": "5"})
        if principal is None:
            return self._refuse(client, _to_login() if page else
                                _error(401, "unknown, revoked or expired token", {"WWW-Authenticate": "Bearer"}))
        # Signing out of the pages changes nothing but the caller's own cookie: any scope may.
        needed = "read" if scope["method"] in READ_METHODS or scope["path"] == "/ui/logout" else "admin"
        if not principal.allows(needed):
            return _error(403, f"this token has the {principal.scope} scope; {scope['method']} needs {needed}")
        scope.setdefault("state", {})["principal"] = principal
        return None
