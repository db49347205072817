"""CPU decode beside the onnxruntime-genai builder, in one run: a real model exported in fp32 / int8 / int4
by us and by the builder, every export driven by onnxruntime-genai's own generator (each package's own
genai_config.json: threads, providers), rounds alternating between exports, with file sizes and
quality against the fp32 reference.

The real model is SmolLM2-135M-Instruct (tests/real_model.py: a pinned GGUF from PyPI, dequantized by
transformers). Per export and round: one greedy generation of ``--new-tokens`` after a ``--prompt-tokens``
prompt (min_length = max_length, so no end of sequence cuts it short), prefill = ``append_tokens``,
decode = the median ``generate_next_token`` after ``--warmup`` steps; the figure is the median over
rounds. Quality: teacher-forced next-token agreement and mean KL(reference || export) of every export
against transformers fp32 on the same weights, scored by one code path (benchmarks/quant_quality.py's
``score_export``: a plain session's prefill + the quality gate's ``score``).

    python benchmarks/cpu_matrix.py --out benchmarks/results/cpu_matrix.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OURS = {
    "ours fp32 attn_dynamic": ("fp32", "attn_dynamic"),
    "ours fp32 gqa": ("fp32", "gqa"),
    "ours int8 attn_dynamic": ("int8", "attn_dynamic"),
    "ours int4 attn_dynamic": ("int4", "attn_dynamic"),
    "ours int4 gqa": ("int4", "gqa"),
}
BUILDER = {"genai builder fp32": "fp32", "genai builder int8": "int8", "genai builder int4": "int4"}


def time_generation(model, prompt: list[int], new_tokens: int, warmup: int) -> tuple[float, float]:
    """(prefill ms, median decode ms per token) of one greedy generation through genai's generator."""
    import onnxruntime_genai as og

    total = len(prompt) + new_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    prefill = time.perf_counter() - start
    steps = []
    while not generator.is_done():
        start = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - start)
    return prefill * 1000, float(np.median(steps[warmup:]) * 1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import onnxruntime
    import onnxruntime_genai as og
    import torch
    import transformers

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.gates.quality import WINDOW, reference_logits, text_tokens, windows
    from exporter.validation.reference import load_reference
    from quant_quality import folder_bytes, onnx_census, score_export
    from tests.real_model import GGUF_MEMBER, PACKAGE, real_checkpoint

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cpu-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = real_checkpoint()
    config = json.loads((checkpoint / "config.json").read_text())

    exports: dict[str, Path] = {}
    commands: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for label, (dtype, variant) in OURS.items():
        out = work / label.replace(" ", "_")
        t0 = time.perf_counter()
        export_model(ExportRequest(model=str(checkpoint), dtype=dtype, ep="cpu", variant=variant), out,
                     validate=False, overwrite=True)
        build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label], commands[label] = out, f"exportfarm export --dtype {dtype} --ep cpu --variant {variant}"
    for label, precision in BUILDER.items():
        out = work / label.replace(" ", "_")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(work / "genai_cache")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{label}: builder exited {proc.returncode}: {proc.stderr[-800:]}", flush=True)
            continue
        build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label], commands[label] = out, " ".join(cmd[1:]).replace(str(work), "<work>")

    # Speed: rounds alternate between the exports, so a drift of the machine touches each alike.
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, size=args.prompt_tokens)]
    models = {label: og.Model(str(folder)) for label, folder in exports.items()}
    rounds: dict[str, dict[str, list[float]]] = {label: {"prefill_ms": [], "decode_ms": []} for label in models}
    for r in range(args.rounds):
        for label, model in models.items():
            prefill, decode = time_generation(model, prompt, args.new_tokens, args.warmup)
            rounds[label]["prefill_ms"].append(round(prefill, 3))
            rounds[label]["decode_ms"].append(round(decode, 3))
            print(f"round {r} {label:26s} prefill {prefill:7.2f} ms  decode {decode:6.2f} ms/token", flush=True)
    del models

    # Quality against transformers fp32 on the same weights (one scoring path for every export).
    tokens, how, prefix = text_tokens(checkpoint, config["vocab_size"])
    chunks = windows(tokens, WINDOW, prefix)
    reference = reference_logits(load_reference(checkpoint), chunks)
    results = {}
    for label, folder in exports.items():
        quality = score_export(folder, config, chunks, reference, how)
        results[label] = {
            "decode_ms": float(np.median(rounds[label]["decode_ms"])), "prefill_ms": float(np.median(rounds[label]["prefill_ms"])),
            "rounds": rounds[label], "model_bytes": folder_bytes(folder), **onnx_census(folder / "model.onnx"),
            "agreement": round(quality.agreement, 4), "kl_mean": round(quality.kl_mean, 6),
            "ppl_delta": round(quality.ppl_delta, 6), "build_s": build_s.get(label), "command": commands[label],
        }
        print(f"{label:26s} agree {quality.agreement:.4f}  KL {quality.kl_mean:.4f}  {results[label]['model_bytes'] / 1e6:.0f} MB",
              flush=True)

    def ratio(ours: str, theirs: str, key: str) -> float | None:
        if ours in results and theirs in results:
            return round(results[ours][key] / results[theirs][key], 3)
        return None

    comparison = {f"{o} / {t}": {"decode": ratio(o, t, "decode_ms"), "prefill": ratio(o, t, "prefill_ms"),
                                "bytes": ratio(o, t, "model_bytes")}
                  for o, t in (("ours int4 attn_dynamic", "genai builder int4"), ("ours int4 gqa", "genai builder int4"),
                               ("ours int8 attn_dynamic", "genai builder int8"),
                               ("ours fp32 attn_dynamic", "genai builder fp32"), ("ours fp32 gqa", "genai builder fp32"))}
    record = {
        "benchmark": "cpu_matrix",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/cpu_matrix.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"onnxruntime": onnxruntime.__version__, "onnxruntime_genai": og.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "model": f"SmolLM2-135M-Instruct: {PACKAGE} {GGUF_MEMBER}, dequantized by transformers",
        "how_driven": f"onnxruntime-genai's Generator for every export (its own genai_config.json), greedy, prompt of "
                      f"{args.prompt_tokens} tokens, {args.new_tokens} new, decode = median step after {args.warmup}; "
                      f"{args.rounds} rounds alternating, median over rounds",
        "quality": f"teacher-forced against transformers fp32, {len(chunks)} windows of {WINDOW} ({how})",
        "comparison": comparison,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(comparison, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
