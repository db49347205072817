"""benchmarks/gpu_node.py on this host's CPU: the farm (PostgreSQL, Redis, SeaweedFS, API, sweeper)
with two workers, the warm-up / one-worker / node / kill phases, and a worker SIGKILLed mid-job whose
export ends ready on the other worker. The GPU run of the same script is the device tool's
(benchmarks/results/h200/gpu_node*.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_node_script_runs_its_phases_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_node.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_node.py", "--ep", "cpu", "--geometry", "tiny",
                           "--workers", "2", "--out", str(out), "--work", str(tmp_path / "work"), "--timeout", "240"],
                          cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["phases"]) == {"warmup", "one_gpu", "node", "kill"}
    assert {j["worker"] for j in result["phases"]["one_gpu"]["jobs"]} == {"gpu0"}
    assert {j["worker"] for j in result["phases"]["node"]["jobs"]} == {"gpu0", "gpu1"}
    kill = result["phases"]["kill"]
    killed, other = kill["killed_worker"], ({"gpu0", "gpu1"} - {kill["killed_worker"]}).pop()
    assert kill["victim_attempts"] == 2 and kill["victim_finished_by"] == other
    assert killed in next(j for j in kill["jobs"] if j["id"] == kill["victim"])["workers_seen"]
    assert all(v == "pass" or v.startswith("info") for v in result["checks"].values()), result["checks"]
