"""The hand-built export beside the traced one (transformers.exporters, the fallback) of the same checkpoint, same run
(issue 47): decode ms/token at a context, prefill of that context, export time and graph size.

    python benchmarks/traced_speed.py --geometry deepseek-v3 --layers 2 --ep cuda --out results.json

The checkpoint: a depth-truncated random-weight bf16 checkpoint of a real geometry (exporter/geometries.py: the real
hidden size, heads, latent ranks, experts and vocabulary), built by transformers' model class
(benchmarks/scale.py build_with_transformers). DeepSeek-V3's first three layers are dense, so 2 layers measure its
latent attention alone; GLM-4.5-Air's first is dense, so 2 layers hold one layer of its 128 experts.

The two DeepSeek-V3 graphs cache different things: ours the absorbed latent (one KV head of kv_lora_rank +
qk_rope_head_dim = 576, kept as keys and again as values), transformers' trace the normed latent as keys (512) and the
rotary key as values (64), expanding the latent to every head's keys and values again at every step. Each export's
record says its cache (``cache``: heads, key and value head sizes, values a token adds per layer; exporter.contract).

Both builders export attn_dynamic (the one contract a traced graph has) in the EP's dtype (cuda fp16, cpu fp32);
for cuda also ours in gqa, the variant a cuda export gets by default. Every export is driven by the project's one
driver (exporter.runtime.session.Decoder: IO binding, caches kept on the device between steps, no CUDA graph: a
dynamic cache grows), exports alternating over ``--rounds``; the figures are medians. The two builders' prefill
logits are compared (the same model, so they must agree to the dtype's rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def export(source: Path, out: Path, builder: str, dtype: str, ep: str, variant: str, buffer: int) -> dict:
    """Export (or, where an earlier ``--export-only`` call of this run left one, take it: the device's calls are
    10 minutes each, a 3.7B-parameter fp32 pair needs two) and describe the graph."""
    record = out.parent / f"{out.name}.export.json"
    if record.is_file():
        return json.loads(record.read_text())
    result = _export(source, out, builder, dtype, ep, variant, buffer)
    record.write_text(json.dumps(result))
    return result


def _export(source: Path, out: Path, builder: str, dtype: str, ep: str, variant: str, buffer: int) -> dict:
    import onnx

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    request = ExportRequest(model=str(source), dtype=dtype, ep=ep, variant=variant, builder=builder, max_seq_len=buffer)
    start = time.perf_counter()
    try:
        export_dir = export_model(request, out, validate=False, overwrite=True).out_dir
    except Exception as err:  # the finding is which builder cannot, and why
        return {"builder": builder, "variant": variant, "error": f"{type(err).__name__}: {str(err)[:600]}"}
    graph = onnx.load(str(export_dir / "model.onnx"), load_external_data=False).graph
    ops: dict[str, int] = {}
    for node in graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return {"builder": builder, "variant": variant, "dir": str(export_dir), "export_s": round(time.perf_counter() - start, 1),
            "nodes": len(graph.node), "ops": dict(sorted(ops.items())),
            "bytes": sum(f.stat().st_size for f in export_dir.glob("model.onnx*")), "cache": cache_of(export_dir)}


def cache_of(export_dir: Path) -> dict:
    """The export's cache as its metadata says (keys and values may differ in head size: contract.VALUE_HEAD_DIM)."""
    from exporter import contract
    from exporter.runtime.session import read_metadata

    config = read_metadata(export_dir / contract.MODEL_FILE)["config"]
    heads, key, value = config["num_kv_heads"], config["head_dim"], contract.value_head_dim(config)
    return {"num_kv_heads": heads, "head_dim": key, contract.VALUE_HEAD_DIM: value,
            "values_per_token_per_layer": heads * (key + value)}


def measure(export_dir: str, ep: str, prompt: np.ndarray, steps: int, warmup: int) -> tuple[dict, np.ndarray]:
    from exporter.runtime.session import Decoder

    lm = Decoder(Path(export_dir), ep)
    context = prompt.shape[1]
    buffer = context + warmup + steps + 8
    caches = lm.new_caches(buffer)
    elapsed, logits = lm.prefill_bound(prompt, caches, buffer)
    prefill_logits = np.asarray(lm.to_host(logits), np.float32)[0, -1]
    times, _ = lm.decode_bound(caches, context, buffer, steps, warmup)
    del lm
    return {"prefill_ms": round(elapsed * 1000, 2), "decode_ms_median": round(statistics.median(times), 3)}, prefill_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", nargs="+", default=["deepseek-v3", "glm-4.5-air"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ep", nargs="+", default=["cuda"], choices=["cpu", "cuda"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/traced-speed"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--export-only", action="store_true",
                        help="build and export, measure nothing (a later call without it measures those exports)")
    args = parser.parse_args()

    import onnxruntime as ort
    import torch
    import transformers

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from benchmarks.scale import build_with_transformers

    results = {"benchmark": "traced_speed", "command": "python benchmarks/traced_speed.py " + " ".join(sys.argv[1:]),
               "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "versions": {"onnxruntime": ort.__version__, "transformers": transformers.__version__,
                            "torch": torch.__version__, "python": platform.python_version()},
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "runs": []}
    for geometry in args.geometry:
        source = build_with_transformers(geometry, [args.layers], args.work)[args.layers]
        for ep in args.ep:
            dtype = "fp16" if ep == "cuda" else "fp32"
            buffer = args.context + args.warmup + args.steps + 8
            plans = [("hand", "attn_dynamic"), ("traced", "attn_dynamic")] + ([("hand", "gqa")] if ep == "cuda" else [])
            exports = [export(source, args.work / f"{geometry}-{ep}-{b}-{v}", b, dtype, ep, v, buffer) for b, v in plans]
            if args.export_only:
                print(json.dumps([{k: v for k, v in e.items() if k not in ("ops", "dir")} for e in exports]), flush=True)
                continue
            run = {"geometry": geometry, "layers": args.layers, "ep": ep, "dtype": dtype, "context": args.context,
                   "steps": args.steps, "rounds": args.rounds, "exports": exports}
            prompt = np.random.default_rng(0).integers(3, 1000, size=(1, args.context))
            rounds: dict[int, list[dict]] = {i: [] for i in range(len(exports))}
            logits: dict[int, np.ndarray] = {}
            for _ in range(args.rounds):
                for i, e in enumerate(exports):
                    if "error" in e:
                        continue
                    try:
                        figures, logits[i] = measure(e["dir"], ep, prompt, args.steps, args.warmup)
                        rounds[i].append(figures)
                    except Exception as err:
                        e["run_error"] = f"{type(err).__name__}: {str(err)[:600]}"
            for i, e in enumerate(exports):
                if rounds[i]:
                    e["decode_ms"] = [r["decode_ms_median"] for r in rounds[i]]
                    e["prefill_ms"] = [r["prefill_ms"] for r in rounds[i]]
                    e["decode_ms_median"] = statistics.median(e["decode_ms"])
                    e["prefill_ms_median"] = statistics.median(e["prefill_ms"])
                    e["decode_ms_spread"] = [min(e["decode_ms"]), max(e["decode_ms"])]
            if 0 in logits and 1 in logits:
                spread = float(logits[0].max() - logits[0].min())
                run["prefill_logits_hand_vs_traced"] = {
                    "max_abs_difference": float(np.abs(logits[0] - logits[1]).max()), "logit_range": spread,
                    "same_argmax": int(logits[0].argmax()) == int(logits[1].argmax())}
            # other work on the machine shows here (the CPU figures share its cores with whatever else runs)
            run["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "exports"}), flush=True)
            for e in exports:
                print(json.dumps({k: v for k, v in e.items() if k not in ("ops", "dir")}), flush=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
