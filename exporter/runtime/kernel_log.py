"""Which attention kernel ORT's CUDA EP chose, read from its logs.

ORT says it in two places: the ONNX-domain ``Attention`` kernel logs at VERBOSE on the default
logger ("ONNX Attention: using Flash Attention (batch=1, q_seq=1, ...)"), and the contrib
attention kernels (GroupQueryAttention, MultiHeadAttention) print a debug line to stdout when
``ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1`` ("Operator=GroupQueryAttention Node=... DataType=fp16
SdpaKernel=FLASH_ATTENTION"). ``probe`` runs one prefill and one decode step of a model with both
switched on, in a child process (the switches are process-wide), and ``parse_kernel_lines`` turns
the output into {phase: {op: kernel}}.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

PHASE_MARK = "@@exportfarm-phase "
_ONNX_ATTENTION = re.compile(r"ONNX Attention: using (Flash Attention|Memory Efficient Attention|cuDNN[\w ]*)(?: \(([^)]*)\))?")
_UNFUSED = re.compile(r"Attention: using unified unfused path")
_SDPA = re.compile(r"Operator=(\w+).*?SdpaKernel=(\w+)")
KERNEL_NAMES = {
    "Flash Attention": "flash", "FLASH_ATTENTION": "flash", "LEAN_ATTENTION": "lean",
    "Memory Efficient Attention": "memory_efficient", "EFFICIENT_ATTENTION": "memory_efficient",
    "CUDNN_FLASH_ATTENTION": "cudnn_sdpa", "MATH": "unfused", "unfused": "unfused",
    "TRT_FUSED_ATTENTION": "trt_fused", "TRT_FLASH_ATTENTION": "trt_flash", "TRT_CAUSAL_ATTENTION": "trt_causal",
    "FT_CAUSAL_ATTENTION": "ft_causal", "TRT_CROSS_ATTENTION": "trt_cross",
}


def _kernel(name: str) -> str:
    if name.lower().startswith("cudnn"):
        return "cudnn_sdpa"
    return KERNEL_NAMES.get(name, name.lower())


def parse_kernel_lines(text: str) -> dict[str, dict[str, str]]:
    """{phase: {op: kernel}} from ORT output; a phase starts at a ``PHASE_MARK`` line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # ORT colours these lines
    phase = "unknown"
    found: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.startswith(PHASE_MARK):
            phase = line[len(PHASE_MARK):].strip()
            continue
        if m := _ONNX_ATTENTION.search(line):
            found.setdefault(phase, {})["Attention"] = _kernel(m.group(1))
        elif _UNFUSED.search(line):
            found.setdefault(phase, {})["Attention"] = "unfused"
        elif m := _SDPA.search(line):
            found.setdefault(phase, {})[m.group(1)] = _kernel(m.group(2))
    return found


def evidence_lines(text: str, per_phase: int = 4) -> list[str]:
    """The first few kernel lines of each phase, kept verbatim in reports as evidence."""
    kept, phase_count = [], 0
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        if line.startswith(PHASE_MARK):
            kept.append(line.strip())
            phase_count = 0
        elif ("SdpaKernel=" in line or "Attention: using" in line) and phase_count < per_phase:
            kept.append(line.strip())
            phase_count += 1
    return kept


def probe(model_path: Path, ep: str = "cuda", ctx: int = 512, timeout_s: int = 600) -> dict:
    """Run one prefill of ``ctx`` tokens and decode steps in a child process; parse what ORT said."""
    env = {**os.environ, "ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO": "1"}
    # One pipe for stdout and stderr keeps the phase marks in order with ORT's log lines.
    proc = subprocess.run(
        [sys.executable, "-m", "exporter.runtime.kernel_log", str(model_path), "--ep", ep, "--ctx", str(ctx)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout_s,
    )
    output = proc.stdout
    result = {"kernels": parse_kernel_lines(output), "returncode": proc.returncode, "lines": evidence_lines(output)}
    if proc.returncode != 0:
        result["error"] = output[-2000:]
    return result


def _child(model_path: str, ep: str, ctx: int) -> None:
    import numpy as np
    import onnxruntime as ort

    from exporter.runtime.session import Decoder

    ort.set_default_logger_severity(0)  # VERBOSE: the ONNX Attention kernel logs its choice there
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ... but keep the session's own (graph-level) chatter quiet
    harness = Decoder(Path(model_path), ep, session_options=options)
    caches = harness.new_caches(ctx + 4)
    print(PHASE_MARK + "prefill", flush=True)
    harness.prefill_bound(np.random.default_rng(0).integers(3, 100, size=(1, ctx)), caches, ctx + 4)
    sys.stdout.flush()
    print(PHASE_MARK + "decode", flush=True)
    harness.decode_bound(caches, ctx, ctx + 4, 2, 0)
    sys.stdout.flush()
    print(PHASE_MARK + "done", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="run a model once with ORT's attention kernel logs on")
    parser.add_argument("model")
    parser.add_argument("--ep", default="cuda")
    parser.add_argument("--ctx", type=int, default=512)
    args = parser.parse_args()
    _child(args.model, args.ep, args.ctx)
    print(json.dumps({"ok": True}))
