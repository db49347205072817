"""Every mixture-of-experts family through the farm's own gates on CUDA: tiny random checkpoints
(exporter.tiny_checkpoint), exported for ep cuda in each dtype and variant, validated with
``validate=True`` (structure, weights by value, the attention and expert runtime probes on the CUDA
EP, parity against transformers or, quantized, the quality gate). One JSON row per export.

Run on the GPU machine (../shared/gpu/README.md; benchmarks/gpu_env.sh)::

    python3 benchmarks/moe_cuda_gates.py --out $OUT/moe_cuda_gates.json

``--ep cpu`` runs the same matrix on the CPU (the variants and dtypes its kernels take).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (dtype, variant): half precision in both attention forms genai and a static-cache runtime use,
# quantized through GroupQueryAttention (a quantized CUDA export's default variant).
CUDA_CASES = [("fp16", "gqa"), ("bf16", "gqa"), ("fp16", "attn_static"), ("int4", "gqa"), ("int8", "gqa")]
CPU_CASES = [("fp32", "gqa"), ("fp32", "attn_static"), ("fp16", "gqa"), ("int4", "gqa"), ("int8", "attn_dynamic")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-gates"))
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--families", default="")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                        help="a config.json value of the tiny checkpoints, e.g. router_jitter_noise=0.01 (phimoe at "
                             "the threshold of CUDA's own sparse mixer)")
    args = parser.parse_args()
    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--override wants KEY=JSON, got {item!r}")
        overrides[key] = json.loads(value)

    import onnxruntime as ort
    import torch
    import transformers

    from exporter.errors import ExportError, ValidationFailed
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.tiny_checkpoint import MOE_ARCHITECTURES, make_tiny_checkpoint

    if args.ep == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    families = [f for f in args.families.split(",") if f] or list(MOE_ARCHITECTURES)
    cases = CUDA_CASES if args.ep == "cuda" else CPU_CASES
    result = {"benchmark": "moe_cuda_gates", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version()},
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "overrides": overrides, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for arch in families:
        # CUDA's QMoE wants hidden and expert widths in multiples of 64: the tiny experts get 64.
        width = {"moe_intermediate_size": 64} if arch in ("qwen2_moe", "qwen3_moe") else {"intermediate_size": 64}
        source = make_tiny_checkpoint(arch, args.work / "ckpt" / arch, **(width if args.ep == "cuda" else {}),
                                      **overrides)
        for dtype, variant in cases:
            if arch == "gpt_oss" and variant != "gqa":
                continue  # attention sinks: GroupQueryAttention only (refused otherwise, tested on the CPU)
            row = {"arch": arch, "dtype": dtype, "variant": variant}
            out = args.work / "exports" / f"{arch}-{dtype}-{variant}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            try:
                request = ExportRequest(model=str(source), dtype=dtype, ep=args.ep, variant=variant,
                                        static_cache=variant == "attn_static", max_seq_len=128)
                export_model(request, out, validate=True)
                row["status"] = "passed"
            except ValidationFailed as err:
                row["status"] = "failed"
                row["failed"] = str(err)[-1500:]
            except ExportError as err:
                row["status"] = "refused"
                row["failed"] = str(err)[-1500:]
            except Exception as err:  # a crash is a finding, recorded with the rest
                row["status"] = "error"
                row["failed"] = "".join(traceback.format_exception_only(err))[-1500:]
            row["seconds"] = round(time.perf_counter() - start, 1)
            report = out / "parity_report.json"
            if report.is_file():
                gates = json.loads(report.read_text())["gates"]
                row["gates"] = {g["check"]: {"status": g["status"], "measured": g["measured"]} for g in gates
                                if g["gate"] in ("runtime", "parity", "quality", "weights")}
            result["rows"].append(row)
            print(f"{arch:11s} {dtype:5s} {variant:12s} {row['status']} {row.get('failed', '')[:300]}", flush=True)
            args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    counts = {}
    for row in result["rows"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    result["summary"] = counts
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
