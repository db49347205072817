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
``score_export``: a plain session's prefill + the quality gate's ``score``), and again one token at a
time through the KV cache (``decode_steps``: int8-activation kernels quantize the two apart).
Thread control: each package's genai_config.json as written, plus copies with the thread setting of
the other package (THREAD_CONTROL), so what the graphs do and what the setting does are told apart.

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

OURS = {  # label: (dtype, variant, quant options)
    "ours fp32 attn_dynamic": ("fp32", "attn_dynamic", None),
    "ours fp32 gqa": ("fp32", "gqa", None),
    "ours int8 attn_dynamic": ("int8", "attn_dynamic", None),
    "ours int4 attn_dynamic": ("int4", "attn_dynamic", None),
    "ours int4 gqa": ("int4", "gqa", None),
    # the exact alternative: fp32 activations (accuracy level 0), as the CPU default was before issue 30
    "ours int4 gqa accuracy_level=0": ("int4", "gqa", {"accuracy_level": 0}),
}
BUILDER = {"genai builder fp32": "fp32", "genai builder int8": "int8", "genai builder int4": "int4"}
# Thread control: our CPU packages write intra_op_num_threads 0 (onnxruntime's count, a thread per
# physical core; exporter/packaging/genai.py) and the builder's write none (genai's half of the
# logical CPUs). These copies swap the two, so the graphs compare at either setting.
THREAD_CONTROL = {"ours int4 gqa": None, "ours fp32 gqa": None, "genai builder int4": 0, "genai builder fp32": 0}


def with_threads(folder: Path, out: Path, threads: int | None) -> Path:
    """``folder`` with genai_config.json's session_options.intra_op_num_threads set to ``threads``
    (None: removed, genai's default); the other files linked, not copied."""
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "genai_config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.pop("intra_op_num_threads", None)
    if threads is not None:
        options["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


def thread_label(label: str, threads: int | None) -> str:
    return f"{label} threads={'genai default' if threads is None else threads}"


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
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a real model of tests/real_model.py: smollm2-135m-instruct, gemma3-270m, qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--no-thread-control", action="store_true", help="leave out the thread-control copies")
    parser.add_argument("--no-bare-session", action="store_true",
                        help="leave out the bare-session drive (decode_check.py, IO binding) of the gqa graphs")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import onnxruntime
    import onnxruntime_genai as og
    import torch
    import transformers

    from exporter.reports.bench_report import cpu_markdown
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.gates.quality import WINDOW, reference_logits, text_tokens, windows
    from exporter.validation.reference import load_reference
    from quant_quality import folder_bytes, onnx_census, score_export_ways
    from tests.real_model import REAL_MODELS, real_checkpoint

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cpu-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model not in REAL_MODELS:
        parser.error(f"unknown --model {args.model!r}: use one of {', '.join(REAL_MODELS)}")
    spec = REAL_MODELS[args.model]
    checkpoint = real_checkpoint(args.model)
    config = json.loads((checkpoint / "config.json").read_text())

    exports: dict[str, Path] = {}
    commands: dict[str, str] = {}
    build_s: dict[str, float] = {}
    failed: dict[str, str] = {}  # exports that could not be built, with the tool's own words
    for label, (dtype, variant, quant) in OURS.items():
        out = work / label.replace(" ", "_").replace("=", "")
        t0 = time.perf_counter()
        export_model(ExportRequest(model=str(checkpoint), dtype=dtype, ep="cpu", variant=variant, quant=quant), out,
                     validate=False, overwrite=True)
        build_s[label] = round(time.perf_counter() - t0, 2)
        options = "".join(f" --quant-{k.replace('_', '-')} {v}" for k, v in (quant or {}).items())
        exports[label], commands[label] = out, f"exportfarm export --dtype {dtype} --ep cpu --variant {variant}{options}"
    for label, precision in BUILDER.items():
        out = work / label.replace(" ", "_")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(work / "genai_cache")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            failed[label] = f"builder exited {proc.returncode}: {proc.stderr.strip()[-800:]}"
            print(f"{label}: {failed[label]}", flush=True)
            continue
        build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label], commands[label] = out, " ".join(cmd[1:]).replace(str(work), "<work>")

    if not args.no_thread_control:
        for label, threads in THREAD_CONTROL.items():
            if label in exports:
                copy = thread_label(label, threads)
                exports[copy] = with_threads(exports[label], work / copy.replace(" ", "_").replace("=", ""), threads)
                commands[copy] = f"{commands[label]}; genai_config.json session_options.intra_op_num_threads " + (
                    "removed" if threads is None else f"= {threads}")

    # Speed: rounds alternate between the exports, so a drift of the machine touches each alike.
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, size=args.prompt_tokens)]
    models = {label: og.Model(str(folder)) for label, folder in exports.items()}
    rounds: dict[str, dict[str, list[float]]] = {label: {"prefill_ms": [], "decode_ms": []} for label in models}
    for r in range(args.rounds):
        for label, model in models.items():
            time.sleep(0.5)  # the previous package's idle threads stop spinning before this one runs
            prefill, decode = time_generation(model, prompt, args.new_tokens, args.warmup)
            rounds[label]["prefill_ms"].append(round(prefill, 3))
            rounds[label]["decode_ms"].append(round(decode, 3))
            print(f"round {r} {label:26s} prefill {prefill:7.2f} ms  decode {decode:6.2f} ms/token", flush=True)
    del models

    # The same GroupQueryAttention graphs, ours and the builder's, driven by a bare onnxruntime session
    # with IO binding (benchmarks/decode_check.py: no exporter code, onnxruntime's own thread default,
    # past and present bound to one buffer, the mask growing as genai's does): the graphs compared
    # without either runtime's settings.
    bare_labels = [label for label in exports if "threads=" not in label
                   and (label.startswith("genai builder") or " gqa" in label)]
    bare: dict[str, list[float]] = {label: [] for label in bare_labels}
    if not args.no_bare_session:
        import decode_check

        for r in range(args.rounds):
            for label in bare_labels:
                time.sleep(0.5)
                ms = decode_check.measure(exports[label], graph=False, buffer=args.prompt_tokens + args.new_tokens + 8,
                                          ctx=args.prompt_tokens, steps=args.new_tokens - args.warmup,
                                          warmup=args.warmup, ep="cpu")
                bare[label].append(round(ms, 3))
                print(f"round {r} {label:26s} bare session decode {ms:6.2f} ms/token", flush=True)

    # Quality against transformers fp32 on the same weights (one scoring path for every export).
    tokens, how, prefix = text_tokens(checkpoint, config["vocab_size"])
    chunks = windows(tokens, WINDOW, prefix)
    reference = reference_logits(load_reference(checkpoint), chunks)
    results = {}
    scored: dict[Path, tuple] = {}
    for label, folder in exports.items():
        key = folder.joinpath("model.onnx").resolve()  # a thread-control copy scores as its source
        if key not in scored:
            scored[key] = tuple(score_export_ways(folder, config, chunks, reference, how, ("prefill", "decode")))
        quality, decoded = scored[key]
        results[label] = {
            "decode_ms": float(np.median(rounds[label]["decode_ms"])), "prefill_ms": float(np.median(rounds[label]["prefill_ms"])),
            "rounds": rounds[label], "model_bytes": folder_bytes(folder), **onnx_census(folder / "model.onnx"),
            "agreement": round(quality.agreement, 4), "kl_mean": round(quality.kl_mean, 6),
            "ppl_delta": round(quality.ppl_delta, 6),
            "decode_steps": {"agreement": round(decoded.agreement, 4), "kl_mean": round(decoded.kl_mean, 6),
                             "ppl_delta": round(decoded.ppl_delta, 6)},
            "build_s": build_s.get(label), "command": commands[label],
        }
        if bare.get(label):
            results[label]["bare_session_decode_ms"] = float(np.median(bare[label]))
            results[label]["bare_session_rounds"] = bare[label]
        print(f"{label:26s} agree {quality.agreement:.4f}  KL {quality.kl_mean:.4f}  decode-path agree "
              f"{decoded.agreement:.4f} KL {decoded.kl_mean:.4f}  {results[label]['model_bytes'] / 1e6:.0f} MB", flush=True)

    def ratio(ours: str, theirs: str, key: str) -> float | None:
        if ours in results and theirs in results:
            return round(results[ours][key] / results[theirs][key], 3)
        return None

    comparison = {f"{o} / {t}": {"decode": ratio(o, t, "decode_ms"), "prefill": ratio(o, t, "prefill_ms"),
                                "bytes": ratio(o, t, "model_bytes")}
                  for o, t in (("ours int4 attn_dynamic", "genai builder int4"), ("ours int4 gqa", "genai builder int4"),
                               ("ours int4 gqa accuracy_level=0", "genai builder int4"),
                               ("ours int8 attn_dynamic", "genai builder int8"),
                               ("ours fp32 attn_dynamic", "genai builder fp32"), ("ours fp32 gqa", "genai builder fp32"),
                               ("ours int4 gqa", thread_label("genai builder int4", 0)),
                               ("ours fp32 gqa", thread_label("genai builder fp32", 0)),
                               (thread_label("ours int4 gqa", None), "genai builder int4"),
                               (thread_label("ours fp32 gqa", None), "genai builder fp32"))
                  if o in results and t in results}
    for o, t in (("ours int4 gqa", "genai builder int4"), ("ours fp32 gqa", "genai builder fp32")):
        if "bare_session_decode_ms" in results.get(o, {}) and "bare_session_decode_ms" in results.get(t, {}):
            comparison[f"{o} / {t}"]["bare_session_decode"] = ratio(o, t, "bare_session_decode_ms")
    record = {
        "benchmark": "cpu_matrix",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/cpu_matrix.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"onnxruntime": onnxruntime.__version__, "onnxruntime_genai": og.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "model": f"{spec.note}: {', '.join(f'{package} {member}' for package, member in spec.parts)}, "
                 "dequantized by transformers",
        "how_driven": f"onnxruntime-genai's Generator for every export (its own genai_config.json), greedy, prompt of "
                      f"{args.prompt_tokens} tokens, {args.new_tokens} new, decode = median step after {args.warmup}; "
                      f"{args.rounds} rounds alternating, median over rounds; bare_session_decode_ms: the gqa graphs "
                      "(ours and the builder's) in a bare onnxruntime session with IO binding "
                      "(benchmarks/decode_check.py, onnxruntime's default threads; its own random prompt of the same "
                      "length), same steps",
        "quality": f"teacher-forced against transformers fp32, {len(chunks)} windows of {WINDOW} ({how}): each window "
                   f"as one prefill (the quality gate's way: agreement, kl_mean, ppl_delta) and one token at a time "
                   f"through the KV cache (decode_steps: what a generator's decode computes)",
        "comparison": comparison,
        "results": results,
        "failed_exports": failed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(cpu_markdown(record))
    print(json.dumps(comparison, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
