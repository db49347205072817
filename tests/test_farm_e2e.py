"""The farm end to end on real servers: Redis broker, SeaweedFS S3, PostgreSQL catalog, Celery workers.

Workers are real ``exportfarm worker`` processes; the API is the real app in-process (TestClient).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.settings import Settings
from tests.s3_server import SeaweedS3
from tests.services_fixtures import REDIS_TEST_URL, flush_redis, fresh_postgres_database

ADMIN = "e2e-admin-token"
SLOW_BENCH = {"BENCH_REPEATS": "10000000"}  # a bench stage that runs until it is stopped


@pytest.fixture(scope="module")
def s3():
    with SeaweedS3() as server:
        yield server


@pytest.fixture(scope="module")
def farm_env(tmp_path_factory, checkpoint, s3):
    models = tmp_path_factory.mktemp("models")
    for arch in ("llama", "qwen2"):
        (models / f"tiny-{arch}").symlink_to(checkpoint(arch))
    flush_redis()
    with fresh_postgres_database() as database_url:
        yield {
            "DATABASE_URL": database_url, "REDIS_URL": REDIS_TEST_URL, "S3_ENDPOINT_URL": s3.endpoint_url,
            "S3_ACCESS_KEY": s3.access_key, "S3_SECRET_KEY": s3.secret_key, "S3_BUCKET": "farm-e2e",
            "MODELS_DIR": str(models), "DATA_DIR": str(tmp_path_factory.mktemp("data")),
            "WORK_DIR": str(tmp_path_factory.mktemp("work")), "HEARTBEAT_S": "0.5", "LEASE_S": "4",
            "VISIBILITY_TIMEOUT_S": "6", "WORKER_REPORT_S": "2", "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4",
            "UPLOAD_ATTEMPTS": "40", "UPLOAD_BACKOFF_S": "0.5", "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
        }


@pytest.fixture(scope="module")
def api(farm_env, monkeypatch_module):
    for key, value in farm_env.items():
        monkeypatch_module.setenv(key, value)
    settings = Settings()
    client = TestClient(create_app(settings))
    client.headers["Authorization"] = f"Bearer {ADMIN}"
    client.settings = settings
    return client


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


class WorkerProcess:
    """An ``exportfarm worker`` in its own process group, so a SIGKILL takes its pool children too."""

    def __init__(self, env: dict, name: str, log_dir, **overrides):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "worker", "--queues", "cpu", "--name", name, "--loglevel", "INFO"],
            env={**os.environ, **env, **overrides}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture
def workers(farm_env, tmp_path):
    started = []

    def start(name: str, **overrides) -> WorkerProcess:
        worker = WorkerProcess(farm_env, name, tmp_path, **overrides)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def wait_for(api, export_id, predicate, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        export = api.get(f"/exports/{export_id}").json()
        if predicate(export):
            return export
        if export["status"] in ("ready", "failed", "cancelled", "quarantined"):
            pytest.fail(f"export ended {export['status']}: {export['error']}")
        time.sleep(0.3)
    pytest.fail(f"timed out; last state {export['status']} / {export['stage']}")


def objects_under(s3, bucket, prefix):
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):]: o for o in listing.get("Contents", [])}


def assert_published(api, s3, export):
    """Every file is in the bucket with the manifest's sha256; the published manifest says ready."""
    bucket, prefix = api.settings.s3_bucket, export["storage_prefix"]
    client = s3.client()
    manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
    assert manifest["status"] == "ready"
    objects = objects_under(s3, bucket, prefix)
    assert set(objects) == set(manifest["files"]) | {"manifest.json"}
    for name, entry in manifest["files"].items():
        body = client.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"] and len(body) == entry["size"], name
    return manifest


def test_end_to_end_export_publish_catalog(api, s3, workers):
    workers("w-main")
    body = {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu"}
    posted = api.post("/exports", json=body)
    assert posted.status_code == 202, posted.text
    export = wait_for(api, posted.json()["id"], lambda e: e["status"] == "ready")
    assert export["percent"] == 100 and export["worker"].startswith("w-main")
    stages = [e["stage"] for e in export["events"]]
    for stage in ("resolve", "build", "fold", "package", "validate", "bench", "publish"):
        assert stage in stages, stages
    manifest = assert_published(api, s3, export)
    assert {"benchmark.json", "parity_report.json", "parity_report.md"} <= set(manifest["files"])
    assert export["figures"]["token_mismatches"] == 0 and export["figures"]["decode_ms"]

    links = api.get(f"/exports/{export['id']}/artifacts").json()
    for name, artifact in links["files"].items():
        with urllib.request.urlopen(artifact["url"], timeout=10) as response:
            data = response.read()
        if name != "manifest.json":
            assert hashlib.sha256(data).hexdigest() == artifact["sha256"], name

    again = api.post("/exports", json=body)
    assert again.status_code == 200 and again.json()["id"] == export["id"]

    second = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu", "static_cache": True,
                                        "max_seq_len": 64})
    wait_for(api, second.json()["id"], lambda e: e["status"] == "ready")
    catalog = api.get("/catalog/models").json()
    assert set(catalog) >= {"tiny-llama", "tiny-qwen2"}
    assert catalog["tiny-qwen2"]["attn_static-fp16-cpu-ms64"]["id"] == second.json()["id"]
    assert api.get("/readyz").json()["status"] == "ready"


def test_worker_killed_mid_job_is_finished_by_another_exactly_once(api, s3, workers):
    slow = workers("w-doomed", **SLOW_BENCH)
    posted = api.post("/exports", json={"model": "tiny-llama", "dtype": "fp16", "ep": "cpu", "variant": "gqa"}).json()
    wait_for(api, posted["id"], lambda e: e["stage"] == "bench" and (e["worker"] or "").startswith("w-doomed"))
    slow.kill()
    workers("w-rescue")
    export = wait_for(api, posted["id"], lambda e: e["status"] == "ready", timeout=240)
    assert export["worker"].startswith("w-rescue") and export["attempts"] == 2
    assert any("taken over" in (e["message"] or "") for e in export["events"])
    assert_published(api, s3, export)
    # Exactly once: one catalog row for this request, one set of objects under its key.
    rows = api.get("/exports", params={"model": "tiny-llama", "variant": "gqa"}).json()
    assert [r["id"] for r in rows["items"]] == [export["id"]]
    variant_prefix = export["storage_prefix"].rstrip("/").rsplit("/", 2)[0] + "/"
    export_ids = {key.split("/")[1] for key in objects_under(s3, api.settings.s3_bucket, variant_prefix)}
    assert export_ids == {export["id"]}


def test_cancel_running_job(api, s3, workers):
    workers("w-cancel", **SLOW_BENCH)
    posted = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "variant": "gqa"}).json()
    wait_for(api, posted["id"], lambda e: e["stage"] == "bench")
    assert api.delete(f"/exports/{posted['id']}").status_code == 202
    export = wait_for(api, posted["id"], lambda e: e["status"] == "cancelled", timeout=60)
    assert export["storage_prefix"] is None
    listing = s3.client().list_objects_v2(Bucket=api.settings.s3_bucket, Prefix="tiny-qwen2/")
    assert not [o["Key"] for o in listing.get("Contents", []) if posted["id"] in o["Key"]]


def test_s3_unreachable_during_publish_then_back(api, s3, workers):
    workers("w-publish")
    s3.stop()
    try:
        posted = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu"}).json()
        waiting = wait_for(api, posted["id"], lambda e: e["stage"] == "publish")
        time.sleep(2)
        assert api.get(f"/exports/{posted['id']}").json()["status"] == "running"  # not ready while unpublished
    finally:
        s3.start()
    export = wait_for(api, waiting["id"], lambda e: e["status"] == "ready", timeout=180)
    assert_published(api, s3, export)
