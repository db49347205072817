"""The REST API on its embedded defaults (SQLite, local store, file queue): contracts and errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.auth import create_token
from services.catalog.database import session_scope
from services.settings import Settings

ADMIN, READER = "admin-token-for-tests", None


@pytest.fixture(scope="module")
def api(tmp_path_factory, checkpoint):
    models = tmp_path_factory.mktemp("models")
    (models / "tiny-qwen3").symlink_to(checkpoint("qwen3"))
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), models_dir=models, admin_token=ADMIN,
                        signing_secret="s3cret")
    app = create_app(settings)
    with session_scope(settings.catalog_url) as session:
        reader = create_token(session, "tests-reader", "read")
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
    assert response.status_code == 413 and "bytes" in response.json()["detail"]


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
