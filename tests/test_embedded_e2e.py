"""Embedded mode under faults: a real ``exportfarm serve`` (no settings but a data directory) over HTTP.

serve runs the sweeper and supervises its worker. The worker is SIGKILLed in each stage, with serve
kept running (its supervisor restarts the worker) and with serve killed too (the whole host dies,
and a new serve starts); serve is also stopped mid-job. Every export must end ready exactly once,
every artifact intact, and an identical request must return it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import time

import httpx
import pytest

from tests import farm
from tests.s3_server import free_ports

ADMIN = "embedded-admin-token-0123456789ab"
LEASE_S = 3.0
STAGES = ["resolve", "build", "validate", "bench", "upload"]
BODIES = {  # each scenario its own request; identical requests would share one export
    ("supervised", "resolve"): {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu"},
    ("supervised", "build"): {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu"},
    ("supervised", "validate"): {"model": "tiny-llama", "dtype": "fp16", "ep": "cpu"},
    ("supervised", "bench"): {"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu"},
    ("supervised", "upload"): {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu", "variant": "gqa"},
    ("crash", "resolve"): {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "variant": "gqa"},
    ("crash", "build"): {"model": "tiny-llama", "dtype": "fp16", "ep": "cpu", "variant": "gqa"},
    ("crash", "validate"): {"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu", "variant": "gqa"},
    ("crash", "bench"): {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu", "static_cache": True, "max_seq_len": 64},
    ("crash", "upload"): {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "static_cache": True, "max_seq_len": 64},
    ("stop", "validate"): {"model": "tiny-llama", "dtype": "fp16", "ep": "cpu", "static_cache": True, "max_seq_len": 64},
}


class Embedded:
    """One data directory, and the serve process currently running on it."""

    def __init__(self, root, checkpoint):
        self.root = root
        models = root / "models"
        models.mkdir()
        for arch in ("llama", "qwen2", "qwen3_5_text", "lfm2"):
            (models / f"tiny-{arch}").symlink_to(checkpoint(arch))
        from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

        make_tiny_vlm_checkpoint("gemma3", models / "tiny-gemma3-vlm")  # an image-text checkpoint
        self.logs = root / "logs"
        self.logs.mkdir()
        self.failpoints = farm.Failpoints(root / "failpoints.json")
        self.data = root / "data"
        self.env = {
            "DATA_DIR": str(self.data), "MODELS_DIR": str(models), "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
            "HEARTBEAT_S": "0.5", "LEASE_S": str(LEASE_S), "SWEEP_INTERVAL_S": "0.5", "REDISPATCH_S": "3",
            "WORKER_REPORT_S": "1", "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4", "SHUTDOWN_GRACE_S": "3",
            "EXPORTFARM_FAILPOINTS": str(self.failpoints.path),
            # embedded: no external server, whatever the environment running the tests says
            "DATABASE_URL": "", "REDIS_URL": "", "S3_ENDPOINT_URL": "",
        }
        self.port = free_ports(1)[0]
        self.serve: farm.FarmProcess | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.serve = farm.serve(self.env, self.port, self.logs, name=f"serve-{self.starts}")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers={"Authorization": f"Bearer {ADMIN}"},
                                 timeout=30)
        farm.until(self._healthy, bool, 60, "serve to answer")

    def _healthy(self) -> bool:
        assert self.serve.alive(), self.serve.log_text()[-3000:]
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def export(self, export_id: str) -> dict:
        return self.http.get(f"/exports/{export_id}").json()

    def wait(self, export_id, predicate, timeout=180, what="condition") -> dict:
        return farm.until(lambda: self.export(export_id), predicate, timeout, what)

    def worker_pid(self, export_id: str) -> int:
        with sqlite3.connect(self.data / "catalog.db") as db:
            return db.execute("SELECT worker_pid FROM exports WHERE id = ?", (export_id,)).fetchone()[0]

    def row(self, export_id: str) -> dict:
        with sqlite3.connect(self.data / "catalog.db") as db:
            db.row_factory = sqlite3.Row
            return dict(db.execute("SELECT * FROM exports WHERE id = ?", (export_id,)).fetchone())

    def close(self) -> None:
        if self.serve is not None:
            self.serve.stop()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, checkpoint):
    farm_ = Embedded(tmp_path_factory.mktemp("embedded"), checkpoint)
    farm_.start()
    yield farm_
    farm_.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def in_stage(embedded: Embedded, export_id: str, stage: str) -> dict:
    catalog_stage = "publish" if stage == "upload" else stage
    held = embedded.wait(export_id, lambda e: e["status"] == "running" and e["stage"] == catalog_stage,
                         what=f"stage {stage}")
    if stage == "upload":  # paused after the weights went up: wait for them to be in the store
        farm.until(lambda: list((embedded.data / "store" / "objects").rglob(f"{export_id}/model.onnx.data")), bool, 60,
                   "the first upload")
    return held


def assert_ready_once(embedded: Embedded, export: dict, body: dict, killed_in: str) -> None:
    assert export["status"] == "ready", export["error"]
    assert [e["to_status"] for e in export["events"]].count("ready") == 1
    assert export["attempts"] == 2 and any("attempt 1 lost" in (e["message"] or "") for e in export["events"])
    links = embedded.http.get(f"/exports/{export['id']}/artifacts").json()["files"]
    manifest = httpx.get(links["manifest.json"]["url"], timeout=30).json()
    assert manifest["status"] == "ready" and manifest["export_id"] == export["id"]
    assert manifest["cache_key"] == export["cache_key"]
    assert set(links) == set(manifest["files"]) | {"manifest.json"}
    for name, entry in manifest["files"].items():
        data = httpx.get(links[name]["url"], timeout=30).content
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["size"], name
    store = embedded.data / "store" / "objects"
    assert len(list(store.rglob(f"{export['id']}/manifest.json"))) == 1  # published once, in one place
    again = embedded.http.post("/exports", json=body)
    assert again.status_code == 200 and again.json()["id"] == export["id"]
    # The same worker name resumes from its checkpoints: a build that had finished is not redone.
    restart = next(i for i, e in enumerate(export["events"]) if (e["message"] or "").startswith("attempt 2 started"))
    second_stages = {e["stage"] for e in export["events"][restart:]}
    if killed_in in ("validate", "bench", "upload"):
        assert not second_stages & {"build", "fold", "package"}, second_stages
    else:
        assert "build" in second_stages


@pytest.mark.parametrize("model, recurrent", [("tiny-qwen3_5_text", "past_recurrent.%d"), ("tiny-lfm2", None)])
def test_a_hybrid_model_runs_through_the_farm_to_ready_with_its_states_packaged(embedded, model, recurrent):
    """A model with recurrent layers over the REST API like any other: built, validated (the structure
    gate counting its fused recurrences, parity, the genai gate), benched and published; its genai
    package names the states it carries."""
    posted = embedded.http.post("/exports", json={"model": model, "dtype": "fp16", "ep": "cpu", "variant": "gqa"})
    assert posted.status_code == 202, posted.text
    export = embedded.wait(posted.json()["id"], lambda e: e["status"] in ("ready", "failed", "cancelled", "quarantined"),
                           what="the export to end")
    assert export["status"] == "ready", export["error"]
    links = embedded.http.get(f"/exports/{export['id']}/artifacts").json()["files"]
    report = httpx.get(links["parity_report.json"]["url"], timeout=30).json()
    checks = {g["check"]: g for g in report["gates"]}
    assert checks["one fused recurrence per recurrent layer"]["passed"]
    decoder = httpx.get(links["genai_config.json"]["url"], timeout=30).json()["model"]["decoder"]
    assert decoder["inputs"]["past_conv_names"] == "past_conv.%d"
    assert decoder["inputs"].get("past_recurrent_names") == recurrent


def test_an_image_text_model_runs_through_the_farm_to_ready_with_its_three_graphs(embedded):
    """An image-text checkpoint over the REST API like any other: its vision, embedding and decoder graphs built,
    validated end to end against transformers per component, benched with its image costs, all published."""
    posted = embedded.http.post("/exports", json={"model": "tiny-gemma3-vlm", "dtype": "fp32", "ep": "cpu",
                                                  "variant": "gqa"})
    assert posted.status_code == 202, posted.text
    export = embedded.wait(posted.json()["id"], lambda e: e["status"] in ("ready", "failed", "cancelled", "quarantined"),
                           what="the export to end")
    assert export["status"] == "ready", export["error"]
    links = embedded.http.get(f"/exports/{export['id']}/artifacts").json()["files"]
    manifest = httpx.get(links["manifest.json"]["url"], timeout=30).json()
    assert manifest["image_text"]["run"] == ["vision", "embedding", "decoder"]
    assert {"vision.onnx", "embedding.onnx", "model.onnx"} <= set(links)
    report = httpx.get(links["parity_report.json"]["url"], timeout=30).json()
    assert {"vision", "embedding", "end_to_end"} <= set(report["components"])
    assert all(s["greedy_equal"] for s in report["components"]["end_to_end"])
    bench = httpx.get(links["benchmark.json"]["url"], timeout=30).json()
    assert bench["image"]["encode_ms_median"] > 0
    # its page shows the components in the order they run and each one's figures against transformers
    with httpx.Client(base_url=f"http://127.0.0.1:{embedded.port}", timeout=30) as browser:
        assert browser.post("/ui/login", data={"token": ADMIN}).status_code in (200, 303)
        page = browser.get(f"/ui/exports/{export['id']}").text
    assert "gemma3: vision (<span class=\"mono\">vision.onnx</span>) → embedding" in page
    assert page.count("<td>vision features</td>") == len(report["components"]["vision"])


@pytest.mark.parametrize("stage", STAGES)
def test_killed_worker_is_restarted_by_serve_and_the_export_ends_ready_once(embedded, stage):
    body = BODIES[("supervised", stage)]
    embedded.failpoints.set(stage, attempt=1)
    posted = embedded.http.post("/exports", json=body)
    assert posted.status_code == 202, posted.text
    export_id = posted.json()["id"]
    in_stage(embedded, export_id, stage)
    pid = embedded.worker_pid(export_id)
    os.killpg(pid, signal.SIGKILL)  # the worker and its pool process
    embedded.failpoints.clear()
    export = embedded.wait(export_id, lambda e: e["status"] in ("ready", "failed", "cancelled", "quarantined"),
                           what="the export to end")
    assert_ready_once(embedded, export, body, stage)
    assert "killed by SIGKILL" in export["lost_reason"]  # the supervisor saw how its worker died
    assert embedded.serve.alive()


@pytest.mark.parametrize("stage", STAGES)
def test_the_whole_farm_killed_then_serve_started_again_ends_ready_once(embedded, stage):
    body = BODIES[("crash", stage)]
    embedded.failpoints.set(stage, attempt=1)
    export_id = embedded.http.post("/exports", json=body).json()["id"]
    in_stage(embedded, export_id, stage)
    worker = embedded.worker_pid(export_id)
    embedded.serve.kill()  # serve's group; its worker dies with it (PR_SET_PDEATHSIG)
    farm.until(lambda: alive(worker), lambda up: not up, 10, "the worker to die with serve")
    assert embedded.row(export_id)["status"].lower() == "running"  # what a crash leaves behind
    embedded.failpoints.clear()
    embedded.start()
    export = embedded.wait(export_id, lambda e: e["status"] in ("ready", "failed", "cancelled", "quarantined"),
                           what="the export to end")
    assert_ready_once(embedded, export, body, stage)


def test_stopping_serve_mid_job_stops_its_worker_and_the_job_resumes_on_the_next_start(embedded):
    body = BODIES[("stop", "validate")]
    embedded.failpoints.set("validate", attempt=1)
    export_id = embedded.http.post("/exports", json=body).json()["id"]
    in_stage(embedded, export_id, "validate")
    worker = embedded.worker_pid(export_id)
    started = time.monotonic()
    embedded.serve.signal(signal.SIGTERM)
    embedded.serve.proc.wait(timeout=20)
    assert time.monotonic() - started < 12  # within SHUTDOWN_GRACE_S and a few seconds
    assert not alive(worker)  # no orphan
    row = embedded.row(export_id)
    assert row["status"].lower() == "queued" and row["lost_attempts"] == 0  # handed back, not counted as lost
    embedded.failpoints.clear()
    embedded.start()
    export = embedded.wait(export_id, lambda e: e["status"] in ("ready", "failed", "cancelled", "quarantined"),
                           what="the export to end")
    assert export["status"] == "ready" and export["attempts"] == 2
    assert any("handed back" in (e["message"] or "") for e in export["events"])


def test_a_second_serve_on_the_same_data_directory_is_refused(embedded):
    second = farm.serve(embedded.env, free_ports(1)[0], embedded.logs, name="second-serve")
    assert second.proc.wait(timeout=60) != 0
    assert "another exportfarm serve" in second.log_text() and str(embedded.data) in second.log_text()
