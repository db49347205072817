"""The catalog's pages: every page rendered from a catalog holding exports in every state (queued,
running, ready, quarantined, failed, cancelled; with and without a predecessor), sign-in by cookie
(never a token in a URL), CSRF and same-origin on the admin forms, and what each page says."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from exporter.contract import BENCH_FILE, MANIFEST_FILE, REPORT_JSON
from exporter.packaging.package import Manifest
from exporter.pipeline import export_model
from exporter.reports.bench_report import write_report
from exporter.reports.diff import ExportArtifacts, diff_exports
from exporter.request import ExportRequest
from exporter.runtime.bench import run_bench
from services.api.app import create_app
from services.auth import create_token
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.exports import key_figures, outcome_fields, transition
from services.catalog.models import ExportStatus
from services.jobs import submit_export
from services.publish import export_prefix, publish_export
from services.settings import Settings
from services.storage_factory import make_store

ADMIN = "ui-test-admin-token-0123456789abcdef"


def _real_export(out, checkpoint, variant):
    """A validated, benchmarked export directory with its manifest listing every file."""
    export_model(ExportRequest(model=str(checkpoint), dtype="fp32", ep="cpu", variant=variant,
                               static_cache=variant == "attn_static", max_seq_len=64), out)
    run_bench(out, "cpu", contexts=[16, 32], steps=2, warmup=1, prefill_lengths=[8])
    png, md = write_report(out / BENCH_FILE, out)
    manifest = Manifest(json.loads((out / MANIFEST_FILE).read_text()))
    manifest.add_files(out, [BENCH_FILE, png.name, md.name])
    manifest.write(out)
    return manifest.data


@pytest.fixture(scope="module")
def farm(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("ui")
    models = root / "models"
    models.mkdir()
    source = checkpoint("llama")
    (models / "tiny-llama").symlink_to(source)
    settings = Settings(data_dir=root / "data", models_dir=models, admin_token=ADMIN)
    upgrade_schema(settings.catalog_url)
    app = create_app(settings)
    store = make_store(settings)
    ids = {}
    with session_scope(settings.catalog_url) as session:
        _, reader = create_token(session, "ui-reader", "read")

        def row(variant, status, predecessor=None, out=None, dtype="fp32"):
            request = ExportRequest(model="tiny-llama", dtype=dtype, ep="cpu", variant=variant,
                                    static_cache=variant == "attn_static", max_seq_len=64 if variant == "attn_static" else None)
            export, _ = submit_export(session, settings, request, force=True)
            export.predecessor_id = predecessor
            if status is ExportStatus.QUEUED:
                return export
            transition(session, export, ExportStatus.RUNNING, stage="build", worker="ui-test-worker")
            export.percent = 40
            if status is ExportStatus.RUNNING:
                return export
            if out is not None:
                manifest = json.loads((out / MANIFEST_FILE).read_text())
                prefix = export_prefix(manifest)
                publish_export(store, out, prefix, status.value)
                report = json.loads((out / REPORT_JSON).read_text())
                bench = json.loads((out / BENCH_FILE).read_text())
                for key, value in outcome_fields(prefix, manifest, report, bench, None).items():
                    setattr(export, key, value)
            if status is ExportStatus.FAILED:
                export.error = "build: checkpoint has no tensor 'model.norm.weight'"
            transition(session, export, status, stage="publish" if out is not None else "build")
            return export

        first = _real_export(root / "first", source, "attn_dynamic")
        gqa = _real_export(root / "gqa", source, "gqa")
        ready = row("attn_dynamic", ExportStatus.READY, out=root / "first")
        ready_gqa = row("gqa", ExportStatus.READY, out=root / "gqa")
        session.flush()
        again = row("attn_dynamic", ExportStatus.READY, predecessor=ready.id, out=root / "first")
        again.diff = diff_exports(ExportArtifacts.from_dir(root / "first"), ExportArtifacts.from_dir(root / "first")).to_dict()
        quarantined = row("attn_dynamic", ExportStatus.QUARANTINED, out=root / "first")
        ids = {
            "ready": ready.id, "ready_gqa": ready_gqa.id, "reexport": again.id, "quarantined": quarantined.id,
            "queued": row("attn_static", ExportStatus.QUEUED).id, "running": row("gqa", ExportStatus.RUNNING).id,
            "failed": row("attn_dynamic", ExportStatus.FAILED).id, "cancelled": None,
        }
        cancelled, _ = submit_export(session, settings, ExportRequest(model="tiny-llama", dtype="fp16", ep="cpu"), force=True)
        transition(session, cancelled, ExportStatus.CANCELLED, message="cancelled by ui-test")
        ids["cancelled"] = cancelled.id
        assert first["files"] and gqa["files"] and key_figures(first, None, None)["node_count"]
    client = TestClient(app, base_url="http://testserver")
    client.ids, client.reader_token, client.settings = ids, reader, settings
    return client


def _signed_in(farm, token=ADMIN) -> TestClient:
    client = TestClient(farm.app, base_url="http://testserver")
    response = client.post("/ui/login", data={"token": token}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/ui/catalog"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and "Path=/ui" in cookie
    return client


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', html).group(1)


def test_pages_need_a_session_and_sign_in_keeps_the_token_out_of_urls(farm):
    anonymous = TestClient(farm.app, base_url="http://testserver")
    for path in ("/ui/catalog", f"/ui/exports/{farm.ids['ready']}", "/ui/regressions", "/ui/workers"):
        response = anonymous.get(path, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == "/ui/login", path
    form = anonymous.get("/ui/login")
    assert form.status_code == 200 and 'type="password"' in form.text and 'method="post"' in form.text
    wrong = anonymous.post("/ui/login", data={"token": "not-a-token-at-all-0123456789"}, follow_redirects=False)
    assert wrong.status_code == 401 and "Unknown, revoked or expired token" in wrong.text
    client = _signed_in(farm)
    page = client.get("/ui/catalog")
    assert page.status_code == 200 and ADMIN not in page.text and ADMIN not in str(page.url)
    assert anonymous.get("/ui/catalog", headers={"Authorization": f"Bearer {farm.reader_token}"}).status_code == 200


def test_the_catalog_lists_every_state_with_filters_and_paging(farm):
    client = _signed_in(farm, farm.reader_token)
    html = client.get("/ui/catalog").text
    for state in ("queued", "running", "ready", "quarantined", "failed", "cancelled"):
        assert f'status-{state}">{state}<' in html, state
    assert "<h3>tiny-llama</h3>" in html and "attn_dynamic-fp32-cpu" in html and "gqa-fp32-cpu" in html
    assert f"re-export of <a href=\"/ui/exports/{farm.ids['ready']}\">" in html
    assert "8 exports" in html, re.findall(r"\d+ exports?", html)
    assert "(newest ready)" in html, html
    only_failed = client.get("/ui/catalog", params={"status": "failed"}).text
    assert 'status-failed">failed<' in only_failed and 'status-ready">ready<' not in only_failed.split("<h2>Exports</h2>")[1]
    first_page = client.get("/ui/catalog", params={"limit": 4}).text
    assert 'rel="next" href="/ui/catalog?limit=4&amp;offset=4"' in first_page and "showing 1–4" in first_page
    second = client.get("/ui/catalog", params={"limit": 4, "offset": 4}).text
    assert 'rel="prev"' in second and "showing 5–8" in second
    bad = client.get("/ui/catalog", params={"status": "lost"})
    assert bad.status_code == 422 and "<h1>Cannot do that</h1>" in bad.text and "unknown status &#39;lost&#39;" in bad.text


def test_an_export_page_has_the_gates_the_benchmark_the_files_and_the_trail(farm):
    client = _signed_in(farm, farm.reader_token)
    html = client.get(f"/ui/exports/{farm.ids['ready']}").text
    gates = html.split('<table id="gates">')[1].split("</table>")[0]
    assert "prefill logits max abs error vs transformers" in gates and "result-pass" in gates and "threshold" in gates
    assert "Near ties" in html
    assert '<img id="benchmark-plot" src="' in html and 'alt="decode latency' in html
    bench = html.split('<table id="benchmark">')[1].split("</table>")[0]
    assert "<td>16</td>" in bench and "<td>32</td>" in bench
    assert re.search(r"<td>(attn_dynamic|gqa)</td>", bench)  # the recommended variant per context
    files = html.split('<table id="files">')[1].split("</table>")[0]
    assert "model.onnx.data" in files and "parity_report.json" in files and re.search(r'class="mono">[0-9a-f]{64}<', files)
    assert "genai package" in html and "of type llama" in html  # what genai runs the folder as
    events = html.split('<table id="events">')[1]
    assert "<td>running</td>" in events and "<td>ready</td>" in events and "ui-test-worker" in events
    assert "Cancel this export" not in html  # terminal, and a reader in any case


def test_live_and_unpublished_states_say_what_there_is(farm):
    client = _signed_in(farm)
    running = client.get(f"/ui/exports/{farm.ids['running']}").text
    assert 'http-equiv="refresh"' in running and "stage build, 40%" in running and "No parity report yet" in running
    assert "Cancel this export" in running  # admin, not terminal
    failed = client.get(f"/ui/exports/{farm.ids['failed']}").text
    assert 'http-equiv="refresh"' not in failed and "checkpoint has no tensor" in failed and "No parity report was published" in failed
    quarantined = client.get(f"/ui/exports/{farm.ids['quarantined']}").text
    assert '<table id="gates">' in quarantined and 'id="status">quarantined' in quarantined
    missing = client.get("/ui/exports/no-such-export")
    assert missing.status_code == 404 and "<h1>Not found</h1>" in missing.text and "no export no-such-export" in missing.text


def test_the_diff_regressions_workers_and_tokens_pages(farm):
    client = _signed_in(farm)
    diff = client.get(f"/ui/exports/{farm.ids['reexport']}/diff")
    assert diff.status_code == 200 and 'id="summary">No regression.' in diff.text and "<td>nodes</td>" in diff.text
    assert client.get(f"/ui/exports/{farm.ids['ready']}/diff").status_code == 404
    regressions = client.get("/ui/regressions").text
    assert "No re-export flagged a regression." in regressions and "Re-export what the newest" in regressions
    assert "<h1>Workers</h1>" in client.get("/ui/workers").text
    tokens = client.get("/ui/tokens").text
    assert "ui-reader" in tokens and "Revoke ui-reader" in tokens
    reader = _signed_in(farm, farm.reader_token)
    assert reader.get("/ui/tokens").status_code == 403


def test_admin_forms_need_the_csrf_token_and_the_same_origin(farm):
    client = _signed_in(farm)
    page = client.get(f"/ui/exports/{farm.ids['queued']}").text
    target = f"/ui/exports/{farm.ids['queued']}/cancel"
    assert client.post(target, data={"csrf": "0" * 40}, follow_redirects=False).status_code == 403
    foreign = client.post(target, data={"csrf": _csrf(page)}, headers={"Origin": "https://evil.example"},
                          follow_redirects=False)
    assert foreign.status_code == 403
    done = client.post(target, data={"csrf": _csrf(page)}, headers={"Origin": "http://testserver"}, follow_redirects=False)
    assert done.status_code == 303
    assert 'id="status">cancelled' in client.get(f"/ui/exports/{farm.ids['queued']}").text
    reader = _signed_in(farm, farm.reader_token)
    refused = reader.post(target, data={"csrf": _csrf(reader.get("/ui/catalog").text)}, follow_redirects=False)
    assert refused.status_code == 403  # read scope: no admin action


def test_the_pages_work_without_javascript_and_at_phone_width(farm):
    client = _signed_in(farm, farm.reader_token)
    for path in ("/ui/catalog", f"/ui/exports/{farm.ids['ready']}", "/ui/regressions", "/ui/workers"):
        html = client.get(path).text
        assert "<script" not in html and 'name="viewport"' in html and '<html lang="en">' in html
        assert "<main>" in html and '<nav aria-label="main">' in html
        assert "overflow-x: auto" in html  # wide tables scroll inside their box on a phone


def test_an_admin_revokes_a_token_from_its_page_and_it_stops_working(farm):
    from services.auth import create_token as make

    with session_scope(farm.settings.catalog_url) as session:
        row, doomed = make(session, "ui-doomed", "read")
        token_id = row.id
    client = _signed_in(farm)
    page = client.get("/ui/tokens").text
    assert f'action="/ui/tokens/{token_id}/revoke"' in page
    done = client.post(f"/ui/tokens/{token_id}/revoke", data={"csrf": _csrf(page)}, follow_redirects=False)
    assert done.status_code == 303
    assert "Revoke ui-doomed" not in client.get("/ui/tokens").text
    anonymous = TestClient(farm.app, base_url="http://testserver")
    assert anonymous.post("/ui/login", data={"token": doomed}, follow_redirects=False).status_code == 401
    signed_out = client.post("/ui/logout", data={"csrf": _csrf(page)}, follow_redirects=False)
    assert signed_out.status_code == 303 and 'exportfarm_session=""' in signed_out.headers["set-cookie"]


def test_a_reader_signs_out_a_foreign_sign_in_is_refused_and_odd_ids_are_4xx(farm):
    reader = _signed_in(farm, farm.reader_token)
    page = reader.get("/ui/catalog").text
    out = reader.post("/ui/logout", data={"csrf": _csrf(page)}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    anonymous = TestClient(farm.app, base_url="http://testserver")
    foreign = anonymous.post("/ui/login", data={"token": ADMIN}, headers={"Origin": "http://evil.example"},
                             follow_redirects=False)
    assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
    admin = _signed_in(farm)
    csrf = _csrf(admin.get("/ui/tokens").text)
    huge = admin.post("/ui/tokens/99999999999999999999999/revoke", data={"csrf": csrf}, follow_redirects=False)
    assert huge.status_code == 422 and "<h1>" in huge.text
    missing = admin.get("/ui/exports/no-such-export")
    assert missing.status_code == 404 and re.search(r'name="csrf" value="[0-9a-f]{40}"', missing.text)  # sign out works there


def test_the_cookie_is_a_session_of_its_own_ended_by_sign_out_and_by_its_token(farm):
    """The cookie is never the API token: a random session id, revoked at sign-out (a copy of the
    cookie taken before it is worthless after) and ended when its token is revoked."""
    from services.auth import create_token, revoke_token

    client = _signed_in(farm)
    cookie = client.cookies.get("exportfarm_session", path="/ui")
    assert cookie.startswith("efs_") and ADMIN not in cookie
    page = client.get("/ui/catalog").text
    stolen = TestClient(farm.app, base_url="http://testserver")
    stolen.cookies.set("exportfarm_session", cookie, path="/ui")
    assert stolen.get("/ui/catalog", follow_redirects=False).status_code == 200
    client.post("/ui/logout", data={"csrf": _csrf(page)}, follow_redirects=False)
    gone = stolen.get("/ui/catalog", follow_redirects=False)
    assert gone.status_code == 303 and gone.headers["location"] == "/ui/login"
    with session_scope(farm.settings.catalog_url) as session:
        row, token = create_token(session, "ui-short-lived", "read")
    reader = _signed_in(farm, token)
    assert reader.get("/ui/catalog", follow_redirects=False).status_code == 200
    with session_scope(farm.settings.catalog_url) as session:
        revoke_token(session, row.id)
    assert reader.get("/ui/catalog", follow_redirects=False).status_code == 303


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions_app(request, tmp_path):
    """The app alone (no exports) on each catalog, for what signing in leaves in it."""
    from tests.services_fixtures import fresh_postgres_database

    common = dict(data_dir=tmp_path / "data", signing_secret="ui-sessions-signing-secret-0123456789abcdef")
    if request.param == "sqlite":
        settings = Settings(**common)
        upgrade_schema(settings.catalog_url)
        yield TestClient(create_app(settings), base_url="http://testserver"), settings
        return
    with fresh_postgres_database() as url:
        settings = Settings(database_url=url, **common)
        upgrade_schema(settings.catalog_url)
        yield TestClient(create_app(settings), base_url="http://testserver"), settings


def test_sign_ins_keep_at_most_the_cap_of_sessions_per_token_and_purge_ended_ones(sessions_app):
    """One token signing in again and again (a script, a reloading tab) once left a row per sign-in
    forever (300 in 2.4 s): a sign-in now deletes the sessions that are over, expired or signed out,
    and the token's oldest beyond UI_SESSIONS_PER_TOKEN, which stop working."""
    import datetime

    from sqlalchemy import func, select, update

    from services.auth import end_ui_session
    from services.catalog.models import UiSession, utcnow

    app, settings = sessions_app
    cap = settings.ui_sessions_per_token
    with session_scope(settings.catalog_url) as session:
        busy_row, busy = create_token(session, "ui-busy-reader", "read")
        other_row, other = create_token(session, "ui-other-reader", "read")
        busy_id, other_id = busy_row.id, other_row.id

    def sign_in(token: str) -> str:
        response = app.post("/ui/login", data={"token": token}, follow_redirects=False)
        assert response.status_code == 303, response.text
        return app.cookies.get("exportfarm_session", path="/ui")

    def sessions_of(token_id: int) -> int:
        with session_scope(settings.catalog_url) as session:
            return session.scalar(select(func.count()).select_from(UiSession).where(UiSession.token_id == token_id))

    expired, signed_out = sign_in(other), sign_in(other)
    with session_scope(settings.catalog_url) as session:
        session.execute(update(UiSession).where(UiSession.token_id == other_id)
                        .values(expires_at=utcnow() - datetime.timedelta(seconds=1)))
    end_ui_session(app.app.state.context.sessions, signed_out)
    assert sessions_of(other_id) == 2 and expired != signed_out  # over, but still rows
    cookies = [sign_in(busy) for _ in range(3 * cap)]
    assert sessions_of(busy_id) == cap and sessions_of(other_id) == 0

    def works(cookie: str) -> bool:
        page = TestClient(app.app, base_url="http://testserver", cookies={"exportfarm_session": cookie})
        return page.get("/ui/catalog", follow_redirects=False).status_code == 200

    assert works(cookies[-cap]) and works(cookies[-1]) and not works(cookies[-cap - 1])


def test_the_pages_work_with_s3_storage_and_no_signing_secret(tmp_path):
    """The chart and compose deploy S3 without SIGNING_SECRET: the pages' forms need no server
    secret (their CSRF token is keyed by the browser's own session)."""
    from services.auth import KNOWN

    KNOWN.clear()  # this process checked ADMIN against the farm fixture's catalog: another token id there
    settings = Settings(data_dir=tmp_path / "data", admin_token=ADMIN, s3_endpoint_url="http://127.0.0.1:9",
                        s3_access_key="k", s3_secret_key="s", upload_attempts=1,
                        database_url=f"sqlite:///{tmp_path / 'catalog.db'}", redis_url="redis://127.0.0.1:6379/15")
    assert not settings.embedded and settings.signing_secret is None
    upgrade_schema(settings.catalog_url)
    with session_scope(settings.catalog_url) as session:
        row, _ = create_token(session, "to-revoke-from-the-page", "read")
        token_id = row.id
    client = TestClient(create_app(settings), base_url="http://testserver")
    assert client.post("/ui/login", data={"token": ADMIN}, follow_redirects=False).status_code == 303
    page = client.get("/ui/tokens")
    assert page.status_code == 200, page.text[:300]
    done = client.post(f"/ui/tokens/{token_id}/revoke", data={"csrf": _csrf(page.text)}, follow_redirects=False)
    assert done.status_code == 303, done.text[:300]
    assert client.post("/ui/logout", data={"csrf": _csrf(page.text)}, follow_redirects=False).status_code == 303
