"""A default int4 cuda export: the activation dtype measured on its checkpoint, and its decode speed beside the other.

For one checkpoint (a directory, or a name in tests/real_model.py's REAL_MODELS):

1. ``exportfarm export --dtype int4 --ep cuda`` with every quant option at its default (validated on cuda
   unless ``--no-validate``): the activation dtype the exporter chose by measurement and why (the manifest's
   ``quantization.activations_chosen``), the export's wall time and status;
2. the same export with ``--quant-activations`` set to the other half precision (not validated: a model
   whose activations overflow fp16 computes garbage there, but its speed is what is compared);
3. ``exportfarm bench`` of each (its own process: a crash there is reported as the command's failure),
   decode ms/token at ``--ctx``, batch 1, CUDA graphs, one after the other in the same run;
4. with ``--fp16-baseline``, an fp16 export of the same checkpoint (not validated), for the int4 / fp16
   export-time ratio.

::

    python benchmarks/int4_activations.py --model gemma3-270m --out $OUT/int4_activations_gemma3-270m.json
    python benchmarks/int4_activations.py --model /tmp/s8/llama-3.1-8b-L32 --no-validate --fp16-baseline \\
        --out $OUT/int4_activations_llama-3.1-8b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, cwd=ROOT)
    return proc, time.perf_counter() - t0


def _export(checkpoint: str, out: Path, dtype: str, flags: list[str], validate: bool) -> dict:
    proc, wall = _run(["export", "--model", checkpoint, "--dtype", dtype, "--ep", "cuda", "--out", str(out),
                       "--overwrite", *flags, *([] if validate else ["--no-validate"])])
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    quant = manifest.get("quantization") or {}
    chosen = dict(quant.get("activations_chosen") or {})
    chosen.pop("layer_peaks", None)
    return {"command": f"exportfarm export --model <checkpoint> --dtype {dtype} --ep cuda {' '.join(flags)}".strip()
                       + ("" if validate else " --no-validate"),
            "exit_status": proc.returncode, "wall_s": round(wall, 1), "status": manifest.get("status"),
            "activations": quant.get("activations"), "activations_chosen": chosen,
            "timings_s": manifest.get("timings_s"), "bytes": (out / "model.onnx.data").stat().st_size
            if (out / "model.onnx.data").is_file() else None,
            "failed": (manifest.get("validation") or {}).get("summary") if manifest.get("status") != "ready" else None,
            "stderr_tail": proc.stderr.strip()[-800:] if proc.returncode else None}


def _bench(out: Path, contexts: str, steps: int) -> dict:
    proc, wall = _run(["bench", str(out), "--ep", "cuda", "--ctx", contexts, "--steps", str(steps), "--warmup", "8"])
    bench = json.loads((out / "benchmark.json").read_text()) if proc.returncode == 0 else {}
    return {"exit_status": proc.returncode, "wall_s": round(wall, 1),
            "decode_ms": {str(r["ctx"]): round(r["decode_ms_median"], 4) for r in bench.get("decode", [])},
            "decode_ms_p90": {str(r["ctx"]): round(r["decode_ms_p90"], 4) for r in bench.get("decode", [])},
            "settings": bench.get("settings"), "error": proc.stderr.strip()[-1500:] if proc.returncode else None}


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or a REAL_MODELS name")
    parser.add_argument("--ctx", default="128,2048")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument("--fp16-baseline", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/int4-activations"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    checkpoint = args.model
    if not Path(checkpoint).is_dir():
        from real_model import real_checkpoint

        checkpoint = str(real_checkpoint(checkpoint))
    gpu = None
    try:
        import torch

        gpu = torch.cuda.get_device_name(0)
    except Exception:
        pass
    result = {"benchmark": "int4_activations", "command": " ".join(["python3", *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "onnxruntime": ort.__version__, "gpu": gpu, "python": platform.python_version(), "model": args.model}
    work = args.work / Path(args.model).name
    default = _export(checkpoint, work / "int4-default", "int4", [], not args.no_validate)
    result["default"] = default
    print(f"default int4: {default['activations']} ({default['activations_chosen'].get('why')}), "
          f"{default['wall_s']} s, {default['status']}", flush=True)
    args.out.write_text(json.dumps(result, indent=2))
    other = {"fp16": "bf16", "bf16": "fp16"}.get(default["activations"])
    if other:
        result["other"] = _export(checkpoint, work / f"int4-{other}", "int4", ["--quant-activations", other], False)
        print(f"int4 {other}: {result['other']['wall_s']} s", flush=True)
    if args.fp16_baseline:
        result["fp16"] = _export(checkpoint, work / "fp16", "fp16", [], False)
        print(f"fp16: {result['fp16']['wall_s']} s", flush=True)
        result["int4_over_fp16_export"] = round(default["wall_s"] / result["fp16"]["wall_s"], 3)
        shutil.rmtree(work / "fp16", ignore_errors=True)  # timed, not benched: its disk goes back
    args.out.write_text(json.dumps(result, indent=2))
    for key, folder in (("default", "int4-default"), ("other", f"int4-{other}")):
        if key in result and result[key]["exit_status"] in (0, 2):  # 2: quarantined, still benchable
            result[key]["bench"] = _bench(work / folder, args.ctx, args.steps)
            print(f"bench {key}: {result[key]['bench']['decode_ms']} (exit {result[key]['bench']['exit_status']})", flush=True)
            args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
