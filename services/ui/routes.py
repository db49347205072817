"""/ui: the catalog as pages. Each page calls the service functions its JSON twin calls.

Sign-in turns a token, entered once, into an HttpOnly SameSite=Strict cookie scoped to /ui (the
guard reads it there, before any body); no token ever appears in a URL. The few admin actions
(cancel, re-export, revoke a token) are POST forms carrying a CSRF token derived from the signing
secret and the session's token; the guard also refuses a cookie-authenticated POST from another
origin. No JavaScript: live status is a meta refresh while a job runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Path as PathParam, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy import select

from exporter.contract import MANIFEST_FILE
from exporter.errors import ExportError
from exporter.validation.validate import cell
from exporter.reports.bench_report import recommend
from services import jobs
from services.api.deps import ContextDep, SessionDep
from services.api.guard import client_address, same_origin
from services.auth import UI_SESSION_S, Principal, authenticate, end_ui_session, list_tokens, revoke_token, start_ui_session
from services.catalog.exports import PUBLISHED_STATUSES
from services.catalog.models import Export, ExportEvent, ExportStatus, Worker
from services.catalog.views import latest_ready
from services.regressions import regressions_view
from services.scheduler import newest_runtimes, plan_and_queue_reexports
from services.sweeper import SweepReport

COOKIE = "exportfarm_session"
REFRESH_S = 5
templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))
router = APIRouter(prefix="/ui", include_in_schema=False)
VARIANTS = ("attn_static", "gqa", "attn_dynamic")


def csrf_token(session_id: str) -> str:
    """The forms' CSRF token, keyed by the browser's own session id (which another site cannot
    read): no server secret is needed, so the pages work wherever the API does."""
    return hmac.new(session_id.encode(), b"exportfarm-csrf", hashlib.sha256).hexdigest()[:40]


templates.env.globals["cell"] = lambda value: "" if value is None else cell(value)


def _page(request: Request, name: str, context: ContextDep, status_code: int = 200, **values) -> HTMLResponse:
    principal: Principal | None = getattr(request.state, "principal", None)
    session_id = request.cookies.get(COOKIE)
    csrf = csrf_token(session_id) if session_id else ""
    return templates.TemplateResponse(request, name, {"principal": principal, "csrf": csrf, **values},
                                      status_code=status_code)


TITLES = {400: "Bad request", 403: "Not allowed", 404: "Not found", 409: "Conflict", 422: "Cannot do that",
          500: "Something went wrong", 503: "Unavailable"}


def error_page(request: Request, status_code: int, detail: str, error_id: str | None = None,
               headers: dict | None = None) -> HTMLResponse:
    principal = getattr(request.state, "principal", None)
    session_id = request.cookies.get(COOKIE)
    csrf = csrf_token(session_id) if session_id else ""
    response = templates.TemplateResponse(
        request, "error.html", {"principal": principal, "csrf": csrf, "status_code": status_code, "detail": detail,
                                "error_id": error_id, "title": TITLES.get(status_code, "Error")},
        status_code=status_code)
    response.headers.update(headers or {})
    return response


def _check_csrf(request: Request, context: ContextDep, csrf: str) -> None:
    session_id = request.cookies.get(COOKIE) or ""
    expected = csrf_token(session_id) if session_id else ""
    # bytes: compare_digest refuses a str with non-ASCII characters (a form could post one: a 500)
    if not session_id or not hmac.compare_digest(str(csrf).encode("utf-8", "replace"), expected.encode()):
        raise jobs.Forbidden("the form's CSRF token does not match this session: reload the page and try again")


@router.get("", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
def home() -> RedirectResponse:
    return RedirectResponse("/ui/catalog", status_code=303)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, context: ContextDep):
    return _page(request, "login.html", context)


@router.post("/login", response_class=HTMLResponse)
def login(request: Request, context: ContextDep, token: Annotated[str, Form(max_length=512)]):
    if not same_origin(request.scope["headers"]):  # login CSRF: another site signing a browser in
        return _page(request, "login.html", context, 403, error="A sign-in posted from another site is refused.")
    client = client_address(request.scope, context.settings.trusted_proxies)
    limiter = context.auth_limiter
    principal = authenticate(context.sessions, token.strip(), context.settings.token_cache_s)
    if principal is None:  # a valid token always signs in; failures are counted and slowed
        wait = limiter.count_failure(client) if limiter else None
        if wait is not None:
            return _page(request, "login.html", context, 429, error=f"Too many failed sign-ins: try again in {wait} s.")
        return _page(request, "login.html", context, 401, error="Unknown, revoked or expired token.")
    response = RedirectResponse("/ui/catalog", status_code=303)
    secure = request.url.scheme == "https" or context.settings.public_base_url.startswith("https://")
    # the cookie is a session of its own (revoked at sign-out, ended with its token), never the token
    session_id = start_ui_session(context.sessions, principal, context.settings.ui_sessions_per_token)
    response.set_cookie(COOKIE, session_id, httponly=True, samesite="strict", path="/ui", secure=secure,
                        max_age=UI_SESSION_S)
    return response


@router.post("/logout")
def logout(request: Request, context: ContextDep, csrf: Annotated[str, Form(max_length=100)] = ""):
    _check_csrf(request, context, csrf)
    session_id = request.cookies.get(COOKIE)
    if session_id:
        end_ui_session(context.sessions, session_id)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@router.get("/catalog", response_class=HTMLResponse)
def catalog_page(
    request: Request, session: SessionDep, context: ContextDep,
    model: Annotated[str | None, Query(max_length=300)] = None,
    status: Annotated[str | None, Query(max_length=20)] = None,
    variant: Annotated[str | None, Query(max_length=20)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
):
    status = status or None
    variant = variant or None
    if status is not None and status not in {s.value for s in ExportStatus}:
        raise ExportError(f"unknown status {status!r}: use one of {', '.join(s.value for s in ExportStatus)}")
    if variant is not None and variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}")
    rows, total = jobs.list_exports(session, model=model or None, status=status, variant=variant, limit=limit,
                                    offset=offset)
    models = latest_ready(session, model or None)
    newest = {s["id"] for slots in models.values() for s in slots.values()}
    filters = {"model": model, "status": status, "variant": variant}

    def page_url(new_offset: int) -> str:
        query = {k: v for k, v in {**filters, "limit": limit, "offset": max(0, new_offset)}.items() if v not in (None, "")}
        return "/ui/catalog?" + urlencode(query)

    return _page(request, "catalog.html", context, rows=rows, total=total, limit=limit, offset=offset, models=models,
                 newest=newest, filters=filters, statuses=[s.value for s in ExportStatus], variants=VARIANTS,
                 page_url=page_url)


def _published_json(context, export: Export, name: str) -> dict | None:
    if export.status not in PUBLISHED_STATUSES or not export.storage_prefix or name not in (export.manifest or {}).get("files", {}):
        return None
    data = context.store.get_bytes(export.storage_prefix + name)
    return json.loads(data) if data else None


def _recommended(session, export: Export) -> dict[int, str]:
    """Per context, the variant to use among this model's newest ready builds of the same dtype and
    EP (ties within 3% go to the simpler graph, as in the benchmark report)."""
    series: dict[str, dict[int, float]] = {}
    for slots in latest_ready(session, export.model).values():
        for s in slots.values():
            if s["dtype"] == export.dtype and s["ep"] == export.ep and s["revision"] == export.revision:
                ms = (s["figures"] or {}).get("decode_ms") or {}
                if ms:
                    series[s["variant"]] = {int(c): v for c, v in ms.items()}
    picks = recommend(series) if series else []
    return {ctx: variant for ctx, variant, _ in picks}


@router.get("/exports/{export_id}", response_class=HTMLResponse)
def export_page(export_id: str, request: Request, session: SessionDep, context: ContextDep):
    export = jobs.get_export(session, export_id)
    events = session.scalars(select(ExportEvent).where(ExportEvent.export_id == export.id).order_by(ExportEvent.id)).all()
    files = {}
    if export.status in PUBLISHED_STATUSES and export.manifest:
        expires = context.settings.presign_expires_s
        files = {name: {"url": context.store.presigned_url(export.storage_prefix + name, expires), **entry}
                 for name, entry in export.manifest["files"].items()}
        files[MANIFEST_FILE] = {"url": context.store.presigned_url(export.storage_prefix + MANIFEST_FILE, expires),
                                "size": "", "sha256": "(in the store's metadata)"}
    genai = (export.manifest or {}).get("genai")
    genai_text = None
    if genai:
        genai_text = f"{genai.get('status', 'package')}" \
            + (f" of type {genai['model_type']}" if genai.get("model_type") else "") \
            + (f", tokenizer {genai['tokenizer']}" if genai.get("tokenizer") else "") \
            + (f" — {genai['reason']}" if genai.get("reason") else "")
    return _page(
        request, "export.html", context, e=export, events=events, files=files, expires_s=context.settings.presign_expires_s,
        report=_published_json(context, export, "parity_report.json"),
        bench=_published_json(context, export, "benchmark.json"), recommended=_recommended(session, export),
        genai=genai_text, refresh=None if export.status.terminal else REFRESH_S)


@router.post("/exports/{export_id}/cancel")
def cancel(export_id: str, request: Request, session: SessionDep, context: ContextDep,
           csrf: Annotated[str, Form(max_length=100)] = ""):
    _check_csrf(request, context, csrf)
    _, settle = jobs.request_cancel(session, context.settings, export_id)
    session.commit()
    if settle:
        context.sweeper.settle_cancel(export_id)
    return RedirectResponse(f"/ui/exports/{export_id}", status_code=303)


@router.get("/exports/{export_id}/diff", response_class=HTMLResponse)
def diff_page(export_id: str, request: Request, session: SessionDep, context: ContextDep):
    export = jobs.get_export(session, export_id)
    if export.diff is None:
        raise jobs.NotFound(f"export {export_id} has no diff (it is not a re-export, or is not finished)")
    return _page(request, "diff.html", context, e=export)


@router.get("/regressions", response_class=HTMLResponse)
def regressions_page(request: Request, session: SessionDep, context: ContextDep):
    return _page(request, "regressions.html", context, rows=regressions_view(session))


@router.post("/reexports")
def reexports(request: Request, session: SessionDep, context: ContextDep,
              csrf: Annotated[str, Form(max_length=100)] = ""):
    _check_csrf(request, context, csrf)
    plan = plan_and_queue_reexports(session, context.settings)
    session.commit()
    context.sweeper.dispatch(SweepReport(), grace_s=0)
    return RedirectResponse(f"/ui/catalog?{urlencode({'status': 'queued'})}" if plan.queued else "/ui/regressions",
                            status_code=303)


@router.get("/workers", response_class=HTMLResponse)
def workers_page(request: Request, session: SessionDep, context: ContextDep):
    return _page(request, "workers.html", context, workers=session.scalars(select(Worker)).all(),
                 newest=newest_runtimes(session, context.settings))


@router.get("/tokens", response_class=HTMLResponse)
def tokens_page(request: Request, session: SessionDep, context: ContextDep):
    principal: Principal = request.state.principal
    if not principal.allows("admin"):
        raise jobs.Forbidden(f"this token has the {principal.scope} scope; the token list needs admin")
    return _page(request, "tokens.html", context, tokens=list_tokens(session))


@router.post("/tokens/{token_id}/revoke")
def revoke(token_id: Annotated[int, PathParam(ge=1, le=2**62)], request: Request, session: SessionDep, context: ContextDep,
           csrf: Annotated[str, Form(max_length=100)] = ""):
    _check_csrf(request, context, csrf)
    if revoke_token(session, token_id) is None:
        raise jobs.NotFound(f"no token {token_id}")
    session.commit()
    return RedirectResponse("/ui/tokens", status_code=303)
