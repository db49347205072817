"""A real ONNX Runtime upgrade: workers in virtual environments with onnxruntime 1.30.0 and 1.31.1.

The old worker exports two checkpoints; the new one starts and reports its runtime; the beat's
check queues exactly two re-exports, the new worker completes them with diffs against their
predecessors, and a second check queues nothing. Then a re-export that fails validation is
flagged as a regression. Real Redis, PostgreSQL, Celery worker and beat processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services_fixtures import farm_api, flush_redis, fresh_postgres_database

ADMIN = "upgrade-admin-token-0123456789abc"
REDIS_URL = "redis://127.0.0.1:6379/13"


def runtime_venv(root: Path, version: str) -> Path:
    """A venv that sees this project and its dependencies but has its own onnxruntime."""
    import sysconfig

    venv = root / f"ort-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"onnxruntime=={version}"], check=True)
        # Everything else comes from this interpreter's environment, after the venv's own packages
        # (so its onnxruntime wins): --system-site-packages would give the base Python's instead.
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "parent-env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    found = subprocess.run([str(python), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == version, f"venv imports onnxruntime {found}, not {version}"
    return python


@pytest.fixture(scope="module")
def env(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("upgrade")
    models = root / "models"
    models.mkdir()
    for arch in ("llama", "qwen2"):
        (models / f"tiny-{arch}").symlink_to(checkpoint(arch))
    flush_redis(REDIS_URL)
    with fresh_postgres_database() as database_url:
        yield {
            "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "MODELS_DIR": str(models), "DATA_DIR": str(root / "data"),
            "WORK_DIR": str(root / "work"), "HEARTBEAT_S": "0.5", "LEASE_S": "5", "WORKER_REPORT_S": "1",
            "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4", "BEAT_INTERVAL_S": "2", "ADMIN_TOKEN": ADMIN,
            "HF_HUB_OFFLINE": "1", "SIGNING_SECRET": "upgrade-test-signing-secret-0123456789",
            # Tiny CPU timings on a shared 2-core box are noise: judge latency only far outside it here.
            "REGRESSION_LATENCY_PCT": "1000",
        }


@pytest.fixture(scope="module")
def api(env):
    with farm_api(env, ADMIN) as client:
        yield client


class Process:
    def __init__(self, argv, env, log: Path):
        self.log = log.open("wb")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def worker(python: Path, name: str, env: dict, log_dir: Path, **extra) -> Process:
    return Process([str(python), "-m", "services.cli", "worker", "--queues", "cpu", "--name", name],
                   {**env, **extra}, log_dir / f"{name}.log")


def until(fetch, predicate, timeout=180, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fetch()
        if predicate(value):
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last: {value}")


def registered(api, name, version):
    until(lambda: api.get("/workers").json()["workers"],
          lambda ws: any(w["hostname"] == name and w["onnxruntime"] == version for w in ws), 120, f"{name} to report")


def test_ort_upgrade_reexports_the_catalog_once(api, env, tmp_path_factory):
    venvs = tmp_path_factory.mktemp("venvs")
    old_python, new_python = runtime_venv(venvs, "1.30.0"), runtime_venv(venvs, "1.31.1")
    logs = tmp_path_factory.mktemp("logs")

    old = worker(old_python, "w-ort-1.30", env, logs)
    try:
        registered(api, "w-ort-1.30", "1.30.0")
        first = [api.post("/exports", json={"model": m, "dtype": "fp32", "ep": "cpu"}).json()["id"]
                 for m in ("tiny-llama", "tiny-qwen2")]
        for export_id in first:
            done = until(lambda: api.get(f"/exports/{export_id}").json(), lambda e: e["status"] in ("ready", "failed"),
                         what=f"{export_id} on 1.30")
            assert done["status"] == "ready" and done["ort_version"] == "1.30.0", done["error"]
    finally:
        old.stop()

    new = worker(new_python, "w-ort-1.31", env, logs)
    beat = None
    try:
        registered(api, "w-ort-1.31", "1.31.1")
        assert api.get("/workers").json()["newest_live_runtime"]["cpu"] == "1.31.1"
        beat = Process([sys.executable, "-m", "services.cli", "beat"], env, logs / "beat.log")
        successors = until(
            lambda: [e for e in api.get("/exports", params={"limit": 50}).json()["items"] if e["predecessor_id"]],
            lambda es: len(es) >= 2 and all(e["status"] == "ready" for e in es), 240, "two re-exports")
        beat.stop()
        beat = None
        assert sorted(e["predecessor_id"] for e in successors) == sorted(first)
        assert len(successors) == 2  # exactly two, however many times the beat ran meanwhile
        for export in successors:
            assert export["reason"] == "ort-upgrade" and export["ort_version"] == "1.31.1"
            diff = api.get(f"/exports/{export['id']}/diff").json()
            assert diff["old"]["onnxruntime"] == "1.30.0" and diff["new"]["onnxruntime"] == "1.31.1"
            assert diff["regression"] is False, diff["regressions"]
        for model in ("tiny-llama", "tiny-qwen2"):
            generations = api.get("/exports", params={"model": model}).json()["items"]
            assert sorted(g["ort_version"] for g in generations) == ["1.30.0", "1.31.1"]
        second = api.post("/reexports").json()
        assert second["queued"] == [] and second["newest"]["cpu"] == "1.31.1"
    finally:
        if beat is not None:
            beat.stop()
        new.stop()

    # A planted regression: the next runtime's worker validates on an EP it does not have, so the
    # re-export's parity gate fails; its diff against the predecessor flags that.
    broken = worker(Path(sys.executable), "w-ort-broken", env, logs, VALIDATE_EP="cuda")
    try:
        registered(api, "w-ort-broken", __import__("onnxruntime").__version__)
        plan = api.post("/reexports", json={"policy": "listed", "models": ["tiny-qwen2"]}).json()
        assert [q["model"] for q in plan["queued"]] == ["tiny-qwen2"]
        export_id = plan["queued"][0]["export_id"]
        done = until(lambda: api.get(f"/exports/{export_id}").json(), lambda e: e["status"] in ("quarantined", "ready", "failed"),
                     what="the broken re-export")
        assert done["status"] == "quarantined" and done["regression"] is True
        flagged = api.get("/catalog/regressions").json()
        assert [r["export_id"] for r in flagged] == [export_id]
        assert any("parity" in reason for reason in flagged[0]["regressions"]), flagged
    finally:
        broken.stop()
