"""Image-text exports on CUDA (issue 48): each tiny image-text checkpoint exported for cuda in fp16 and bf16 and put
through the pipeline's own validation on the GPU (vision features, merged embeddings, end-to-end greedy tokens
against transformers' fp32 generate: exporter/validation/image_text.py), every figure kept.

    python benchmarks/vlm_cuda.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=["gemma3", "llava", "smolvlm", "qwen2_5_vl"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--variants", nargs="+", default=["gqa", "attn_dynamic"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlm-cuda"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import onnxruntime as ort

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    results = {"benchmark": "vlm_cuda", "command": "python benchmarks/vlm_cuda.py " + " ".join(sys.argv[1:]),
               "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "onnxruntime": ort.__version__, "runs": []}
    for case in args.cases:
        source = make_tiny_vlm_checkpoint(case, args.work / "ckpt" / case)
        for dtype in args.dtypes:
            for variant in args.variants:
                run = {"case": case, "dtype": dtype, "variant": variant}
                out = args.work / f"{case}-{dtype}-{variant}"
                shutil.rmtree(out, ignore_errors=True)  # a report left by an earlier run is not this run's
                try:
                    export_model(ExportRequest(model=str(source), dtype=dtype, ep="cuda", variant=variant,
                                               max_seq_len=192), out, validate=True, overwrite=True)
                except Exception as err:  # a failed validation raises with the report's verdict: keep what it says
                    run["error"] = f"{type(err).__name__}: {str(err)[:800]}"
                    traceback.print_exc(limit=2)
                report_file = out / "parity_report.json"
                if report_file.is_file():  # written whether validation passed or not: every figure kept
                    report = json.loads(report_file.read_text())
                    run.update(status=report["status"], failed_gates=report["failed_gates"],
                               components=report.get("components"))
                results["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "components"}), flush=True)
                args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
