"""A user's default int4 request on real models: passed, or failed saying which int4 would; then that advice.

For each model (``tests/real_model.py``'s REAL_MODELS; default the two Qwen2.5-Coder instruct models, 0.5B and
1.5B), as a user would run it:

1. ``exportfarm export --model M --dtype int4 --ep EP --out DIR`` with every quant option at its default,
   validated: its status, the quality gate's figures and, when the gate fails, the advice its message gives
   (``exporter/validation/quant_advice.py``: other recipes measured on the model by simulation) with every
   recipe it measured;
2. when there is advice, the same command with the advised options, validated the same way;
3. onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -p int4 -e EP``, its
   defaults) on the same checkpoint, for the size beside ours (``--no-builder`` skips it).

Each step runs in a process of its own; sizes are model.onnx.data (ours) and the builder's .onnx.data. Writes
one JSON with the commands, the versions and the machine::

    python benchmarks/int4_default.py --out benchmarks/results/int4_default_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _export(checkpoint: Path, out: Path, ep: str, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "export", "--model", str(checkpoint), "--dtype", "int4", "--ep", ep,
           "--out", str(out), "--overwrite", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    report = json.loads((out / "parity_report.json").read_text()) if (out / "parity_report.json").is_file() else {}
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    quality = report.get("quality") or {}
    failed = [g for g in report.get("gates", []) if g["status"] == "fail"]
    return {
        "command": "exportfarm " + " ".join(shlex.quote(c) for c in cmd[3:]).replace(str(checkpoint), "<checkpoint>")
                   .replace(str(out), "<out>"),
        "exit_status": proc.returncode, "wall_s": round(wall, 1), "status": manifest.get("status"),
        "bytes": (out / "model.onnx.data").stat().st_size if (out / "model.onnx.data").is_file() else None,
        "quality": {k: quality.get(k) for k in ("kl_mean", "agreement", "ppl_delta", "agreement_all", "positions",
                                                "tokenizer")},
        "failed": [{"check": g["check"], "measured": g["measured"], "threshold": g["threshold"], "message": g["message"]}
                   for g in failed],
        "advice": quality.get("advice"),
        "timings_s": report.get("timings_s"),
        "stderr_tail": proc.stderr.strip()[-600:] if proc.returncode not in (0, 2) else None,
    }


def _advised_flags(advice: dict) -> list[str] | None:
    chosen = (advice or {}).get("advice")
    return shlex.split(chosen["cli"]) if chosen else None


def _builder(checkpoint: Path, out: Path, ep: str, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out), "-p", "int4",
           "-e", ep, "-c", str(cache)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    data = sorted(out.glob("*.onnx.data")) + sorted(out.glob("*.onnx_data"))
    return {"command": " ".join(cmd[1:]).replace(str(checkpoint), "<checkpoint>").replace(str(out), "<out>"),
            "exit_status": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
            "bytes": sum(p.stat().st_size for p in data) if data else None,
            "stderr_tail": proc.stderr.strip()[-600:] if proc.returncode else None}


def main() -> None:
    from real_model import REAL_MODELS, real_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--ep", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/int4-default"))
    parser.add_argument("--no-builder", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import onnxruntime
    import transformers

    results = {"benchmark": "int4_default", "command": ["python", *sys.argv],
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"nproc": os.cpu_count(), "python": platform.python_version()},
               "versions": {"onnxruntime": onnxruntime.__version__, "transformers": transformers.__version__},
               "ep": args.ep, "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        checkpoint = real_checkpoint(name)
        entry = {"source": REAL_MODELS[name].note}
        work = args.work / name
        print(f"{name}: default int4", flush=True)
        entry["default"] = _export(checkpoint, work / "default", args.ep, [])
        flags = _advised_flags(entry["default"]["advice"])
        if flags:
            print(f"{name}: advised {' '.join(flags)}", flush=True)
            dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else None
            rest = [f for i, f in enumerate(flags) if f != "--dtype" and (i == 0 or flags[i - 1] != "--dtype")]
            advised = _export(checkpoint, work / "advised", args.ep, rest) if dtype is None else None
            if dtype is not None:  # another width: the --dtype flag replaces int4
                cmd_flags = rest
                advised = _export_dtype(checkpoint, work / "advised", args.ep, dtype, cmd_flags)
            entry["advised"] = advised
        if not args.no_builder:
            print(f"{name}: genai builder int4", flush=True)
            entry["genai_builder_int4"] = _builder(checkpoint, work / "builder", args.ep, work / "builder-cache")
        results["models"][name] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({n: {k: (v or {}).get("status") for k, v in e.items() if isinstance(v, dict)}
                      for n, e in results["models"].items()}, indent=1))


def _export_dtype(checkpoint: Path, out: Path, ep: str, dtype: str, flags: list[str]) -> dict:
    """``_export`` with another --dtype (advice that no int4 passes)."""
    result = _export(checkpoint, out, ep, ["--dtype", dtype, *flags])
    result["command"] = result["command"].replace("--dtype int4 ", "")
    return result


if __name__ == "__main__":
    main()
