"""The farm on real servers, under real faults: Redis broker, SeaweedFS S3, PostgreSQL catalog.

Workers and beat are real ``exportfarm`` processes; the API is the real app in-process
(TestClient). Two workers are kept alive throughout; faults are real signals to real process
groups (SIGKILL, SIGSTOP/SIGCONT), a Redis server that is killed and restarted empty, an S3 server
that is stopped. Failpoints (workers/failpoints.py) only choose the moment.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests import farm
from tests.s3_server import SeaweedS3, free_ports
from tests.services_fixtures import farm_api, fresh_postgres_database

ADMIN = "e2e-admin-token-0123456789abcdef"
LEASE_S, SWEEP_S, MAX_ATTEMPTS = 3.0, 0.5, 3
TERMINAL = ("ready", "failed", "cancelled", "quarantined")


@pytest.fixture(scope="module")
def s3():
    with SeaweedS3() as server:
        yield server


@pytest.fixture(scope="module")
def redis_server():
    server = farm.RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def failpoints(tmp_path_factory):
    return farm.Failpoints(tmp_path_factory.mktemp("failpoints") / "failpoints.json")


@pytest.fixture(scope="module")
def farm_env(tmp_path_factory, checkpoint, s3, redis_server, failpoints):
    models = tmp_path_factory.mktemp("models")
    for arch in ("llama", "qwen2"):
        (models / f"tiny-{arch}").symlink_to(checkpoint(arch))
    with fresh_postgres_database() as database_url:
        yield {
            "DATABASE_URL": database_url, "REDIS_URL": redis_server.url, "S3_ENDPOINT_URL": s3.endpoint_url,
            "S3_ACCESS_KEY": s3.access_key, "S3_SECRET_KEY": s3.secret_key, "S3_BUCKET": "farm-e2e",
            "MODELS_DIR": str(models), "DATA_DIR": str(tmp_path_factory.mktemp("data")),
            "WORK_DIR": str(tmp_path_factory.mktemp("work")), "HEARTBEAT_S": "0.5", "LEASE_S": str(LEASE_S),
            "SWEEP_INTERVAL_S": str(SWEEP_S), "REDISPATCH_S": "3", "MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "WORKER_REPORT_S": "1", "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4", "UPLOAD_ATTEMPTS": "40",
            "UPLOAD_BACKOFF_S": "0.5", "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
            "EXPORTFARM_FAILPOINTS": str(failpoints.path),
        }


@pytest.fixture(scope="module")
def api(farm_env):
    with farm_api(farm_env, ADMIN) as client:
        yield client


class Pool:
    """Keeps ``size`` live workers; a killed one is replaced by a new one with a new name."""

    def __init__(self, env, logs, size=2):
        self.env, self.logs, self.size = env, logs, size
        self.names = (f"w{i}" for i in itertools.count(1))
        self.workers: dict[str, farm.FarmProcess] = {}
        self.fill()

    def fill(self):
        for name, process in list(self.workers.items()):
            if not process.alive():
                del self.workers[name]
        while len(self.workers) < self.size:
            name = next(self.names)
            self.workers[name] = farm.worker(self.env, name, self.logs)

    def holding(self, export: dict) -> farm.FarmProcess:
        return self.workers[export["worker"]]

    def close(self):
        for process in self.workers.values():
            process.stop()


@pytest.fixture(scope="module")
def pool(farm_env, logs, api):
    workers = Pool(farm_env, logs)
    beat = farm.beat(farm_env, logs)
    yield workers
    beat.stop()
    workers.close()


@pytest.fixture(autouse=True)
def clean_failpoints(failpoints):
    failpoints.clear()
    yield
    failpoints.clear()


def get(api, export_id) -> dict:
    return api.get(f"/exports/{export_id}").json()


def wait_for(api, export_id, predicate, timeout=180, what="condition"):
    return farm.until(lambda: get(api, export_id), predicate, timeout, what)


def wait_done(api, export_id, timeout=240) -> dict:
    return wait_for(api, export_id, lambda e: e["status"] in TERMINAL, timeout, "the export to end")


def objects_under(s3, bucket, prefix) -> dict:
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):]: (o["ETag"], o["Size"], o["LastModified"]) for o in listing.get("Contents", [])}


def keys_of_export(api, s3, export_id) -> list[str]:
    listing = s3.client().list_objects_v2(Bucket=api.settings.s3_bucket)
    return [o["Key"] for o in listing.get("Contents", []) if f"/{export_id}/" in o["Key"]]


def only_withdrawn_manifest(api, s3, export_id) -> bool:
    """What a cancelled export that had published leaves: its withdrawn manifest and nothing else."""
    keys = keys_of_export(api, s3, export_id)
    client = s3.client()
    return len(keys) == 1 and keys[0].endswith("/manifest.json") and json.loads(
        client.get_object(Bucket=api.settings.s3_bucket, Key=keys[0])["Body"].read())["status"] == "withdrawn"


def assert_published_once(api, s3, export):
    """Ready once: one ready event, every file in the bucket with the manifest's sha256, and no other
    export id under the same variant's prefix (nothing published twice)."""
    assert export["status"] == "ready", export["error"]
    assert [e["to_status"] for e in export["events"]].count("ready") == 1
    bucket, prefix = api.settings.s3_bucket, export["storage_prefix"]
    client = s3.client()
    manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
    assert manifest["status"] == "ready" and manifest["export_id"] == export["id"]
    assert manifest["cache_key"] == export["cache_key"]  # catalog and manifest agree on what was built
    assert set(objects_under(s3, bucket, prefix)) == set(manifest["files"]) | {"manifest.json"}
    for name, entry in manifest["files"].items():
        body = client.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"] and len(body) == entry["size"], name
    variant_prefix = prefix.rstrip("/").rsplit("/", 2)[0] + "/"
    exports_there = {key.split("/")[1] for key in objects_under(s3, bucket, variant_prefix)}  # ort-<v>/<id>/...
    assert exports_there == {export["id"]}
    return manifest


def event_time(export, predicate) -> float:
    for event in export["events"]:
        if predicate(event):
            return datetime.datetime.fromisoformat(event["at"]).timestamp()
    raise AssertionError(f"no such event in {[e['message'] for e in export['events']]}")


def test_end_to_end_export_publish_catalog(api, s3, pool):
    body = {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu"}
    posted = api.post("/exports", json=body)
    assert posted.status_code == 202, posted.text
    assert posted.json()["dispatched_at"] is not None  # sent at once: the broker is up
    export = wait_done(api, posted.json()["id"])
    assert export["percent"] == 100 and export["attempts"] == 1
    stages = [e["stage"] for e in export["events"]]
    for stage in ("resolve", "build", "fold", "package", "validate", "bench", "publish"):
        assert stage in stages, stages
    manifest = assert_published_once(api, s3, export)
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
    assert api.get("/readyz").json()["status"] == "ready"


KILL_IN = {  # stage -> a request of its own (identical requests would share one export)
    "resolve": {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu"},
    "build": {"model": "tiny-llama", "dtype": "fp16", "ep": "cpu"},
    "validate": {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu", "variant": "gqa"},
    "bench": {"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu", "variant": "gqa"},
    "upload": {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "static_cache": True, "max_seq_len": 64},
}


@pytest.mark.parametrize("stage", list(KILL_IN))
def test_worker_killed_in_a_stage_is_finished_by_the_other_once(api, s3, pool, failpoints, stage):
    failpoints.set(stage, attempt=1)
    posted = api.post("/exports", json=KILL_IN[stage]).json()
    catalog_stage = "publish" if stage == "upload" else stage
    held = wait_for(api, posted["id"], lambda e: e["stage"] == catalog_stage and e["worker"], what=f"stage {stage}")
    doomed = pool.holding(held)
    if stage == "upload":  # paused after the weights went up: a half-published export
        farm.until(lambda: keys_of_export(api, s3, posted["id"]), bool, 60, "the first upload")
    doomed.kill()
    killed_at = time.time()
    pool.fill()
    export = wait_done(api, posted["id"])
    assert export["attempts"] == 2 and export["worker"] != held["worker"], [e["message"] for e in export["events"]]
    taken_over = event_time(export, lambda e: (e["message"] or "").startswith("attempt 2 started"))
    assert taken_over - killed_at < LEASE_S + 2 * SWEEP_S + 2.0  # within lease + sweep interval (+ a beat)
    assert any("attempt 1 lost" in (e["message"] or "") for e in export["events"])
    assert_published_once(api, s3, export)
    again = api.post("/exports", json=KILL_IN[stage])
    assert again.status_code == 200 and again.json()["id"] == export["id"]


def test_an_hf_layout_export_is_published_laid_out_once_through_a_worker_killed_laying_it_out(
        api, s3, pool, failpoints):
    """layout "hf" through the REST API: the worker validates and benchmarks the farm export, lays it out
    as a Hugging Face repository (its own stage, killed here once) and publishes that folder, at a
    prefix of its own; the catalog lists it as a build of its own."""
    body = {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "layout": "hf"}
    failpoints.set("layout", attempt=1)
    posted = api.post("/exports", json=body)
    assert posted.status_code == 202, posted.text
    held = wait_for(api, posted.json()["id"], lambda e: e["stage"] == "layout" and e["worker"], what="stage layout")
    pool.holding(held).kill()
    pool.fill()
    export = wait_done(api, posted.json()["id"])
    assert export["attempts"] == 2 and (export["layout"], export["variant"]) == ("hf", "attn_dynamic")
    manifest = assert_published_once(api, s3, export)
    assert manifest["layout"]["kind"] == "hf" and export["storage_prefix"].split("/")[-4].endswith("-hf")
    assert {"config.json", "onnx/model.onnx", "onnx/model.onnx_data", "parity_report.json",
            "benchmark.json"} <= set(manifest["files"])
    assert "model.onnx" not in manifest["files"] and "genai_config.json" not in manifest["files"]
    config = json.loads(s3.client().get_object(Bucket=api.settings.s3_bucket,
                                               Key=export["storage_prefix"] + "config.json")["Body"].read())
    assert config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1}
    variants = api.get("/catalog/models/tiny-qwen2").json()["variants"]
    assert variants["attn_dynamic-fp32-cpu-hf"]["id"] == export["id"], variants


def test_a_worker_stopped_past_its_lease_writes_nothing_after_it_resumes(api, s3, pool, failpoints):
    failpoints.set("upload", attempt=1, seconds=2)
    posted = api.post("/exports", json={"model": "tiny-llama", "dtype": "fp32", "ep": "cpu", "variant": "gqa",
                                        "max_seq_len": 96}).json()
    held = wait_for(api, posted["id"], lambda e: e["stage"] == "publish" and e["worker"], what="publishing")
    stale = pool.holding(held)
    farm.until(lambda: keys_of_export(api, s3, posted["id"]), bool, 60, "the first upload")
    stale.signal(signal.SIGSTOP)  # mid-publish: the weights are up, the manifest is not
    try:
        export = wait_done(api, posted["id"])  # the other worker takes over once the lease is gone
        assert export["attempts"] == 2 and export["worker"] != held["worker"]
        manifest = assert_published_once(api, s3, export)
        bucket = api.settings.s3_bucket
        before = (objects_under(s3, bucket, export["storage_prefix"]), get(api, export["id"]))
    finally:
        stale.signal(signal.SIGCONT)
    # It resumes where it stopped, about to upload the next file: its lease guard must refuse.
    farm.until(stale.log_text, lambda text: "lost its lease" in text, 30, "the stale worker to notice")
    time.sleep(2 * LEASE_S)
    after = (objects_under(s3, bucket, export["storage_prefix"]), get(api, export["id"]))
    assert after == before  # no object, no catalog write, no event from the stale attempt
    assert json.loads(s3.client().get_object(Bucket=bucket, Key=export["storage_prefix"] + "manifest.json")
                      ["Body"].read()) == manifest
    assert stale.alive()  # it stopped the job, not itself


def test_broker_down_when_a_job_is_committed_runs_once_it_is_back(api, s3, pool, redis_server):
    redis_server.stop()  # an empty Redis comes back: every message in it is gone too
    try:
        posted = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "variant": "gqa"})
        assert posted.status_code == 202, posted.text  # accepted: the catalog has it
        assert posted.json()["status"] == "queued" and posted.json()["dispatched_at"] is None
        time.sleep(2)
    finally:
        redis_server.start()
    export = wait_done(api, posted.json()["id"])
    assert_published_once(api, s3, export)


def test_a_poison_job_fails_after_max_attempts_with_the_reason(api, pool, failpoints):
    failpoints.set("validate", attempt=None)  # every attempt reaches validate, and its process dies there
    posted = api.post("/exports", json={"model": "tiny-llama", "dtype": "fp16", "ep": "cpu", "variant": "gqa"}).json()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        held = wait_for(api, posted["id"], lambda e: e["attempts"] == attempt and e["stage"] == "validate"
                        and e["status"] == "running", what=f"attempt {attempt} in validate")
        children = pool.holding(held).pool_children()
        assert children, "the worker has no pool process"
        for pid in children:  # what the kernel's OOM killer does: the pool process, not the worker
            __import__("os").kill(pid, signal.SIGKILL)
    failed = wait_done(api, posted["id"])
    assert failed["status"] == "failed" and failed["attempts"] == MAX_ATTEMPTS
    assert f"gave up after {MAX_ATTEMPTS} lost attempts" in failed["error"]
    assert "during validate" in failed["error"] and "pool process died" in failed["error"]


@pytest.mark.parametrize("stage", ["validate", "bench"])
def test_a_native_crash_fails_the_job_once_with_the_reason_and_the_worker_lives_on(api, s3, pool, failpoints, stage):
    """A kernel bug (here a planted read of address 0 inside the stage process, crashing it with SIGSEGV
    at every attempt) ends the job failed at its first attempt, naming the crash and the stage; the
    worker and its pool process stay up and run the next job."""
    failpoints.set(stage, attempt=None, crash="SIGSEGV")
    body = {"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu", "variant": "attn_dynamic",
            "max_seq_len": {"validate": 72, "bench": 76}[stage]}
    posted = api.post("/exports", json=body).json()
    held = wait_for(api, posted["id"], lambda e: e["worker"], what="a claim")
    worker = pool.holding(held)
    children = worker.pool_children()
    failed = wait_done(api, posted["id"])
    assert failed["status"] == "failed" and failed["attempts"] == 1, failed["events"]
    what = {"validate": "validation of the fp16 attn_dynamic export", "bench": "the benchmark of the validated fp16"}[stage]
    assert what in failed["error"] and "died of SIGSEGV inside native code" in failed["error"], failed["error"]
    assert f"while the {stage} failpoint's planted crash" in failed["error"]
    assert not any("lost" in (e["message"] or "") for e in failed["events"])  # failed, never retried
    assert worker.alive() and worker.pool_children() == children  # neither the worker nor its pool process died
    failpoints.clear()
    body["max_seq_len"] += 100
    assert wait_done(api, api.post("/exports", json=body).json()["id"])["status"] == "ready"


def test_cancel_while_running(api, s3, pool, failpoints):
    failpoints.set("bench", attempt=1)
    posted = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu",
                                        "variant": "attn_dynamic", "max_seq_len": 100}).json()
    wait_for(api, posted["id"], lambda e: e["stage"] == "bench", what="bench")
    assert api.delete(f"/exports/{posted['id']}").status_code == 202
    export = wait_done(api, posted["id"], timeout=60)
    assert export["status"] == "cancelled" and keys_of_export(api, s3, posted["id"]) == []


def test_cancel_while_its_worker_is_dead(api, s3, pool, failpoints):
    failpoints.set("validate", attempt=1)
    posted = api.post("/exports", json={"model": "tiny-llama", "dtype": "fp32", "ep": "cpu",
                                        "variant": "attn_dynamic", "max_seq_len": 100}).json()
    held = wait_for(api, posted["id"], lambda e: e["stage"] == "validate" and e["worker"], what="validate")
    pool.holding(held).kill()
    cancelled = api.delete(f"/exports/{posted['id']}")
    assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"]
    export = wait_done(api, posted["id"], timeout=LEASE_S + 10)  # completes once the lease is seen gone
    pool.fill()
    assert export["status"] == "cancelled" and export["attempts"] == 1  # never handed to another worker
    assert keys_of_export(api, s3, posted["id"]) == []


def test_cancel_during_publish_leaves_store_and_catalog_agreeing(api, s3, pool, failpoints):
    failpoints.set("published", attempt=1, seconds=3)  # the manifest is in the store; the catalog is not told yet
    posted = api.post("/exports", json={"model": "tiny-llama", "dtype": "fp16", "ep": "cpu",
                                        "variant": "attn_dynamic", "max_seq_len": 100}).json()
    farm.until(lambda: [k for k in keys_of_export(api, s3, posted["id"]) if k.endswith("manifest.json")], bool, 120,
               "the manifest")
    assert api.delete(f"/exports/{posted['id']}").status_code == 202
    export = wait_done(api, posted["id"], timeout=60)
    assert export["status"] == "cancelled" and only_withdrawn_manifest(api, s3, posted["id"])
    assert api.get(f"/exports/{posted['id']}/artifacts").status_code == 409


def test_s3_unreachable_during_publish_then_back(api, s3, pool):
    s3.stop()
    try:
        posted = api.post("/exports", json={"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu",
                                            "variant": "attn_dynamic", "max_seq_len": 100}).json()
        wait_for(api, posted["id"], lambda e: e["stage"] == "publish", what="publish")
        time.sleep(2)
        assert get(api, posted["id"])["status"] == "running"  # not ready while unpublished
    finally:
        s3.start()
    export = wait_done(api, posted["id"])
    assert_published_once(api, s3, export)


def test_the_worker_liveness_probe_does_not_restart_workers_for_a_redis_outage():
    """`python -m services.health worker` (the chart's and compose's liveness check): with Redis up
    and no worker answering it fails; with Redis down it passes, saying why, since restarting every
    worker in an outage killed their running exports (the probe went through Redis)."""
    redis_server = farm.RedisServer()
    try:
        probe = [sys.executable, "-m", "services.health", "worker", "--timeout", "1"]
        env = {**os.environ, "REDIS_URL": redis_server.url}
        up = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
        assert up.returncode == 1 and "did not answer a ping" in up.stderr, up.stderr
        redis_server.stop()
        down = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and "broker unreachable" in down.stderr and "not restarting" in down.stderr
    finally:
        redis_server.close()
    # A broker that answers but refuses the password (rotated) is not an outage: a restart reads the new one.
    port = free_ports(1)[0]
    locked = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--requirepass", "rotated-password"], stdout=subprocess.DEVNULL)
    try:
        farm.until(lambda: _port_open(port), bool, 10, "the password-protected redis")
        stale = subprocess.run(probe, env={**os.environ, "REDIS_URL": f"redis://:old-password@127.0.0.1:{port}/0"},
                               capture_output=True, text=True, timeout=60)
        assert stale.returncode == 1 and "refused this worker's credentials" in stale.stderr, stale.stderr
    finally:
        locked.terminate()
        locked.wait(10)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
