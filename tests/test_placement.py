"""Jobs are sized before they run: the estimate, the API's refusal, and a worker that cannot hold a job."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from fastapi.testclient import TestClient

from exporter.errors import ExportError
from exporter.geometries import GEOMETRIES, write_geometry_config
from exporter.graph.architectures import ARCHITECTURES
from exporter.graph.config import load_model_config
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.resources import GiB, Capacity, estimate_resources, export_bytes
from services.api.app import create_app
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.models import Export, ExportEvent
from services.placement import place, queue_classes
from services.settings import Settings

ADMIN = "placement-admin-token-0123456789"


def _config(source):
    return load_model_config(source, ARCHITECTURES)


# Every dtype's layout: float weights, MatMulNBits with fp32 (cpu) or fp16 (cuda) scales, zero
# points, an int8 LM head, layers kept in float; a tied and an untied head; two ropes (gemma3).
@pytest.mark.parametrize("arch, dtype, ep, quant, tied", [
    ("llama", "fp32", "cpu", None, True),
    ("qwen2", "fp16", "cuda", None, False),
    ("gemma3_text", "bf16", "cuda", None, True),
    ("llama", "int4", "cpu", None, False),
    ("qwen3", "int4", "cuda", {"symmetric": False, "lm_head_bits": 8}, False),
    ("phi3", "int8", "cpu", {"keep": ["first_layer", "lm_head"]}, False),
    # Mixtures of experts: QMoE experts (int4 blocks, int8 a scale per row), float routers, a shared
    # expert and a dense layer (qwen2_moe), a layer kept in float (its experts stay a float MoE).
    ("qwen2_moe", "int4", "cpu", None, False),
    ("mixtral", "int8", "cuda", None, False),
    ("granitemoe", "fp16", "cuda", None, True),
    ("olmoe", "int4", "cuda", {"keep": ["first_layer"]}, False),
    # Hybrids: recurrent layers' projections (the DeltaNet gates' kept float), convolutions, Mamba2.
    ("qwen3_5_text", "fp32", "cpu", None, False),
    ("qwen3_next", "int4", "cpu", None, False),
    ("lfm2", "fp16", "cpu", None, True),
    ("granitemoehybrid", "int4", "cpu", None, False),
    ("nemotron_h", "int4", "cpu", None, False),
    ("nemotron_h", "fp16", "cpu", None, False),
    ("falcon_h1", "int4", "cpu", None, False),
])
def test_the_estimated_export_size_is_what_the_exporter_writes(checkpoint, tmp_path, arch, dtype, ep, quant, tied):
    # CUDA's QMoE takes experts 64 wide or wider (the tiny ones are 32)
    wide = {"intermediate_size": 64} if arch in ("mixtral", "olmoe") and ep == "cuda" else {}
    source = checkpoint(arch, tie_word_embeddings=tied, **wide)
    request = ExportRequest(model=str(source), dtype=dtype, ep=ep, quant=quant)
    out = export_model(request, tmp_path / "export", validate=False).out_dir
    written = (out / "model.onnx.data").stat().st_size
    predicted = export_bytes(_config(source), request)
    # Norms, biases and a few small constants are left out of the estimate (a visible share only
    # of a checkpoint this small: tests/test_scale's real geometries are within a fraction of a percent).
    assert abs(predicted - written) <= 0.02 * written + 4096, (predicted, written)


def test_a_long_rope_export_peaks_within_its_estimate(checkpoint, tmp_path):
    """2^20 positions of a 320-wide head: rope tables of 1.25 GiB from a 2 MiB checkpoint. The export
    holds them once, not beside the copies it made of them (angles and cosines before scaling, the
    graph's cast copy, the cache file's bytes in memory, whole-tensor copies queued for the writer:
    2.7 GiB against an estimate of 2.5 that had no term for the tables). Its peak, measured by the
    kernel (ru_maxrss of `exportfarm export`), is within the estimate, and the estimate within twice
    the peak."""
    import subprocess
    import sys

    source = checkpoint("llama", head_dim=320, max_position_embeddings=2**20)
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu")
    estimate = estimate_resources(_config(source), request)
    assert estimate.terms["disk"]["rope table cache"] == 2**20 * 160 * 2 * 4  # cos and sin, fp32
    log = tmp_path / "export.log"
    with log.open("w") as out:  # a fresh rope cache: the tables are computed and kept, as on a first export
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "export", "--model", str(source), "--out",
                                 str(tmp_path / "out"), "--no-validate"],
                                env={**os.environ, "EXPORTFARM_CACHE": str(tmp_path / "cache")}, stdout=out, stderr=out)
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak, not other children's
    assert os.waitstatus_to_exitcode(status) == 0, log.read_text()[-2000:]
    peak = usage.ru_maxrss * 1024
    assert peak <= estimate.host_bytes <= 2 * peak, (peak / GiB, estimate.to_dict())


def _geometry(tmp_path, name, layers=None):
    return _config(write_geometry_config(name, tmp_path / name, layers))


def test_experts_dominate_an_moe_model_s_bytes(tmp_path):
    """Qwen3-30B-A3B: 30.5B parameters, 29B of them in the 48 layers' 128 experts; Mixtral-8x7B 46.7B;
    Phi-3.5-MoE 41.9B (the published sizes)."""
    from exporter.resources import Geometry

    # Dense ones beside them: Llama-3.2-1B 1.24B (its LM head tied to the embedding), Llama-3.1-8B 8.03B.
    assert abs(Geometry.of(_geometry(tmp_path, "llama-3.2-1b")).parameters / 1e9 - 1.24) < 0.01
    assert abs(Geometry.of(_geometry(tmp_path, "llama-3.1-8b")).parameters / 1e9 - 8.03) < 0.01
    assert abs(Geometry.of(_geometry(tmp_path, "qwen3-30b-a3b")).parameters / 1e9 - 30.5) < 0.2
    assert abs(Geometry.of(_geometry(tmp_path, "mixtral-8x7b")).parameters / 1e9 - 46.7) < 0.2
    assert abs(Geometry.of(_geometry(tmp_path, "phi-3.5-moe")).parameters / 1e9 - 41.9) < 0.1
    fp16 = estimate_resources(_geometry(tmp_path, "qwen3-30b-a3b"), ExportRequest(model="m", dtype="fp16", ep="cuda"))
    int4 = estimate_resources(_geometry(tmp_path, "qwen3-30b-a3b"), ExportRequest(model="m", dtype="int4", ep="cuda"))
    assert 56 * GiB < fp16.export_bytes < 58 * GiB and int4.export_bytes < 0.3 * fp16.export_bytes


def test_an_8b_fp16_cpu_job_needs_more_than_a_24_gib_worker_and_names_why(tmp_path):
    config = _geometry(tmp_path, "llama-3.1-8b")
    request = ExportRequest(model="m", dtype="fp16", ep="cpu")
    estimate = estimate_resources(config, request)
    # The CPU EP's fp32 copies of every fp16 weight: 4 bytes a parameter.
    assert estimate.terms["host"]["export's session"] == pytest.approx(8.03e9 * 4, rel=0.01)
    (short,) = estimate.shortfalls(Capacity("this worker", 24 * GiB, None, 500 * GiB))
    assert short.startswith(f"{estimate.host_bytes / GiB:.1f} GiB host memory (export's session 29.9")
    assert short.endswith("this worker has 24.0 GiB")
    # The same model in int4 fits; on a GPU worker the session holds its weights on the device.
    assert not estimate_resources(config, ExportRequest(model="m", dtype="int4", ep="cpu")).shortfalls(
        Capacity("this worker", 24 * GiB, None, 500 * GiB))
    cuda = estimate_resources(config, ExportRequest(model="m", dtype="fp16", ep="cuda"))
    assert cuda.host_bytes < 8 * GiB and 16 * GiB < cuda.gpu_bytes < 19 * GiB


def test_the_streamed_reference_keeps_validation_memory_flat_in_depth(tmp_path):
    """What validation holds on the host grows with the layers by the host side of the export's
    CUDA session only: the reference holds one layer at a time."""
    request = ExportRequest(model="m", dtype="int4", ep="cuda")
    estimates = [estimate_resources(_geometry(tmp_path / str(n), "llama-3.3-70b", n), request) for n in (1, 4, 80)]
    growth = estimates[2].host_bytes - estimates[0].host_bytes
    assert 0 <= growth <= 0.1 * (estimates[2].export_bytes - estimates[0].export_bytes)
    assert estimates[2].host_bytes < 32 * GiB
    fp16 = estimate_resources(_geometry(tmp_path, "llama-3.3-70b"), ExportRequest(model="m", dtype="fp16", ep="cuda"))
    assert fp16.shortfalls(Capacity("an H200", 126 * GiB, 139 * GiB, 1000 * GiB))[0].startswith("141")


def test_placement_takes_the_smallest_class_that_holds_the_job(tmp_path):
    classes = {"gpu": {"ep": "cuda", "memory_gb": 64, "gpu_memory_gb": 48, "disk_gb": 200},
               "gpu-large": {"ep": "cuda", "memory_gb": 256, "gpu_memory_gb": 141, "disk_gb": 1000},
               "cpu": {"ep": "cpu", "memory_gb": 24, "disk_gb": 100}}
    settings = Settings(data_dir=tmp_path / "data", database_url="sqlite://", queue_classes=classes)
    assert [c.name for c in queue_classes(settings)] == ["gpu", "gpu-large", "cpu"]
    small, mid, big = (_geometry(tmp_path, name) for name in ("llama-3.1-8b", "qwen2.5-32b", "llama-3.3-70b"))
    fp16 = ExportRequest(model="m", dtype="fp16", ep="cuda")
    assert place(settings, fp16, estimate_resources(small, fp16)) == "gpu"
    assert place(settings, fp16, estimate_resources(mid, fp16)) == "gpu-large"  # 66 GiB of GPU memory
    int4 = ExportRequest(model="m", dtype="int4", ep="cuda")
    assert place(settings, int4, estimate_resources(big, int4)) == "gpu"
    with pytest.raises(ExportError, match=r"needs 141\.\d GiB GPU memory .*worker class gpu-large has 141\.0 GiB; "
                                          "no worker class can run it"):
        place(settings, fp16, estimate_resources(big, fp16))
    cpu = ExportRequest(model="m", dtype="fp16", ep="cpu")
    with pytest.raises(ExportError, match=r"host memory \(export's session 29\.9.*worker class cpu has 24\.0"):
        place(settings, cpu, estimate_resources(small, cpu))
    assert place(settings, cpu, None) == "cpu"  # a hub model: its worker checks


@pytest.fixture
def sized_api(tmp_path, checkpoint):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny").symlink_to(checkpoint("llama"))
    # A real geometry's config beside the tiny checkpoint's weights: the estimate reads config.json.
    big = write_geometry_config("llama-3.1-8b", models / "big-8b")
    (big / "model.safetensors").symlink_to(checkpoint("llama") / "model.safetensors")
    settings = Settings(data_dir=tmp_path / "data", models_dir=models, admin_token=ADMIN,
                        queue_classes={"cpu": {"ep": "cpu", "memory_gb": 10, "disk_gb": 100},
                                       "cpu-large": {"ep": "cpu", "memory_gb": 24, "disk_gb": 100}})
    upgrade_schema(settings.catalog_url)
    client = TestClient(create_app(settings))
    client.headers["Authorization"] = f"Bearer {ADMIN}"
    client.settings = settings
    return client


def test_the_api_refuses_what_no_worker_class_can_run_with_the_figures(sized_api):
    response = sized_api.post("/exports", json={"model": "big-8b", "dtype": "fp16", "ep": "cpu"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert re.match(r"big-8b fp16 on cpu needs 3\d\.\d GiB host memory \(export's session 29\.9", detail), detail
    assert "worker class cpu-large has 24.0 GiB" in detail and "export it in int4 / int8" in detail
    placed = sized_api.post("/exports", json={"model": "big-8b", "dtype": "int8", "ep": "cpu"})
    assert placed.status_code == 202, placed.text
    assert placed.json()["queue"] == "cpu-large" and 10 < placed.json()["estimate"]["host_gib"] < 24
    assert sized_api.post("/exports", json={"model": "big-8b", "dtype": "int4", "ep": "cpu"}).json()["queue"] == "cpu"
    tiny = sized_api.post("/exports", json={"model": "tiny", "dtype": "fp32", "ep": "cpu"}).json()
    assert tiny["queue"] == "cpu" and tiny["estimate"]["host_gib"] < 4
    classes = sized_api.get("/workers").json()["queue_classes"]
    assert classes["cpu-large"] == {"ep": "cpu", "holder": "worker class cpu-large", "host_gib": 24.0,
                                    "gpu_gib": None, "disk_gib": 100.0}


def test_a_worker_that_cannot_hold_a_job_never_starts_it(sized_api):
    """Forced to 0.2 GiB, the cpu worker hands the job to cpu-large before any attempt. A cpu-large
    worker with as little room leaves it to one of its class with room (the class is sized to hold
    it), and that one runs it."""
    from workers.job import WorkerIdentity, run_export_job

    settings = sized_api.settings
    export = sized_api.post("/exports", json={"model": "tiny", "dtype": "int8", "ep": "cpu"}).json()
    small = settings.model_copy(update={"worker_memory_gb": 0.2, "worker_queues": "cpu"})
    assert run_export_job(small, export["id"], WorkerIdentity("small", 1)) == "rerouted"
    with session_scope(settings.catalog_url) as session:
        row = session.get(Export, export["id"])
        assert (row.status.value, row.queue, row.attempts, row.dispatched_at) == ("queued", "cpu-large", 0, None)
        event = session.query(ExportEvent).filter_by(export_id=row.id).order_by(ExportEvent.id.desc()).first()
        assert "sent to worker class cpu-large" in event.message and "this worker has 0.2 GiB" in event.message
    # A message sent before the hand-over, read by a worker of the old class, changes nothing.
    assert run_export_job(small, export["id"], WorkerIdentity("small", 1)) == \
        "skipped: it is placed on worker class cpu-large"
    crowded = settings.model_copy(update={"worker_memory_gb": 0.2, "worker_queues": "cpu-large"})
    for _ in range(2):  # said once in the audit trail, however often its message comes back
        assert run_export_job(crowded, export["id"], WorkerIdentity("crowded", 2)) == "deferred"
    events = sized_api.get(f"/exports/{export['id']}").json()["events"]
    assert sum("waiting for a worker with room" in (e["message"] or "") for e in events) == 1
    roomy = settings.model_copy(update={"worker_queues": "cpu-large"})
    assert run_export_job(roomy, export["id"], WorkerIdentity("roomy", 3)) in ("ready", "quarantined")
    got = sized_api.get(f"/exports/{export['id']}").json()
    assert got["worker"] == "roomy" and got["attempts"] == 1


def test_a_job_no_worker_class_can_hold_fails_once_with_the_figures(sized_api):
    """Unsized classes (QUEUE_CLASSES left out): the worker's own measure is the only one, so a job
    it cannot hold, with no other class to go to, fails before any attempt, with the figures."""
    from workers.job import WorkerIdentity, run_export_job

    settings = sized_api.settings
    export = sized_api.post("/exports", json={"model": "tiny", "dtype": "fp16", "ep": "cpu", "force": True}).json()
    unsized = settings.model_copy(update={"worker_memory_gb": 0.2, "worker_queues": "cpu",
                                          "queue_classes": {"cpu": {"ep": "cpu"}}})
    assert run_export_job(unsized, export["id"], WorkerIdentity("small", 1)) == "refused"
    got = sized_api.get(f"/exports/{export['id']}").json()
    assert got["status"] == "failed" and got["attempts"] == 0 and got["lost_reason"] is None
    assert re.match(r"tiny fp16 on cpu needs \d+\.\d GiB host memory \(.*\), this worker has 0\.2 GiB; "
                    r"no other worker class can hold it: export it in int4 / int8", got["error"]), got["error"]
    # Once: a redelivered message finds nothing to do.
    assert run_export_job(unsized, export["id"], WorkerIdentity("small", 1)).startswith("skipped")


def test_queue_classes_are_checked_when_the_settings_load():
    for bad, words in (({"gpu": {"ep": "tpu"}}, "ep"), ({"gpu": {"ep": "cuda", "memory_gb": -1}}, "positive"),
                       ({"gpu": {"ep": "cuda", "ram": 4}}, "ram"), ({"g pu": {"ep": "cuda"}}, "name")):
        with pytest.raises(ValueError, match=words):
            Settings(queue_classes=bad)
    assert json.dumps(GEOMETRIES)  # the geometries stay plain config.json


@pytest.mark.parametrize("classes", [{}, {"queue_classes": {"cpu": {"ep": "cpu"}}}], ids=["embedded", "unsized"])
def test_a_job_that_fits_once_the_caches_are_trimmed_is_claimed_and_runs(small_filesystem, checkpoint, tmp_path,
                                                                         classes):
    """A disk mostly taken by reference runs of earlier jobs, used hours ago and beyond CACHE_MAX_GB:
    the job's resolve stage deletes them before the job writes anything, so the worker counts that
    space as free and claims the job. Counted as used, the job waited forever for a worker of its
    class with room (embedded: the class is sized as this machine), or was refused (unsized classes)."""
    from workers.job import WorkerIdentity, run_export_job

    disk = small_filesystem("96m")
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny").symlink_to(checkpoint("llama"))
    settings = Settings(data_dir=disk / "data", models_dir=models, admin_token=ADMIN, cache_max_gb=1 / 1024,
                        bench_contexts=[16], bench_steps=4, **classes)
    upgrade_schema(settings.catalog_url)
    client = TestClient(create_app(settings))
    client.headers["Authorization"] = f"Bearer {ADMIN}"
    export = client.post("/exports", json={"model": "tiny", "dtype": "fp32", "ep": "cpu"}).json()
    need = estimate_resources(_config(models / "tiny"), ExportRequest(model="tiny", dtype="fp32", ep="cpu"),
                              local_store=True).disk_bytes
    free = shutil.disk_usage(disk).free
    assert free > need + (1 << 20) * 4, (free, need)  # room once the cache is within its 1 MiB
    references, stale = settings.data_dir / "references", time.time() - 3 * 3600
    references.mkdir(parents=True)
    for i in range(8):  # leave half the job's need free
        run = references / f"run-{i}.npz"
        run.write_bytes(bytes((free - need // 2) // 8))
        os.utime(run, (stale, stale))
    assert shutil.disk_usage(disk).free < need

    assert run_export_job(settings, export["id"], WorkerIdentity("worker", os.getpid())) in ("ready", "quarantined")
    got = client.get(f"/exports/{export['id']}").json()
    assert got["attempts"] == 1 and got["worker"] == "worker", got["error"]
    assert not [p.name for p in references.iterdir() if p.name.startswith("run-")]  # trimmed by its resolve stage


# --- real worker processes on Redis and PostgreSQL ---------------------------------------------------


@pytest.fixture(scope="module")
def sized_farm(tmp_path_factory, checkpoint):
    """A farm of two worker classes (cpu 12 GiB, cpu-large 24 GiB): a cpu worker that measures
    0.2 GiB of memory (forced in its settings) and a cpu-large one, and beat's sweeper."""
    from tests import farm
    from tests.services_fixtures import farm_api, fresh_postgres_database

    logs, models = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("models")
    (models / "tiny").symlink_to(checkpoint("llama"))
    redis_server = farm.RedisServer()
    with fresh_postgres_database() as database_url:
        env = {"DATABASE_URL": database_url, "REDIS_URL": redis_server.url, "MODELS_DIR": str(models),
               "DATA_DIR": str(tmp_path_factory.mktemp("data")), "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
               "SIGNING_SECRET": "placement-signing-secret-0123456789abcdef",
               "QUEUE_CLASSES": json.dumps({"cpu": {"ep": "cpu", "memory_gb": 12, "disk_gb": 100},
                                            "cpu-large": {"ep": "cpu", "memory_gb": 24, "disk_gb": 100}}),
               "HEARTBEAT_S": "0.5", "LEASE_S": "5", "SWEEP_INTERVAL_S": "0.5", "REDISPATCH_S": "3",
               "WORKER_REPORT_S": "1", "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4"}
        with farm_api(env, ADMIN) as client:
            processes = {"small": farm.worker(env, "small", logs, queues="cpu", WORKER_MEMORY_GB="0.2"),
                         "beat": farm.beat(env, logs)}
            client.env, client.logs, client.processes = env, logs, processes
            try:
                yield client
            finally:
                for process in processes.values():
                    process.stop()
                redis_server.close()


def test_a_real_worker_hands_a_job_it_cannot_hold_to_a_class_that_can(sized_farm):
    from tests import farm

    export = sized_farm.post("/exports", json={"model": "tiny", "dtype": "fp32", "ep": "cpu"}).json()
    assert export["queue"] == "cpu"
    moved = farm.until(lambda: sized_farm.get(f"/exports/{export['id']}").json(), lambda e: e["queue"] == "cpu-large",
                       60, "the small worker to hand the job on")
    assert moved["status"] == "queued" and moved["attempts"] == 0 and moved["worker"] is None, moved["error"]
    # A cpu-large worker comes up: the sweeper has sent the job to its queue; it runs it.
    sized_farm.processes["large"] = farm.worker(sized_farm.env, "large", sized_farm.logs, queues="cpu-large")
    done = farm.until(lambda: sized_farm.get(f"/exports/{export['id']}").json(),
                      lambda e: e["status"] in ("ready", "failed", "quarantined"), 240, "the export to finish")
    assert done["status"] == "ready", done["error"]
    assert done["worker"] == "large" and done["attempts"] == 1 and done["lost_reason"] is None
    assert sized_farm.processes["small"].alive()
    messages = [e["message"] or "" for e in sized_farm.get(f"/exports/{export['id']}").json()["events"]]
    assert any("sent to worker class cpu-large" in m and "this worker has 0.2" in m for m in messages)


def test_two_workers_bound_to_one_gpu_are_refused_and_each_reports_its_device(sized_farm, tmp_path):
    """One worker per GPU: the binding is the worker's (its name, its catalog row, every session's
    device), and a second worker bound to the same device on the host stops at start."""
    from services.catalog.models import Worker
    from tests import farm

    env = {**sized_farm.env, "EXPORTFARM_LOCK_DIR": str(tmp_path)}
    gpu3 = farm.FarmProcess([*_worker_argv(), "--gpu", "3"], env, sized_farm.logs / "gpu3.log")
    gpu4 = farm.FarmProcess([*_worker_argv(), "--gpu", "4"], env, sized_farm.logs / "gpu4.log")
    try:
        def rows():
            with session_scope(sized_farm.settings.catalog_url) as session:
                return {w.hostname.rsplit("-", 1)[-1]: w.gpu_device for w in session.query(Worker).all()
                        if w.gpu_device is not None}

        assert farm.until(rows, lambda r: r.get("gpu3") == 3 and r.get("gpu4") == 4, 90, "both workers to report")
        again = farm.FarmProcess([*_worker_argv(), "--gpu", "3"], env, sized_farm.logs / "gpu3-again.log")
        assert again.proc.wait(timeout=90) != 0
        assert "GPU 3 (index-3) is already bound to pid" in again.log_text() and "one worker per GPU" in again.log_text()
        assert gpu3.alive() and gpu4.alive()
    finally:
        gpu3.stop()
        gpu4.stop()


def _worker_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "services.cli", "worker", "--queues", "cpu", "--loglevel", "INFO"]


@pytest.mark.parametrize("family, language_model", [("gemma3", "gemma3_text"), ("qwen3_5", "qwen3_5_text")])
def test_an_image_text_job_is_sized_with_its_whole_fp32_reference_on_the_host(family, language_model, tmp_path):
    """An image-text export's validation (and a quantized cuda request's activation measurement) holds transformers'
    whole image-text model in fp32 on the host, its tower included, not the streamed reference's one layer: the
    estimate counts 4 bytes for every parameter of the model transformers builds, on the host, also where torch
    would run the streamed reference on the GPU, in every dtype (a bf16 Qwen3.5 request is its image-text export too);
    a text checkpoint of its language model is not sized so."""
    import torch
    import transformers

    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
    from services.placement import job_estimate
    from services.sources import locate_model

    models = tmp_path / "models"
    source_dir = make_tiny_vlm_checkpoint(family, models / "vlm")
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(source_dir), dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    settings = Settings(data_dir=tmp_path / "data", models_dir=models)
    source = locate_model(settings, "vlm")
    term = "reference (whole image-text model, fp32)"
    for dtype, ep in (("fp32", "cpu"), ("bf16", "cuda"), ("int4", "cuda")):
        request = ExportRequest(model="vlm", dtype=dtype, ep=ep)
        estimate = job_estimate(settings, request, source, reference_on_gpu=ep == "cuda")
        host = estimate.terms["host"]  # the peak stage's terms: validation's, on a checkpoint this small
        assert host.get(term) == 4 * parameters, estimate.to_dict()
        assert estimate.host_bytes >= 4 * parameters and term not in estimate.terms["gpu"]
        assert "reference layer (fp32)" not in str(estimate.to_dict())
    make_tiny_checkpoint(language_model, models / "text")
    text = job_estimate(settings, ExportRequest(model="text", dtype="bf16", ep="cuda"), locate_model(settings, "text"))
    assert term not in str(text.to_dict()) and "reference layer (fp32)" in str(text.to_dict())
