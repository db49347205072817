"""schemathesis over every operation of a real ``exportfarm serve``, authenticated, all four phases
(examples, coverage, fuzzing, stateful via the schema's links): no request may get a 5xx.

The schema's first example names "Qwen/Qwen2.5-0.5B-Instruct"; a directory of that name under
MODELS_DIR (a tiny random-weight qwen2) makes it a real model, so the stateful phase has exports to
read, cancel and list. serve runs without its worker, so the catalog fills with queued exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests import farm
from tests.s3_server import free_ports

ADMIN = "schemathesis-admin-token-0123456789"


def test_no_server_errors_anywhere(tmp_path, checkpoint):
    models = tmp_path / "models"
    (models / "Qwen").mkdir(parents=True)
    (models / "Qwen" / "Qwen2.5-0.5B-Instruct").symlink_to(checkpoint("qwen2"))
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    # The default failure limit: the fuzzer's unauthenticated probes must not lock its valid token out.
    env = {"DATA_DIR": str(tmp_path / "data"), "MODELS_DIR": str(models), "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
           "DATABASE_URL": "", "REDIS_URL": "", "S3_ENDPOINT_URL": ""}
    port = free_ports(1)[0]
    server = farm.FarmProcess([sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--no-worker"],
                              env, tmp_path / "serve.log")
    try:
        farm.until(lambda: _up(port, server), bool, 60, "serve")
        st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
        run = subprocess.run(
            [st, "run", f"http://127.0.0.1:{port}/openapi.json", "-H", f"Authorization: Bearer {ADMIN}",
             "--checks", "not_a_server_error", "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", "25",
             "--generation-deterministic", "--request-timeout", "30", "--no-color"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache stays out of the repo
        after = httpx.get(f"http://127.0.0.1:{port}/exports", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    finally:
        server.stop()
    assert after.status_code == 200, after.text  # the admin still gets in after every probe of the run
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out).groups())
    assert generated == passed and generated > 500, out[-3000:]
    assert re.search(r"✅ Stateful", out), out[-3000:]
    selected, total = map(int, re.search(r"Selected: (\d+)/(\d+)", out).groups())
    assert selected == total >= 15 and f"Tested: {total}" in out, out[-3000:]  # every operation
    log = (tmp_path / "serve.log").read_text()
    assert '"POST /exports HTTP/1.1" 202' in log  # the examples really created exports for the stateful phase
    assert re.search(r'HTTP/1\.1" 5\d\d', log) is None


def _up(port: int, server: farm.FarmProcess) -> bool:
    assert server.alive(), server.log_text()[-3000:]
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
