"""Fault injection on a real farm: randomized trials per mode; every job must end ready exactly once.

What runs
---------
* ``embedded``: one ``exportfarm serve`` with nothing configured but a data directory (SQLite
  catalog, filesystem queue, local store); serve supervises its worker and runs the sweeper.
* ``redis``: a deployment on loopback, every part a real server of its own started here: PostgreSQL
  (a private cluster), Redis (keeps nothing on disk), SeaweedFS S3, ``exportfarm serve`` (API only),
  ``exportfarm beat`` (the sweeper) and two ``exportfarm worker`` processes.

Each trial submits a new export of a small random-weight checkpoint over the REST API, holds it in a
random stage with a failpoint (workers/failpoints.py: the job waits there, lease renewed, until the
fault hits), injects one fault, heals it, and waits for the export to end:

* ``worker-sigkill``: SIGKILL to the holding worker's process group (worker and pool process).
  Redis mode starts a replacement worker; embedded mode relies on serve's supervisor.
* ``worker-sigstop``: SIGSTOP to the holding worker for the lease plus 1-3 s, then SIGCONT: the
  stopped attempt must write nothing more.
* ``farm-crash`` (embedded): SIGKILL to serve and its worker together, then a new serve.
* ``redis-restart``: Redis killed and started again empty after 1-3 s (every message lost).
* ``postgres-restart``: ``pg_ctl restart -m fast`` (every connection cut).
* ``s3-outage``: SeaweedFS stopped for 3-8 s while the export publishes.
* ``s3-sigstop``: mid-publish, SeaweedFS and the holding worker are both SIGSTOPped (the worker cut
  off from the catalog and the store, a request of its own in flight); S3 is resumed once the lease
  has expired, so the takeover attempt publishes while the stopped one's request lands late; the
  stopped worker is resumed last and must write nothing more.
* ``clock-skew``: the workers run under libfaketime with their wall clocks 90 s ahead and 90 s
  behind; the job is held in a stage for twice the lease. Leases are stamped and judged on the
  database's clock, so it must finish in its first attempt.
* ``cancel``: a cancel requested while the job is held in a random stage (resolve ... upload), or
  just after its worker was killed having published its manifest but not recorded it (the sweeper
  adopts such a manifest: the cancel races the adopt).

Every ended export is checked against the store: a ready one's catalog row lists the same files and
sha256 as the published manifest and the served bytes; a cancelled or failed one has no manifest
that is not withdrawn.

A trial counts as *completed exactly once* when the export ends ``ready`` (``cancelled`` where a
cancel won the race) with one terminal event, its
published manifest lists files whose sha256 match what the store serves, no other export id is
published under its prefix, and the store does not change afterwards (a stale attempt writing late
would). ``lost``: it ended anything but ready; ``stuck``: not ended within the timeout;
``duplicated``: published twice or written after ready. ``recovery_s`` runs from the fault to the
end of the export (so it includes the stop or outage this benchmark chose), ``takeover_s`` from the
fault to the start of the attempt that finished (trials where a new attempt was needed).

Usage::

    python benchmarks/faults.py [--trials 20] [--modes embedded,redis] [--faults a,b] [--per-fault]
                                [--seed 7] [--out benchmarks/results/faults.json]

``--per-fault`` runs ``--trials`` trials of every fault (else ``--trials`` in all, faults taken in turn).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from tests import farm  # noqa: E402
from tests.s3_server import SeaweedS3, free_ports  # noqa: E402

ADMIN = "faults-admin-token-0123456789abcdef"
LEASE_S = 3.0
STAGES = ["resolve", "build", "validate", "bench", "upload"]
FAULTS = {
    "embedded": ["worker-sigkill", "worker-sigstop", "farm-crash"],
    "redis": ["worker-sigkill", "worker-sigstop", "redis-restart", "postgres-restart", "s3-outage", "s3-sigstop",
              "clock-skew", "cancel"],
}
SKEWS = ("+90s", "-90s")


def libfaketime_path() -> Path:
    """The libfaketime the PyPI package ``libfaketime`` (extra ``bench``) builds. Debian's 0.9.10
    fails time.sleep with EINVAL once monotonic time is left real, and hangs threading waits if it
    is faked too; this build does neither."""
    import libfaketime

    path = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    if not path.is_file():
        raise RuntimeError(f"no libfaketime library at {path}: pip install 'libfaketime>=3'")
    return path
TERMINAL = ("ready", "failed", "cancelled", "quarantined")
TIMINGS = {"HEARTBEAT_S": "0.5", "LEASE_S": str(LEASE_S), "SWEEP_INTERVAL_S": "0.5", "REDISPATCH_S": "3",
           "WORKER_REPORT_S": "1", "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4", "SHUTDOWN_GRACE_S": "3",
           "UPLOAD_ATTEMPTS": "40", "UPLOAD_BACKOFF_S": "0.5"}


def make_models(root: Path) -> Path:
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    models = root / "models"
    for arch in ("llama", "qwen2"):
        make_tiny_checkpoint(arch, models / f"tiny-{arch}")
    return models


class Farm:
    """What a trial needs from either mode."""

    http: httpx.Client
    failpoints: farm.Failpoints

    def export(self, export_id: str) -> dict:
        return self.http.get(f"/exports/{export_id}").json()

    def _client(self, port: int) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"},
                                 timeout=60)

    def wait_api(self, proc: farm.FarmProcess) -> None:
        def up():
            if not proc.alive():
                raise RuntimeError(proc.log_text()[-3000:])
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        farm.until(up, bool, 90, "the API")


class EmbeddedFarm(Farm):
    mode = "embedded"

    def __init__(self, root: Path, models: Path):
        self.root, self.data, self.logs = root, root / "data", root / "logs"
        self.logs.mkdir(parents=True)
        self.failpoints = farm.Failpoints(root / "failpoints.json")
        self.env = {"DATA_DIR": str(self.data), "MODELS_DIR": str(models), "ADMIN_TOKEN": ADMIN,
                    "EXPORTFARM_FAILPOINTS": str(self.failpoints.path), "DATABASE_URL": "", "REDIS_URL": "",
                    "S3_ENDPOINT_URL": "", "HF_HUB_OFFLINE": "1", **TIMINGS}
        self.port = free_ports(1)[0]
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.serve = farm.serve(self.env, self.port, self.logs, name=f"serve-{self.starts}")
        self._client(self.port)
        self.wait_api(self.serve)

    def holder(self, export_id: str) -> int:
        with sqlite3.connect(self.data / "catalog.db") as db:
            return db.execute("SELECT worker_pid FROM exports WHERE id = ?", (export_id,)).fetchone()[0]

    def holder_signaller(self, export_id: str):
        pid = self.holder(export_id)
        return lambda sig: os.killpg(pid, sig)

    def signal_holder(self, export_id: str, sig: signal.Signals) -> None:
        self.holder_signaller(export_id)(sig)

    def store_objects(self, export_id: str) -> dict:
        objects = self.data / "store" / "objects"
        found = {}
        for path in objects.rglob("*"):
            if path.is_file() and f"/{export_id}/" in f"/{path.relative_to(objects).as_posix()}":
                stat = path.stat()
                found[path.relative_to(objects).as_posix()] = (stat.st_size, stat.st_mtime_ns)
        return found

    def fetch(self, url: str) -> bytes:
        return httpx.get(url, timeout=60).content

    def read_object(self, key: str) -> bytes | None:
        path = self.data / "store" / "objects" / key
        return path.read_bytes() if path.is_file() else None

    def close(self) -> None:
        self.serve.stop()


class RedisFarm(Farm):
    mode = "redis"

    def __init__(self, root: Path, models: Path):
        self.root, self.logs = root, root / "logs"
        self.logs.mkdir(parents=True)
        self.failpoints = farm.Failpoints(root / "failpoints.json")
        self.pg, self.redis, self.s3 = farm.PostgresServer(), farm.RedisServer(), SeaweedS3()
        self.s3.start()
        self.bucket = "faults"
        self.env = {"DATABASE_URL": self.pg.url, "REDIS_URL": self.redis.url, "S3_ENDPOINT_URL": self.s3.endpoint_url,
                    "S3_ACCESS_KEY": self.s3.access_key, "S3_SECRET_KEY": self.s3.secret_key, "S3_BUCKET": self.bucket,
                    "MODELS_DIR": str(models), "DATA_DIR": str(root / "data"), "WORK_DIR": str(root / "work"),
                    "ADMIN_TOKEN": ADMIN, "EXPORTFARM_FAILPOINTS": str(self.failpoints.path), "HF_HUB_OFFLINE": "1",
                    **TIMINGS}
        from services.catalog.database import upgrade_schema
        upgrade_schema(self.pg.url)  # as `exportfarm db-upgrade` (the chart's migration job) does
        port = free_ports(1)[0]
        self.api = farm.serve(self.env, port, self.logs, name="api")
        self._client(port)
        self.wait_api(self.api)
        self.beat = farm.beat(self.env, self.logs)
        self.workers: dict[str, farm.FarmProcess] = {}
        self.count = 0
        self.fill()

    def fill(self, skewed: bool = False) -> None:
        """Two live workers; with ``skewed`` their wall clocks run 90 s ahead and 90 s behind
        (libfaketime preloaded into the worker and its pool process; monotonic time is real, as
        a host whose wall clock is off still measures intervals right)."""
        self.workers = {n: w for n, w in self.workers.items() if w.alive()}
        while len(self.workers) < 2:
            self.count += 1
            name = f"w{self.count}"
            extra = {}
            if skewed:
                extra = {"LD_PRELOAD": str(libfaketime_path()), "FAKETIME": SKEWS[self.count % 2],
                         "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
            self.workers[name] = farm.worker(self.env, name, self.logs, **extra)
        self.skewed = skewed

    def restart_workers(self, skewed: bool) -> None:
        for process in self.workers.values():
            process.stop()
        self.workers = {}
        self.fill(skewed)

    def holder_signaller(self, export_id: str):
        return self.workers[self.export(export_id)["worker"]].signal

    def signal_holder(self, export_id: str, sig: signal.Signals) -> None:
        self.holder_signaller(export_id)(sig)

    def store_objects(self, export_id: str) -> dict:
        client = self.s3.client()
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for o in page.get("Contents", []):
                if f"/{export_id}/" in f"/{o['Key']}":
                    found[o["Key"]] = (o["Size"], o["ETag"], o["LastModified"].isoformat())
        return found

    def fetch(self, url: str) -> bytes:
        return httpx.get(url, timeout=60).content

    def read_object(self, key: str) -> bytes | None:
        try:
            return self.s3.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception:  # gone since it was listed
            return None

    def close(self) -> None:
        for process in (*self.workers.values(), self.beat, self.api):
            process.stop()
        self.s3.close()
        self.redis.close()
        self.pg.close()


def event_time(export: dict, prefix: str) -> float | None:
    times = [datetime.datetime.fromisoformat(e["at"]).timestamp() for e in export["events"]
             if (e["message"] or "").startswith(prefix)]
    return times[-1] if times else None


def verify(farm_: Farm, export: dict) -> list[str]:
    """What is wrong with a ready export: nothing, for one completed exactly once. The catalog's
    sha256 of every file (what the artifacts endpoint serves) must be the published manifest's and
    the served bytes'."""
    problems = []
    if [e["to_status"] for e in export["events"]].count("ready") != 1:
        problems.append("more than one ready event")
    links = farm_.http.get(f"/exports/{export['id']}/artifacts").json()["files"]
    manifest = json.loads(farm_.fetch(links["manifest.json"]["url"]))
    if manifest.get("status") != "ready" or manifest.get("export_id") != export["id"]:
        problems.append("published manifest does not say ready for this export")
    if set(manifest["files"]) != set(links) - {"manifest.json"}:
        problems.append("the catalog and the published manifest list different files")
    for name, entry in manifest["files"].items():
        if name in links and links[name]["sha256"] != entry["sha256"]:
            problems.append(f"the catalog's sha256 of {name} is not the store's")
        if hashlib.sha256(farm_.fetch(links[name]["url"])).hexdigest() != entry["sha256"]:
            problems.append(f"{name} does not match its sha256")
    published = [k for k in farm_.store_objects(export["id"]) if k.endswith("manifest.json")]
    if len(published) != 1:
        problems.append(f"{len(published)} manifests published")
    return problems


def live_manifests(farm_: Farm, export_id: str) -> list[str]:
    """Keys of this export's manifests in the store that are not withdrawn (a cancelled or failed
    export must have none)."""
    found = []
    for key in farm_.store_objects(export_id):
        if key.endswith("manifest.json"):
            data = farm_.read_object(key)
            if data is not None and json.loads(data).get("status") != "withdrawn":
                found.append(key)
    return found


def wait_end(farm_: Farm, export_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    export = farm_.export(export_id)
    while export["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
        export = farm_.export(export_id)
    return export


def cancel_trial(farm_: RedisFarm, index: int, rng: random.Random, timeout: float = 240) -> dict:
    """Cancel while the job is held in a stage, or racing the sweeper's adopt of a manifest its
    killed worker published but never recorded. Accepted (202): it must end cancelled with no live
    manifest; refused (409, it had already ended): it must be a correct ready export."""
    stage = rng.choice([*STAGES, "adopt"])
    export_id, record = hold_in_stage(farm_, index, rng, "cancel", stage, 3600)
    fault_at = time.time()
    if stage == "adopt":
        farm.until(lambda: live_manifests(farm_, export_id), bool, 60, "the manifest")
        farm_.signal_holder(export_id, signal.SIGKILL)
        time.sleep(rng.uniform(0, LEASE_S + 2))  # before, at or after the sweeper adopts it
        farm_.fill()
    answer = farm_.http.delete(f"/exports/{export_id}")
    farm_.failpoints.clear()
    record["cancel_answer"] = answer.status_code
    export = wait_end(farm_, export_id, timeout)
    record.update(status=export["status"], attempts=export["attempts"], error=export["error"],
                  recovery_s=round(time.time() - fault_at, 2))
    if export["status"] not in TERMINAL:
        return record | {"outcome": "stuck"}
    problems = []
    if answer.status_code == 202 and export["status"] != "cancelled":
        problems.append(f"cancel accepted, but the export ended {export['status']}")
    if answer.status_code not in (202, 409):
        problems.append(f"cancel answered {answer.status_code}")
    if export["status"] == "ready":
        problems += verify(farm_, export)
    elif live := live_manifests(farm_, export_id):
        problems.append(f"{export['status']} export has a live manifest: {live}")
    before = farm_.store_objects(export_id)
    time.sleep(LEASE_S + 1)
    if live_manifests(farm_, export_id) and export["status"] != "ready":
        problems.append("a manifest appeared after the export ended")
    if export["status"] == "ready" and farm_.store_objects(export_id) != before:
        problems.append("the store changed after the export was ready")
    record["problems"] = problems
    return record | {"outcome": "duplicated" if problems else "completed_exactly_once"}


def hold_in_stage(farm_: Farm, index: int, rng: random.Random, fault: str, stage: str,
                  seconds: float) -> tuple[str, dict]:
    """Submit an export held for ``seconds`` in ``stage`` (``upload``: after its first file is in the
    store; ``adopt``: after its manifest is, before the catalog is told) and wait until it reaches the
    stage; returns its id and the trial's record."""
    farm_.failpoints.set("published" if stage == "adopt" else stage, attempt=1, seconds=seconds)
    export_id = submit(farm_, index, rng)
    record = {"trial": index, "mode": farm_.mode, "fault": fault, "stage": stage, "export_id": export_id}
    catalog_stage = "publish" if stage in ("upload", "adopt") else stage
    farm.until(lambda: farm_.export(export_id), lambda e: e["status"] == "running" and e["stage"] == catalog_stage,
               120, f"stage {stage}")
    if stage == "upload":
        farm.until(lambda: farm_.store_objects(export_id), bool, 60, "the first upload")
    return export_id, record


def submit(farm_: Farm, index: int, rng: random.Random) -> str:
    body = {"model": rng.choice(["tiny-llama", "tiny-qwen2"]), "dtype": "fp32", "ep": "cpu", "variant": "attn_dynamic",
            "max_seq_len": 40 + index}  # a request of its own: identical requests share one export
    posted = farm_.http.post("/exports", json=body)
    posted.raise_for_status()
    return posted.json()["id"]


def trial(farm_: Farm, index: int, fault: str, rng: random.Random, timeout: float = 240) -> dict:
    if fault == "cancel":
        return cancel_trial(farm_, index, rng, timeout)
    stage = "upload" if fault in ("s3-outage", "s3-sigstop") else rng.choice(STAGES)
    pause = {"redis-restart": 2.5, "postgres-restart": 2.5, "s3-outage": 1.0, "s3-sigstop": 1.0,
             "clock-skew": 2 * LEASE_S}.get(fault, 3600)
    export_id, record = hold_in_stage(farm_, index, rng, fault, stage, pause)
    fault_at = time.time()
    if fault == "worker-sigkill":
        farm_.signal_holder(export_id, signal.SIGKILL)
        farm_.failpoints.clear()
        if isinstance(farm_, RedisFarm):
            time.sleep(0.5)
            farm_.fill()
    elif fault == "worker-sigstop":
        resume = farm_.holder_signaller(export_id)  # the stopped process, whoever holds the job later
        resume(signal.SIGSTOP)
        farm_.failpoints.clear()
        time.sleep(LEASE_S + rng.uniform(1, 3))
        resume(signal.SIGCONT)
    elif fault == "farm-crash":
        worker_pid = farm_.holder(export_id)
        farm_.serve.kill()
        try:
            os.killpg(worker_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died with serve
        farm_.failpoints.clear()
        farm_.start()
    elif fault == "redis-restart":
        farm_.redis.stop()
        time.sleep(rng.uniform(1, 3))
        farm_.redis.start()
        farm_.failpoints.clear()
    elif fault == "postgres-restart":
        farm_.pg.restart()
        farm_.failpoints.clear()
    elif fault == "s3-outage":
        farm_.s3.stop()
        time.sleep(rng.uniform(3, 8))
        farm_.s3.start()
        farm_.failpoints.clear()
    elif fault == "s3-sigstop":
        os.kill(farm_.s3.pid, signal.SIGSTOP)
        time.sleep(pause + 0.5)  # the worker leaves its failpoint and sends its next upload into the stopped S3
        stopped_worker = farm_.holder_signaller(export_id)
        stopped_worker(signal.SIGSTOP)
        farm_.failpoints.clear()
        time.sleep(LEASE_S + rng.uniform(2, 4))  # the lease expires; another worker takes the job over
        os.kill(farm_.s3.pid, signal.SIGCONT)  # the stopped attempt's request lands now, late
        farm.until(lambda: farm_.export(export_id), lambda e: e["attempts"] > 1 or e["status"] in TERMINAL, 120,
                   "the takeover")
        time.sleep(rng.uniform(0, 3))
        stopped_worker(signal.SIGCONT)
    elif fault == "clock-skew":
        pass  # the job sits in its stage for twice the lease on a worker whose clock is 90 s off
    export = wait_end(farm_, export_id, timeout)
    ended_at = time.time()
    record.update(status=export["status"], attempts=export["attempts"], error=export["error"])
    if export["status"] not in TERMINAL:
        return record | {"outcome": "stuck"}
    if export["status"] != "ready":
        return record | {"outcome": "lost"}
    record["recovery_s"] = round(ended_at - fault_at, 2)
    started = event_time(export, f"attempt {export['attempts']} started")
    if export["attempts"] > 1 and started is not None:
        record["takeover_s"] = round(started - fault_at, 2)
    problems = verify(farm_, export)
    if fault == "clock-skew":
        record["worker_clock"] = SKEWS[int(export["worker"].lstrip("w")) % 2] if export["worker"] else None
        crashed = "pool process died" in (export.get("lost_reason") or "")
        if crashed:  # not the skew: a process that died is lost whatever the clocks say (counted apart)
            record["pool_crash"] = export["lost_reason"]
        elif export["attempts"] != 1:
            problems.append(f"a healthy job on a skewed worker took {export['attempts']} attempts")
    before = farm_.store_objects(export_id)
    time.sleep(LEASE_S + 1)  # a stale attempt that still wrote would show up now
    if farm_.store_objects(export_id) != before or farm_.export(export_id)["events"] != export["events"]:
        problems.append("the store or the catalog changed after the export was ready")
    record["problems"] = problems
    return record | {"outcome": "duplicated" if problems else "completed_exactly_once"}


def summarize(records: list[dict]) -> dict:
    def figures(values):
        return {"median": round(statistics.median(values), 2), "max": round(max(values), 2)} if values else None

    outcomes = ["completed_exactly_once", "lost", "duplicated", "stuck"]
    summary = {"trials": len(records), **{o: sum(r["outcome"] == o for r in records) for o in outcomes},
               "recovery_s": figures([r["recovery_s"] for r in records if "recovery_s" in r]),
               "takeover_s": figures([r["takeover_s"] for r in records if "takeover_s" in r])}
    if crashes := sum("pool_crash" in r for r in records):
        summary["pool_crashes"] = crashes  # worker pool processes that died (signal) during the trial
    return summary


def run_mode(mode: str, trials: int, rng: random.Random, work: Path, models: Path,
             faults: list[str] | None = None, per_fault: bool = False) -> dict:
    faults = [f for f in FAULTS[mode] if faults is None or f in faults]
    farm_ = (EmbeddedFarm if mode == "embedded" else RedisFarm)(work / mode, models)
    records = []
    try:
        order = [f for f in faults for _ in range(trials)] if per_fault else [faults[i % len(faults)] for i in range(trials)]
        rng.shuffle(order)
        for index, fault in enumerate(order, start=1):
            if isinstance(farm_, RedisFarm):
                if (fault == "clock-skew") != farm_.skewed:
                    farm_.restart_workers(skewed=fault == "clock-skew")
                farm_.fill(farm_.skewed)
            try:
                record = trial(farm_, index, fault, rng)
            except Exception as err:  # the harness could not drive the trial: count it, keep going
                record = {"trial": index, "mode": mode, "fault": fault, "outcome": "stuck", "harness_error": repr(err)}
            farm_.failpoints.clear()
            records.append(record)
            print(f"{mode} trial {index:>2} {fault:<17} {record.get('stage', ''):<9} -> {record['outcome']}"
                  f" (attempts {record.get('attempts')}, recovery {record.get('recovery_s')} s)", flush=True)
    finally:
        farm_.close()
    by_fault = {f: summarize([r for r in records if r["fault"] == f]) for f in faults}
    return {**summarize(records), "by_fault": by_fault, "records": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per mode (default 20)")
    parser.add_argument("--modes", default="embedded,redis")
    parser.add_argument("--faults", default=None, help="comma-separated faults to run (default: every fault of the mode)")
    parser.add_argument("--per-fault", action="store_true", help="--trials trials of every fault")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "faults.json")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="faults-"))
    models = make_models(work)
    rng = random.Random(args.seed)
    started = time.time()
    modes = {}
    for mode in args.modes.split(","):
        modes[mode] = run_mode(mode, args.trials, rng, work, models,
                               args.faults.split(",") if args.faults else None, args.per_fault)
    result = {
        "benchmark": "faults",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/faults.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {**TIMINGS, "MAX_ATTEMPTS": "3 (default)"},
        "seed": args.seed,
        "wall_s": round(time.time() - started, 1),
        "modes": modes,
        "goal": "every trial completed exactly once",
        "goal_met": all(m["completed_exactly_once"] == m["trials"] for m in modes.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for mode, m in modes.items():
        print(f"{mode}: {m['completed_exactly_once']}/{m['trials']} completed exactly once, lost {m['lost']}, "
              f"duplicated {m['duplicated']}, stuck {m['stuck']}, recovery {m['recovery_s']}, takeover {m['takeover_s']}")
    print(f"wrote {args.out}")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
