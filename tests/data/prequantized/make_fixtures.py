"""Makes the GPTQ / AWQ fixtures of tests/test_prequantized.py with GPTQModel itself (run by hand, by
a Python that has gptqmodel, optimum and this repository's requirements; see README.md here):

    python tests/data/prequantized/make_fixtures.py [NAME ...]

A random fp16 tiny llama (exporter/tiny_checkpoint.py, seed 0) with the tiny tokenizer, quantized by
GPTQModel five ways, each saved as GPTQModel saves it, beside ``logits.npz``: transformers' logits of
IDS through GPTQModel's own modules (``kernel``) and through float linears of their own
``dequantize_weight()`` with fp32 scales (``dequantized``): benchmarks/prequantized_quantizer.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

# name -> (arguments of benchmarks/prequantized_quantizer.py make, tiny llama overrides). GPTQModel's
# AWQ clip search takes output widths in multiples of 64: 4 kv heads of 16 there.
FIXTURES = {
    "gptq-4bit-sym": (["--method", "gptq"], {}),
    "gptq-4bit-asym": (["--method", "gptq", "--asymmetric"], {}),
    "gptq-8bit-sym": (["--method", "gptq", "--bits", "8"], {}),
    "gptq-4bit-act-order": (["--method", "gptq", "--desc-act"], {}),
    "awq-4bit": (["--method", "awq"], {"num_key_value_heads": 4}),
}
IDS = [[1, 17, 42, 99, 7, 130, 64, 3, 200, 88, 12, 150], [1, 5, 6, 7, 8, 9]]


def main() -> None:
    from exporter.tiny_checkpoint import make_tiny_checkpoint, make_tiny_tokenizer

    quantizer = ROOT / "benchmarks" / "prequantized_quantizer.py"
    names = sys.argv[1:] or list(FIXTURES)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(IDS))
        for name in names:
            extra, overrides = FIXTURES[name]
            source = make_tiny_checkpoint("llama", Path(tmp) / name, dtype="float16", **overrides)
            make_tiny_tokenizer(source)
            out = HERE / name
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run([sys.executable, str(quantizer), "make", "--source", str(source), "--out", str(out),
                            "--calibration", str(ROOT / "exporter/validation/data/quality_text.txt"),
                            "--samples", "16", "--window", "64", *extra], check=True)
            for extra_file in ("quant_log.csv", "generation_config.json"):
                (out / extra_file).unlink(missing_ok=True)
            subprocess.run([sys.executable, str(quantizer), "logits", "--checkpoint", str(out),
                            "--ids", str(Path(tmp) / "ids.json"), "--out", str(out / "logits.npz")], check=True)


if __name__ == "__main__":
    main()
