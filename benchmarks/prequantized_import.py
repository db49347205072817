"""GPTQ / AWQ checkpoints exported with their codes imported: logits against the checkpoint's own
forward in transformers, on a real model.

    python benchmarks/prequantized_import.py --checkpoint DIR [--checkpoint DIR ...] \
        --quantizer-python /path/to/python-with-gptqmodel --out benchmarks/results/prequantized_import.json

Each checkpoint (made by GPTQModel: benchmarks/prequantized_quantizer.py make) is exported three ways
on the CPU: int4 / int8 keeping its codes at accuracy level 0 (fp32 activations), the same at the CPU
default level 4 (int8 activations), and fp32 with its linears dequantized. The quantizer's Python
computes the references (benchmarks/prequantized_quantizer.py logits: transformers through
GPTQModel's own module, and through float linears of that module's own ``dequantize_weight()`` with
fp32 scales) over windows of exporter/validation/data/quality_text.txt; this process runs each
export in a plain onnxruntime session (one prefill per window) and reports the largest logit
difference over the reference's logit range, argmax agreement, and the weight gate's verdict.
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
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOWS, WINDOW = 4, 128
EXPORTS = {  # label -> (dtype from the checkpoint's bits, quant spec)
    "imported, fp32 activations (accuracy_level 0)": {"accuracy_level": 0},
    "imported, cpu default (accuracy_level 4: int8 activations)": {},
    "dequantized fp32": None,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, action="append", required=True)
    parser.add_argument("--quantizer-python", required=True, help="a Python with gptqmodel and optimum installed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()

    import onnxruntime
    from transformers import AutoTokenizer

    from benchmarks.quant_quality import RawPrefill
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest, QuantSpec
    from exporter.validation.gates.weights import weight_integrity

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="prequantized-"))
    work.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "exporter/validation/data/quality_text.txt").read_text()
    results = {}
    for checkpoint in args.checkpoint:
        config = json.loads((checkpoint / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        ids = tokenizer(text).input_ids
        windows = [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(WINDOWS)]
        (work / "ids.json").write_text(json.dumps(windows))
        npz = work / f"{checkpoint.name}.npz"
        t0 = time.perf_counter()
        made = subprocess.run([args.quantizer_python, str(ROOT / "benchmarks/prequantized_quantizer.py"), "logits",
                               "--checkpoint", str(checkpoint), "--ids", str(work / "ids.json"), "--out", str(npz)],
                              check=True, capture_output=True, text=True)
        reference_s = time.perf_counter() - t0
        modules = json.loads(made.stdout.strip().splitlines()[-1])
        reference = np.load(npz)
        fmt = Checkpoint(checkpoint).prequantized
        dtype = f"int{fmt.bits}"
        heads = config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        entry = {"format": fmt.to_dict(), "made_by": json.loads((checkpoint / "made_by.json").read_text())
                 if (checkpoint / "made_by.json").is_file() else None,
                 "reference_modules": modules, "reference_s": round(reference_s, 1), "exports": {}}
        for label, quant in EXPORTS.items():
            out = work / f"{checkpoint.name}-{len(entry['exports'])}"
            t0 = time.perf_counter()
            request = ExportRequest(model=str(checkpoint), dtype="fp32" if quant is None else dtype, ep="cpu",
                                    variant="attn_dynamic", quant=None if quant is None else QuantSpec(**quant))
            export_model(request, out, validate=False, overwrite=True)
            export_s = time.perf_counter() - t0
            manifest = json.loads((out / "manifest.json").read_text())
            gates, _ = weight_integrity(out / "model.onnx", manifest, Checkpoint(checkpoint), request.dtype.value,
                                        request.activations.value)
            runner = RawPrefill(out / "model.onnx", heads, head_dim)
            figures = {}
            for kind in ("dequantized", "kernel"):
                worst, agree, total = 0.0, 0, 0
                for i, window in enumerate(windows):
                    got, want = runner.logits(window), reference[f"{kind}_{i}"]
                    worst = max(worst, float(np.abs(got - want).max() / np.ptp(want)))
                    agree += int((got.argmax(-1) == want.argmax(-1)).sum())
                    total += len(window)
                figures[kind] = {"max_abs_over_range": worst, "argmax_agreement": round(agree / total, 6)}
            imported = sum(1 for d in (manifest.get("quantization") or {}).get("weights", {}).values() if d.get("imported"))
            entry["exports"][label] = {
                "dtype": request.dtype.value, "quant": quant, "export_s": round(export_s, 2),
                "model_bytes": sum(f.stat().st_size for f in out.glob("model.onnx*")),
                "imported_linears": imported,
                "weight_gate": {g.check: {"passed": g.passed, "measured": g.measured} for g in gates},
                "vs_checkpoint_dequantized_fp32": figures["dequantized"],
                "vs_checkpoint_kernel": figures["kernel"],
            }
            print(checkpoint.name, label, json.dumps(figures), flush=True)
        results[checkpoint.name] = entry
    record = {
        "benchmark": "prequantized_import",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/prequantized_import.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"onnxruntime": onnxruntime.__version__},
        "text": {"file": "exporter/validation/data/quality_text.txt", "windows": WINDOWS, "window_tokens": WINDOW},
        "references": {
            "dequantized": "transformers fp32, every GPTQModel module replaced by a float linear of its own "
                           "dequantize_weight() with fp32 scales (the checkpoint's own dequantization)",
            "kernel": "transformers fp32 through GPTQModel's own CPU module as it loads the checkpoint (it "
                      "dequantizes in the scales' dtype: fp16 / bf16 rounding of each weight)"},
        "target": "max |logit difference| / logit range <= 1e-4 against the checkpoint's own dequantized forward (fp32)",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
