"""The REST API on its embedded defaults (SQLite, local store, file queue): contracts and errors."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.auth import create_token
from services.catalog.database import session_scope, upgrade_schema
from exporter import __version__
from exporter.request import ExportRequest
from services.settings import Settings

ADMIN = "admin-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def api(tmp_path_factory, checkpoint):
    models = tmp_path_factory.mktemp("models")
    (models / "tiny-qwen3").symlink_to(checkpoint("qwen3"))
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), models_dir=models, admin_token=ADMIN)
    upgrade_schema(settings.catalog_url)
    app = create_app(settings)
    with session_scope(settings.catalog_url) as session:
        _, reader = create_token(session, "tests-reader", "read")
    client = TestClient(app)
    client.reader = {"Authorization": f"Bearer {reader}"}
    client.admin = {"Authorization": f"Bearer {ADMIN}"}
    return client


def post(api, body, headers=None):
    return api.post("/exports", json=body, headers=api.admin if headers is None else headers)


def test_post_queues_and_identical_post_returns_it(api):
    body = {"model": "tiny-qwen3", "dtype": "fp32", "ep": "cpu"}
    first = post(api, body)
    assert first.status_code == 202, first.text
    data = first.json()
    assert data["status"] == "queued" and data["variant"] == "attn_dynamic" and data["revision"].startswith("local-")
    assert first.headers["location"] == f"/exports/{data['id']}" == data["links"]["self"]
    again = post(api, body)
    assert again.status_code == 200 and again.json()["id"] == data["id"]
    forced = post(api, {**body, "force": True})
    assert forced.status_code == 202 and forced.json()["id"] != data["id"]
    detail = api.get(f"/exports/{data['id']}", headers=api.reader).json()
    assert detail["events"][0]["to_status"] == "queued" and detail["percent"] == 0


def test_an_hf_layout_or_compat_request_is_a_build_of_its_own_and_the_farm_keys_stay(api):
    farm = post(api, {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu", "variant": "attn_dynamic", "force": True})
    hf = post(api, {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu", "layout": "hf", "force": True})
    compat = post(api, {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu", "variant": "attn_dynamic",
                        "compat": True, "force": True})
    assert farm.status_code == hf.status_code == compat.status_code == 202, (farm.text, hf.text, compat.text)
    farm, hf, compat = farm.json(), hf.json(), compat.json()
    assert (farm["layout"], farm["compat"]) == ("farm", False)
    assert (hf["layout"], hf["variant"]) == ("hf", "attn_dynamic")  # the variant both hf consumers drive
    assert compat["compat"] is True
    assert len({farm["cache_key"], hf["cache_key"], compat["cache_key"]}) == 3
    # A farm request's identity is what it was before layouts existed (the payload spelled out as
    # exporter/request.py's cache_key built it then): earlier exports keep their keys.
    before = {"request": {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu", "static_cache": False,
                          "max_seq_len": None, "variant": "attn_dynamic"},
              "revision": farm["revision"], "exporter": __version__, "onnxruntime": farm["ort_version"]}
    assert hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest() == farm["cache_key"]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "tiny-qwen3", "dtype": "fp8"}, ["dtype", "fp16"]),
        ({"model": "tiny-qwen3", "static_cache": True}, ["max_seq_len"]),
        ({"model": "tiny-qwen3", "static_cache": True, "max_seq_len": -4}, ["max_seq_len", "greater than 0"]),
        ({"model": "tiny-qwen3", "static_cache": True, "max_seq_len": 24}, ["max_seq_len 24", "validation needs", "40"]),
        ({"model": "../../etc/passwd"}, ["not a hub id", "'..'"]),
        ({"model": "org/name/../../x"}, ["not a hub id"]),
        ({"model": "tiny-qwen3", "ep": "cpu", "dtype": "bf16", "variant": "gqa"}, ["bf16", "cpu"]),
        ({"model": "tiny-qwen3", "static_cache": True, "max_seq_len": 100000, "ep": "cpu"}, ["max_position_embeddings"]),
        ({"model": "tiny-qwen3", "colour": "blue"}, ["colour", "not permitted"]),
        ({"model": "tiny-qwen3", "layout": "hf", "variant": "gqa"}, ["no hf layout", "right padding", "attn_dynamic"]),
        ({"model": "tiny-qwen3", "layout": "hf", "static_cache": True, "max_seq_len": 64}, ["no hf layout", "attn_static"]),
        ({"model": "tiny-qwen3", "layout": "hf", "dtype": "bf16", "ep": "cuda"}, ["no file name for bf16"]),
        ({"model": "tiny-qwen3", "layout": "onnx"}, ["layout", "farm", "hf"]),
        ({"model": "tiny-qwen3", "compat": True, "variant": "gqa"}, ["gqa", "compat", "attn_dynamic"]),
        ({"dtype": "fp16"}, ["model", "required"]),
    ],
)
def test_bad_requests_get_422_with_a_message(api, body, words):
    response = post(api, body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str)
    for word in words:
        assert word in detail, detail


def test_oversized_body_is_refused(api):
    response = api.post("/exports", content=b'{"model": "' + b"x" * 20000 + b'"}', headers={**api.admin, "content-type": "application/json"})
    assert response.status_code == 413


def test_tokens_and_scopes(api):
    body = {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu"}
    assert post(api, body, headers={}).status_code == 401
    assert post(api, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    forbidden = post(api, body, headers=api.reader)
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["detail"]
    assert api.get("/exports").status_code == 401
    assert api.get("/exports", headers=api.reader).status_code == 200
    assert api.delete("/exports/whatever", headers=api.reader).status_code == 403
    assert api.get("/healthz").status_code == 200  # health needs no token


def test_list_filters_and_paging(api):
    for n in (40, 48, 64):
        post(api, {"model": "tiny-qwen3", "dtype": "fp32", "ep": "cpu", "static_cache": True, "max_seq_len": n})
    page = api.get("/exports", params={"variant": "attn_static", "limit": 2}, headers=api.reader).json()
    assert page["total"] >= 3 and len(page["items"]) == 2
    assert all(item["variant"] == "attn_static" for item in page["items"])
    bad = api.get("/exports", params={"status": "sleeping"}, headers=api.reader)
    assert bad.status_code == 422 and "queued" in bad.json()["detail"]


def test_cancel_queued_then_conflict(api):
    export = post(api, {"model": "tiny-qwen3", "dtype": "fp16", "ep": "cpu", "variant": "gqa"}).json()
    cancelled = api.delete(f"/exports/{export['id']}", headers=api.admin)
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert api.delete(f"/exports/{export['id']}", headers=api.admin).status_code == 409
    assert api.get("/exports/nope", headers=api.reader).status_code == 404
    artifacts = api.get(f"/exports/{export['id']}/artifacts", headers=api.reader)
    assert artifacts.status_code == 409 and "nothing is published" in artifacts.json()["detail"]


def test_readyz_checks_every_dependency(api):
    ready = api.get("/readyz").json()
    assert set(ready["checks"]) == {"database", "broker", "storage"}
    assert ready["status"] == "ready", ready


def test_metrics_and_openapi(api):
    text = api.get("/metrics", headers=api.reader).text
    assert "exportfarm_http_request_seconds_bucket" in text and 'exportfarm_exports{status="queued"}' in text
    schema = api.get("/openapi.json").json()
    example = schema["components"]["schemas"]["ExportCreate"]["examples"][0]
    assert example["model"] and "/exports" in schema["paths"]


def test_catalog_views_404_for_unknown_model(api):
    assert api.get("/catalog/models", headers=api.reader).status_code == 200
    assert api.get("/catalog/models/no/such", headers=api.reader).status_code == 404


# --- hostile input (issue: no 5xx, strict schemas, auth before the body) --------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "q\n", "ep": "cpu"}, ["model", "not a hub id"]),
        ({"model": "tiny\tqwen3", "ep": "cpu"}, ["model"]),
        ({"model": "tiny-qwen3", "ep": "cpu", "static_cache": True, "max_seq_len": True}, ["max_seq_len", "integer"]),
        ({"model": "tiny-qwen3", "ep": "cpu", "static_cache": True, "max_seq_len": "4096"}, ["max_seq_len", "integer"]),
        ({"model": "tiny-qwen3", "ep": "cpu", "static_cache": 1, "max_seq_len": 64}, ["static_cache", "boolean"]),
        ({"model": "tiny-qwen3", "ep": "cpu", "force": "yes"}, ["force", "boolean"]),
        ({"model": "no-such-model", "ep": "cpu"}, ["no model directory 'no-such-model'", "HUB_ACCESS"]),
        ({"model": "tests", "ep": "cpu"}, ["no model directory 'tests'"]),  # a directory of the API's cwd is no model
    ],
)
def test_strict_requests(api, body, words):
    response = post(api, body)
    assert response.status_code == 422, response.text
    for word in words:
        assert word in response.json()["detail"], response.json()["detail"]


@pytest.mark.parametrize("params", [{"offset": 10**20}, {"offset": -1}, {"limit": 0}, {"limit": 10**6},
                                    {"status": "sleeping"}, {"variant": "fast"}, {"model": "x" * 400}])
def test_paging_and_filters_are_bounded(api, params):
    response = api.get("/exports", params=params, headers=api.reader)
    assert response.status_code == 422, response.text


def test_authentication_comes_before_the_body(api):
    malformed = b'{"model": '
    headers = {"content-type": "application/json"}
    assert api.post("/exports", content=malformed, headers=headers).status_code == 401
    assert api.post("/exports", content=malformed, headers={**headers, **api.reader}).status_code == 403
    assert api.post("/exports", content=malformed, headers={**headers, **api.admin}).status_code == 422


@pytest.fixture(scope="module")
def live(api):
    """The same app behind a real uvicorn server (a socket, for what TestClient buffers away)."""
    import threading
    import time

    import uvicorn

    from tests.s3_server import free_ports

    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def raw_post(port: int, headers: str, chunks) -> tuple[bytes, int]:
    """Send a POST over a plain socket chunk by chunk; returns (response head, body bytes sent)."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST /exports HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    sent = 0
    try:
        for chunk in chunks:
            sock.sendall(chunk)
            sent += len(chunk)
            sock.settimeout(0.001)
            try:
                head = sock.recv(4096)
                if head:
                    return head, sent
            except (BlockingIOError, TimeoutError, socket.timeout):
                pass
            finally:
                sock.settimeout(10)
        return sock.recv(4096), sent
    except (BrokenPipeError, ConnectionResetError):
        return sock.recv(4096), sent
    finally:
        sock.close()


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(live):
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"  # 64 KiB per chunk, 1000 chunks: 64 MiB if all read
    head, sent = raw_post(live, f"Authorization: Bearer {ADMIN}\r\nTransfer-Encoding: chunked\r\n"
                                "Content-Type: application/json\r\n", (chunk for _ in range(1000)))
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent < 4 << 20  # refused after the limit (16 KiB), long before the 64 MiB


def test_an_unauthenticated_request_is_refused_before_its_body_is_read(live):
    # 10 KB announced, 1 KB sent: the answer comes without the server waiting for the rest.
    head, _ = raw_post(live, "Content-Length: 10000\r\nContent-Type: application/json\r\n", [b"{" * 1000])
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
    # 70 MB announced: refused at once, authenticated or not, nothing read.
    head, sent = raw_post(live, "Content-Length: 70000000\r\n", (b"x" * 65536 for _ in range(1000)))
    assert head.startswith(b"HTTP/1.1 413") and sent < 4 << 20, head[:200]


def test_tokens_can_be_created_listed_used_and_revoked(api):
    created = api.post("/tokens", json={"name": "ci-reader", "scope": "read", "expires_in_s": 3600}, headers=api.admin)
    assert created.status_code == 201, created.text
    token = created.json()
    assert token["token"].startswith("ef_") and token["expires_at"] is not None
    mine = {"Authorization": f"Bearer {token['token']}"}
    assert api.get("/exports", headers=mine).status_code == 200
    listed = {t["id"]: t for t in api.get("/tokens", headers=api.admin).json()}
    assert "token" not in listed[token["id"]] and listed[token["id"]]["last_used_at"] is not None
    assert api.get("/tokens", headers=mine).status_code == 403  # the list needs admin, as does creating one
    assert api.post("/tokens", json={"name": "x", "scope": "admin"}, headers=mine).status_code == 403
    revoked = api.delete(f"/tokens/{token['id']}", headers=api.admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert api.get("/exports", headers=mine).status_code == 401
    assert api.delete("/tokens/999999", headers=api.admin).status_code == 404
    bad = api.post("/tokens", json={"name": "x", "scope": "root"}, headers=api.admin)
    assert bad.status_code == 422 and "scope" in bad.json()["detail"]


def test_an_expired_token_is_refused(api):
    import time

    from services.auth import create_token

    with session_scope(api.app.state.context.settings.catalog_url) as session:
        _, token = create_token(session, "short-lived", "read", expires_in_s=1)
    headers = {"Authorization": f"Bearer {token}"}
    assert api.get("/exports", headers=headers).status_code == 200
    time.sleep(1.2)
    assert api.get("/exports", headers=headers).status_code == 401  # even though this process checked it


def test_an_unexpected_error_is_a_500_with_an_id_and_no_internals(api):
    def broken():
        raise RuntimeError("password=hunter2 at db.internal:5432")

    api.app.add_api_route("/exports-broken-for-test", broken, methods=["GET"])
    response = TestClient(api.app, raise_server_exceptions=False).get("/exports-broken-for-test", headers=api.reader)
    assert response.status_code == 500
    assert response.json()["error_id"] and "hunter2" not in response.text and "5432" not in response.text


# --- settings-dependent behaviour: each with an app of its own ------------------------------------


def make_app(tmp_path, checkpoint=None, **overrides):
    models = tmp_path / "models"
    models.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None and not (models / "tiny-llama").exists():
        (models / "tiny-llama").symlink_to(checkpoint("llama"))
    settings = Settings(**{"data_dir": tmp_path / "data", "models_dir": models, "admin_token": ADMIN, **overrides})
    upgrade_schema(settings.catalog_url)
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {settings.admin_token}"
    client.settings = settings
    return client


def test_a_fixed_chat_template_is_a_new_revision_not_the_old_export(tmp_path, checkpoint):
    """The same request for a local model whose chat_template.jinja changed is a new export: the
    revision in its cache key covers every file the export publishes, not only the JSON ones."""
    import shutil

    client = make_app(tmp_path)
    model = shutil.copytree(checkpoint("llama"), client.settings.models_dir / "tiny-chat")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    body = {"model": "tiny-chat", "dtype": "fp32", "ep": "cpu"}
    first = client.post("/exports", json=body)
    assert first.status_code == 202, first.text
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    again = client.post("/exports", json=body)
    assert again.status_code == 202, again.text
    assert again.json()["revision"] != first.json()["revision"]
    assert again.json()["cache_key"] != first.json()["cache_key"] and again.json()["id"] != first.json()["id"]


def test_new_weights_in_a_shard_the_index_puts_in_a_subfolder_are_a_new_revision(tmp_path, checkpoint):
    """The API keys a local model's revision on a signature of its files: a shard the index puts in a
    folder is one of them, or the export of the old weights comes back."""
    import shutil

    from exporter.tiny_checkpoint import shards_in_subfolder

    client = make_app(tmp_path)
    model = shards_in_subfolder(checkpoint("llama"), client.settings.models_dir / "tiny-sub",
                                checkpoint("llama", seed=1))
    body = {"model": "tiny-sub", "dtype": "fp32", "ep": "cpu"}
    first = client.post("/exports", json=body)
    assert first.status_code == 202, first.text
    shard = model / "sub" / "model-00001-of-00001.safetensors"
    shutil.copyfile(checkpoint("llama", seed=2) / "model.safetensors", shard)  # other weights, same shapes
    again = client.post("/exports", json=body)
    assert again.status_code == 202, again.text
    assert again.json()["revision"] != first.json()["revision"]


def test_changing_admin_token_revokes_the_previous_one(tmp_path):
    first = make_app(tmp_path)
    assert first.get("/exports").status_code == 200
    second = make_app(tmp_path, admin_token="a-new-admin-token-0123456789abcdef")
    assert second.get("/exports").status_code == 200
    old = {"Authorization": f"Bearer {ADMIN}"}
    assert second.get("/exports", headers=old).status_code == 401
    assert first.get("/exports", headers=old).status_code == 401  # the process that knew it, too
    tokens = second.get("/tokens").json()
    assert [t["revoked_at"] is not None for t in tokens if t["bootstrap"]] == [True, False]
    # an old pod restarting mid-rollout with the rotated-out token neither revives it nor revokes the new one
    third = make_app(tmp_path)
    assert third.get("/exports", headers=old).status_code == 401
    assert third.get("/exports", headers={"Authorization": "Bearer a-new-admin-token-0123456789abcdef"}).status_code == 200
    tokens = second.get("/tokens").json()
    assert [t["revoked_at"] is not None for t in tokens if t["bootstrap"]] == [True, False]


def test_short_admin_tokens_and_signing_secrets_are_refused(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="at least 24"):
        Settings(data_dir=tmp_path, admin_token="short")
    with pytest.raises(ValidationError, match="at least 32"):
        Settings(data_dir=tmp_path, signing_secret="short")


def test_failed_authentications_are_rate_limited_per_client(tmp_path):
    client = make_app(tmp_path, auth_failures_per_minute=5)
    for _ in range(5):
        assert client.get("/exports", headers={"Authorization": "Bearer not-a-token-at-all"}).status_code == 401
    limited = client.get("/exports", headers={"Authorization": "Bearer not-a-token-at-all"})
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) > 0
    other = client.get("/exports", headers={"Authorization": "Bearer another-wrong-token-0123456"})
    assert other.status_code == 429  # the client, not the token, is limited
    assert client.get("/healthz").status_code == 200
    # a valid token is never refused for the failures before it (a fuzzer's, or another user's
    # behind the same proxy)
    assert client.get("/exports", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_failures_are_counted_per_forwarded_client_behind_a_trusted_proxy(tmp_path):
    from services.api.guard import client_address

    scope = {"client": ("10.0.0.5", 1), "headers": [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.7")]}
    assert client_address(scope, ["10.0.0.5"]) == "203.0.113.7"  # the hop the proxy saw
    assert client_address(scope, []) == "10.0.0.5"  # an untrusted peer's header is ignored
    assert client_address({**scope, "client": ("198.51.100.1", 1)}, ["10.0.0.5"]) == "198.51.100.1"
    client = make_app(tmp_path, auth_failures_per_minute=2, trusted_proxies=["testclient"])
    bad = {"Authorization": "Bearer not-a-token-at-all"}
    for _ in range(2):
        assert client.get("/exports", headers={**bad, "X-Forwarded-For": "203.0.113.7"}).status_code == 401
    assert client.get("/exports", headers={**bad, "X-Forwarded-For": "203.0.113.7"}).status_code == 429
    assert client.get("/exports", headers={**bad, "X-Forwarded-For": "203.0.113.8"}).status_code == 401


def test_a_served_api_counts_failures_per_peer_whatever_x_forwarded_for_says(tmp_path, monkeypatch):
    """`exportfarm serve`, a real uvicorn on a loopback port, TRUSTED_PROXIES unset: X-Forwarded-For
    is the client's own word. uvicorn once rewrote the client from it itself (its proxy headers
    default trusts 127.0.0.1), so a made-up address per request avoided every 429."""
    import httpx

    from tests import farm
    from tests.s3_server import free_ports

    for name in ("TRUSTED_PROXIES", "FORWARDED_ALLOW_IPS", "DATABASE_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    allowed, port = 3, free_ports(1)[0]
    env = {"DATA_DIR": str(tmp_path / "data"), "ADMIN_TOKEN": ADMIN, "AUTH_FAILURES_PER_MINUTE": str(allowed)}
    serve = farm.FarmProcess([sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--no-worker"],
                             env, tmp_path / "serve.log")
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert serve.alive(), serve.log_text()
            try:
                return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        farm.until(healthy, bool, 120, "serve to answer /healthz")
        codes = [httpx.get(f"{base}/exports", timeout=10, headers={
            "Authorization": "Bearer not-a-token-at-all", "X-Forwarded-For": f"203.0.113.{n}"}).status_code
            for n in range(allowed + 2)]
        assert codes == [401] * allowed + [429] * 2, serve.log_text()[-2000:]
        assert httpx.get(f"{base}/exports", timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    finally:
        serve.stop()


def test_a_non_ascii_signature_or_csrf_value_is_refused_not_a_server_error(tmp_path):
    client = make_app(tmp_path)
    assert client.get("/files/anything?expires=99999999999&signature=%C3%A9").status_code == 403
    client.cookies.set("exportfarm_session", ADMIN, path="/ui")
    page = client.post("/ui/logout", data={"csrf": "é"}, headers={"Origin": "http://testserver"})
    assert page.status_code == 403


def test_download_links_survive_a_restart_in_embedded_mode(tmp_path):
    first = make_app(tmp_path)
    store = first.app.state.context.store
    store.put_bytes("m/r/v/ort-1/e/hello.txt", b"hello")
    link = store.presigned_url("m/r/v/ort-1/e/hello.txt", 60).removeprefix(first.settings.public_base_url)
    assert first.get(link).content == b"hello"
    restarted = make_app(tmp_path)  # the key was kept in DATA_DIR/signing.key
    assert restarted.get(link).content == b"hello"
    assert restarted.get(link.replace("signature=", "signature=0")).status_code == 403
    assert oct((tmp_path / "data" / "signing.key").stat().st_mode & 0o777) == "0o600"


def test_outside_embedded_mode_a_local_store_needs_a_signing_secret(tmp_path):
    from exporter.errors import ExportError

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with pytest.raises(ExportError, match="SIGNING_SECRET"):
        make_app(tmp_path, database_url=url)


def test_the_api_refuses_an_old_schema(tmp_path):
    from exporter.errors import ExportError

    settings = Settings(data_dir=tmp_path / "data")
    with pytest.raises(ExportError, match="db-upgrade"):
        create_app(settings)


def test_hub_ids_only_with_hub_access_and_never_looked_up_by_the_api(tmp_path):
    import time

    off = make_app(tmp_path / "off")
    refused = off.post("/exports", json={"model": "org/model", "ep": "cpu"})
    assert refused.status_code == 422 and "HUB_ACCESS" in refused.json()["detail"]
    on = make_app(tmp_path / "on", hub_access=True)
    started = time.monotonic()
    accepted = on.post("/exports", json={"model": "org/model@v1.0", "ep": "cpu", "dtype": "fp32"})
    assert accepted.status_code == 202, accepted.text
    assert time.monotonic() - started < 2  # no hub round trip in the request
    assert accepted.json()["revision"] == "ref-v1.0"  # the worker replaces it with the commit it downloads
    pinned = on.post("/exports", json={"model": "org/model@" + "a" * 40, "ep": "cpu", "dtype": "fp32"}).json()
    assert pinned["revision"] == "a" * 40


def test_a_locked_catalog_is_a_503_within_seconds(tmp_path, checkpoint):
    import sqlite3
    import time

    client = make_app(tmp_path, checkpoint)
    lock = sqlite3.connect(tmp_path / "data" / "catalog.db", timeout=1)
    lock.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    try:
        started = time.monotonic()
        response = client.post("/exports", json={"model": "tiny-llama", "ep": "cpu", "dtype": "fp32"})
        elapsed = time.monotonic() - started
    finally:
        lock.rollback()
        lock.close()
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.text
    assert elapsed < 15 and "catalog" in response.json()["detail"]


def test_an_unreachable_store_is_a_503_within_seconds_and_readyz_shows_no_internals(tmp_path, checkpoint):
    import time

    from services import lifecycle
    from services.catalog.models import ExportStatus
    from services.jobs import submit_export
    from tests.s3_server import free_ports

    port = free_ports(1)[0]  # nothing listens there: the store is down
    client = make_app(tmp_path, checkpoint, s3_endpoint_url=f"http://127.0.0.1:{port}", s3_access_key="k",
                      s3_secret_key="s")
    with session_scope(client.settings.catalog_url) as session:
        export, _ = submit_export(session, client.settings, ExportRequest(model="tiny-llama", ep="cpu"))
        export_id = export.id
    with session_scope(client.settings.catalog_url) as session:
        lease = lifecycle.claim(session, export_id, "w", 1, "1.0").lease
        lifecycle.finish(session, lease, ExportStatus.READY, storage_prefix="a/b/", manifest={"files": {}})
    started = time.monotonic()
    response = client.get(f"/exports/{export_id}/artifacts")
    assert response.status_code == 503 and time.monotonic() - started < 15, response.text
    ready = client.get("/readyz", headers={"Authorization": ""})
    assert ready.status_code == 503 and ready.json()["checks"]["storage"] == "unavailable"
    assert str(port) not in ready.text and "127.0.0.1" not in ready.text


def test_an_image_text_model_is_queued_for_its_hand_built_graphs_and_refused_where_they_cannot_be(tmp_path):
    """A local image-text checkpoint (gemma3: vision tower, projector, language model) has no text architecture of
    its model_type, yet it is not sent to the traced fallback: its variant is kept (a traced job is attn_dynamic
    whatever was asked) and what its three graphs cannot be is refused before queueing, saying why."""
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    client = make_app(tmp_path)
    make_tiny_vlm_checkpoint("gemma3", client.settings.models_dir / "tiny-gemma3-vlm")
    queued = client.post("/exports", json={"model": "tiny-gemma3-vlm", "dtype": "fp32", "ep": "cpu", "variant": "gqa"})
    assert queued.status_code == 202, queued.text
    assert queued.json()["variant"] == "gqa"
    refused = client.post("/exports", json={"model": "tiny-gemma3-vlm", "dtype": "fp32", "ep": "cpu",
                                            "variant": "attn_dynamic", "compat": True})
    assert refused.status_code == 422, refused.text
    assert "image-text export is built for the current onnxruntime only" in refused.json()["detail"]
