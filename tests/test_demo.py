"""`make run`'s program (services/demo.py): the embedded farm end to end over its REST API, then stopped."""

from __future__ import annotations

import re
import socket
import subprocess
import sys


def test_the_demo_runs_the_farm_end_to_end_and_stops_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.demo", "--work", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    port = int(re.search(r"farm on http://127\.0\.0\.1:(\d+)", out).group(1))
    assert "-> 202, export" in out and re.search(r"running\s+stage validate", out) and " is ready" in out
    files = re.findall(r"^  (\S+)\s+\d+ bytes  sha256 [0-9a-f]{16}  ok  http://127\.0\.0\.1:\d+/files/", out, re.M)
    assert {"model.onnx", "model.onnx.data", "manifest.json", "parity_report.json", "benchmark.json"} <= set(files)
    assert '"attn_dynamic-fp32-cpu"' in out and "catalog entry" in out
    assert out.rstrip().endswith("demo: farm stopped cleanly")
    with socket.socket() as s:  # nothing listens any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    again = subprocess.run([sys.executable, "-m", "services.demo", "--work", str(tmp_path)], capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "an identical export exists, so it is returned" in again.stdout
