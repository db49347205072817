"""A process bound to a GPU makes its sessions there, and the streamed reference computes there too.

On a GPU machine (benchmarks/gpu_env.sh first), for each visible device index and one past them:

* a child process bound to that index (``EXPORTFARM_GPU_DEVICE``, what ``exportfarm worker --gpu N``
  sets) creates the export's CUDA session and runs a prefill: the session's provider options name
  the device, and NVML shows the child's memory on that device and on no other; an index the host
  does not have fails with a message, not on another GPU;
* ``claim_device`` held by one process refuses a second process on the same device;
* the streamed reference on ``cuda:<index>`` (fp32) against transformers' whole model on the CPU:
  the same tokens, logits equal to fp32 rounding.

    python3 benchmarks/device_binding.py --work /tmp/binding --out benchmarks/results/h200/device_binding.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(export_dir: str) -> None:
    """Run in a bound process: a session, a prefill, and what it reports, as JSON on stdout."""
    import time

    import numpy as np

    from exporter.runtime.device import cuda_device, device_memory
    from exporter.runtime.session import Decoder

    lm = Decoder(Path(export_dir), "cuda")
    lm.forward(np.array([[5, 17, 99, 3, 42, 8]], dtype=np.int64), lm.new_state())
    options = lm.session.get_provider_options().get("CUDAExecutionProvider", {})
    import pynvml

    pynvml.nvmlInit()
    held = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                held[i] = proc.usedGpuMemory
    memory = device_memory()
    print(json.dumps({"bound": cuda_device(), "session_device_id": options.get("device_id"),
                      "memory_on_devices": held, "device": memory.name if memory else None,
                      "at": time.time()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/exportfarm-binding"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import numpy as np
    import pynvml
    import torch

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.reference import load_reference, reference_greedy
    from exporter.validation.streamed import StreamedReference

    args.work.mkdir(parents=True, exist_ok=True)
    source = make_tiny_checkpoint("qwen3", args.work / "ckpt", dtype="bfloat16", hidden_size=256,
                                  intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    export = export_model(ExportRequest(model=str(source), dtype="fp16", ep="cuda"), args.work / "export",
                          validate=False, overwrite=True).out_dir
    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    sessions = []
    for index in range(count + 1):
        env = {**os.environ, "EXPORTFARM_GPU_DEVICE": str(index)}
        proc = subprocess.run([sys.executable, __file__, "_child", str(export)], env=env, capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        sessions.append({"index": index, "exit": proc.returncode,
                         "report": json.loads(last) if proc.returncode == 0 and last.startswith("{") else None,
                         "error": None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1][:400]})
    # One worker per GPU: a second holder of device 0 on this host is refused.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, '.');"
                               "from exporter.runtime.device import claim_device; held = claim_device(0); print('held', flush=True);"
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "EXPORTFARM_LOCK_DIR": str(args.work)})
    holder.stdout.readline()
    second = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.');"
                             "from exporter.runtime.device import claim_device; claim_device(0)"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "EXPORTFARM_LOCK_DIR": str(args.work)})
    holder.kill()
    # The streamed reference on the GPU against the whole model on the CPU.
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, size=16)]
    whole = reference_greedy(load_reference(source), prompt, 24)
    streamed = StreamedReference(source, "cuda:0")
    on_gpu = reference_greedy(streamed, prompt, 24, draft=whole.tokens)
    span = float(whole.prefill_logits.max() - whole.prefill_logits.min())
    diff = max(float(np.abs(a - b).max()) for a, b in zip(whole.step_logits, on_gpu.step_logits))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "devices": count, "torch": torch.__version__,
        "sessions": sessions,
        "second_claim_of_device_0": {"exit": second.returncode,
                                     "error": (second.stderr.strip().splitlines() or [""])[-1][:300]},
        "streamed_reference_cuda_vs_whole_cpu": {
            "tokens_equal": whole.tokens == on_gpu.tokens, "max_abs_logit_diff": diff, "logit_span": span,
            "relative": diff / span, "passes": streamed.passes, "tf32": torch.backends.cuda.matmul.allow_tf32},
    }
    # What must hold, checked here so that a run that shows otherwise fails.
    checks = {
        f"session on GPU {s['index']} runs there and only there": s["report"] is not None
        and s["report"]["session_device_id"] == str(s["index"]) and set(s["report"]["memory_on_devices"]) == {str(s["index"])}
        for s in sessions if s["index"] < count}
    checks[f"GPU {count} (absent) is refused"] = sessions[-1]["exit"] != 0
    checks["a second claim of GPU 0 is refused"] = second.returncode != 0 and "already bound" in second.stderr
    checks["streamed reference on cuda:0 = whole model on the CPU to fp32 rounding"] = (
        whole.tokens == on_gpu.tokens and diff <= 1e-5 * span)
    result["checks"] = checks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if not all(checks.values()):
        raise SystemExit(f"failed: {[name for name, ok in checks.items() if not ok]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2])
    else:
        main()
