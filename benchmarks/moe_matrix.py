"""Mixture-of-experts decode on the GPU: our fused expert ops (MoE / QMoE) against the all-experts
form (mobius's export of the same checkpoint: every expert on every token) and the onnxruntime-genai
builder's export, each driven the way its runtime drives it: onnxruntime-genai's generator reading
the package's own genai_config.json (every one of the three is a genai package), greedy, same run,
rounds alternating between exports.

Production geometries (exporter.geometries) are cut to a few decoder layers so checkpoint and
exports fit the machine's disk; each is measured at two depths and extrapolated per layer to the
real depth: ms(L) = ms(a) + (L - a) * (ms(b) - ms(a)) / (b - a).

Run on the GPU machine (../shared/gpu/README.md; benchmarks/gpu_env.sh)::

    python3 benchmarks/moe_matrix.py --model qwen3-30b-a3b --depths 1,3 --dtypes fp16,int4 \
        --peers mobius --out $OUT/moe_qwen3.json
    python3 benchmarks/moe_matrix.py --model gpt-oss-20b --depths 1,3 --dtypes fp16,int4 \
        --peers genai --out $OUT/moe_gpt_oss.json

Random bf16 weights are made on the device from the config (nothing that large travels); the JSON
is written after every step, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_matrix  # noqa: E402  (its Recorder and placeholder tokenizer)

T0 = time.perf_counter()
# Model types onnxruntime-genai 0.18 runs as decoder-only LLMs (its model_type.h).
GENAI_TYPES = {"decoder", "llama", "mistral", "qwen2", "qwen3", "phi3", "phimoe", "gemma2", "gemma3_text", "granite",
               "smollm3", "gpt_oss", "olmo", "phi", "gemma", "chatglm", "nemotron", "ernie4_5"}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class Recorder(gpu_matrix.Recorder):
    """gpu_matrix's result JSON (written after every update), errors also logged as they come."""

    def error(self, where: str, err: BaseException) -> None:
        super().error(where, err)
        log(f"ERROR {where}: {self.data['errors'][where][:400]}")


def build_checkpoint(name: str, layers: int, directory: Path) -> dict:
    """Random bf16 weights of ``name`` cut to ``layers`` decoder layers, made on the GPU, saved with a
    placeholder tokenizer (genai's generator and builder want one; what it says does not matter)."""
    import torch
    import transformers

    from exporter.geometries import geometry_config

    config = geometry_config(name, layers)
    model_type = config.pop("model_type")
    config.pop("architectures", None)
    config.pop("torch_dtype", None)
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    gpu_matrix.tokenizer_into(directory)
    return {"layers": layers, "bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}


def linked_copy(source: Path, target: Path, rewritten: str) -> None:
    """``target`` (made afresh) with every file of ``source`` hard-linked except ``rewritten``, which
    the caller writes: a variant of a package or checkpoint without copying its weights."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.name != rewritten:
            os.link(f, target / f.name)


def graph_routing_twin(checkpoint: Path, twin: Path) -> Path:
    """The same phimoe checkpoint (weights hard-linked) with router_jitter_noise moved off the CUDA sparse
    mixer's constant by one part in a million: exported for cuda it keeps the sparsemixer in the graph, and
    routes every token the same but at a threshold's exact edge."""
    linked_copy(checkpoint, twin, "config.json")
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "phimoe":
        raise ValueError("--graph-routing-twin is for phimoe geometries")
    config["router_jitter_noise"] = float(config.get("router_jitter_noise", 0.01)) * (1 + 1e-6)
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    return twin


def export_ours(checkpoint: Path, out: Path, dtype: str, max_seq_len: int) -> tuple[Path, str]:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    request = ExportRequest(model=str(checkpoint), dtype=dtype, ep="cuda", variant="gqa", max_seq_len=max_seq_len)
    export_model(request, out, overwrite=True, validate=False)
    return out, f"exportfarm export --model {checkpoint} --dtype {dtype} --ep cuda --variant gqa --max-seq-len {max_seq_len}"


def export_mobius(checkpoint: Path, out: Path, dtype: str) -> tuple[Path, str]:
    """mobius (PyPI mobius-onnx) as its CLI builds a genai package for CUDA."""
    cmd = [sys.executable, "-m", "mobius", "build", "--config", str(checkpoint), "--dtype", {"fp16": "f16", "bf16": "bf16"}[dtype],
           "--ep", "cuda", "--runtime", "ort-genai", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        raise RuntimeError(f"mobius exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2500:]}")
    for f in checkpoint.glob("tokenizer*.json"):
        shutil.copy(f, out / f.name)
    # mobius names the model type after the family (qwen3_moe); onnxruntime-genai 0.18, the newest on
    # PyPI, knows no such type and refuses the package. Its generic decoder-only type runs the graph as is.
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    note = ""
    if config["model"]["type"] not in GENAI_TYPES:
        note = f" (genai_config model.type {config['model']['type']!r} set to 'decoder' for onnxruntime-genai 0.18)"
        config["model"]["type"] = "decoder"
        config_path.write_text(json.dumps(config, indent=2))
    return out, " ".join(cmd[1:]) + note


GENAI_EXTRA: list[str] = []  # --genai-extra: the builder's --extra_options


def export_genai(checkpoint: Path, out: Path, dtype: str) -> tuple[Path, str]:
    """The onnxruntime-genai model builder with its defaults for ``-p dtype -e cuda`` (and --genai-extra)."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out), "-p", dtype,
           "-e", "cuda", "-c", str(out.parent / f"{out.name}-cache")]
    if GENAI_EXTRA and dtype in ("int4", "int8"):
        cmd += ["--extra_options", *GENAI_EXTRA]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        raise RuntimeError(f"builder exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2500:]}")
    shutil.rmtree(out.parent / f"{out.name}-cache", ignore_errors=True)
    return out, " ".join(cmd[1:])


def census(directory: Path) -> dict:
    import onnx

    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return {"nodes": len(model.graph.node), "experts_ops": {k: v for k, v in counts.items() if "MoE" in k},
            "matmuls": sum(v for k, v in counts.items() if "MatMul" in k),
            "bytes": sum(f.stat().st_size for f in directory.glob("*.onnx*"))}


def generate(model, batch: int, ctx: int, steps: int, warmup: int, vocab: int) -> dict:
    """One greedy generation of ``steps`` tokens after a [batch, ctx] prompt through genai's generator:
    (prefill ms, decode ms per step for the steps after ``warmup``, first tokens of row 0)."""
    import onnxruntime_genai as og

    prompt = np.random.default_rng(ctx + batch).integers(3, min(vocab, 60), size=(batch, ctx)).astype(np.int32)
    params = og.GeneratorParams(model)
    total = ctx + warmup + steps + 1
    params.set_search_options(do_sample=False, batch_size=batch, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    prefill = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        generator.generate_next_token()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    tokens = [int(t) for t in generator.get_sequence(0)][ctx : ctx + 8]
    del generator
    return {"prefill_ms": prefill * 1000, "decode_ms": float(np.median(times) * 1000), "tokens": tokens}


def profile_decode(directory: Path, batch: int, ctx: int, steps: int, vocab: int, skip: int = 4) -> dict:
    """onnxruntime's profile of one generation through genai's generator, as the package runs it: a
    linked copy of the package whose genai_config.json sets ``session_options.enable_profiling`` (the
    package itself is never edited). Kernel time per op type and per node over the decode steps after
    the prompt's run and ``skip`` more (first calls tune kernels), microseconds per step, and the
    execution provider each op ran on."""
    import onnxruntime_genai as og

    if steps <= skip + 1:
        raise ValueError(f"profile_decode: {steps} steps leave none after the {skip} skipped")
    copy = directory.parent / f"profiled-{directory.name}"
    linked_copy(directory, copy, "genai_config.json")
    prefix = directory.parent / f"profile-{directory.name}"
    config = json.loads((directory / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["enable_profiling"] = str(prefix)
    (copy / "genai_config.json").write_text(json.dumps(config, indent=2))
    try:
        model = og.Model(str(copy))
        generate(model, batch, ctx, steps, 0, vocab)
        del model  # the session writes its profile as it closes
        gc.collect()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    files = sorted(prefix.parent.glob(f"{prefix.name}*.json"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise RuntimeError(f"no profile written under {prefix}*")
    times = gpu_matrix.kernel_times(json.loads(files[-1].read_text()), first_run=1 + skip)
    decode_runs, run_us = times["runs"], times["run_us"]
    per_step = lambda table, top: {k: round(v / decode_runs, 1) for k, v in  # noqa: E731
                                   sorted(table.items(), key=lambda kv: -kv[1])[:top]}
    return {"batch": batch, "ctx": ctx, "decode_runs": decode_runs, "skipped_decode_runs": times["first_run"] - 1,
            "file": files[-1].name,
            "model_run_us_median": float(np.median(run_us)) if run_us else None,
            "kernel_us_per_step": round(sum(times["by_op"].values()) / decode_runs, 1),
            "op_us_per_step": per_step(times["by_op"], 40), "top_nodes_us_per_step": per_step(times["by_node"], 15),
            "providers": {op: sorted(p) for op, p in times["providers"].items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a geometry of exporter.geometries")
    parser.add_argument("--depths", default="1,3")
    parser.add_argument("--dtypes", default="fp16,int4", help="ours, and the peers' where they build it")
    parser.add_argument("--peers", default="", help="comma-separated: mobius, genai")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--ctx", default="128,2048")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=560, help="stop starting new work after this many seconds")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-matrix"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mxfp4", action="store_true",
                        help="gpt-oss: store the random experts as MXFP4 (_blocks / _scales), as gpt-oss ships; the "
                             "genai builder's int4 reads only those")
    parser.add_argument("--genai-extra", default="", help="space-separated key=value for the builder's --extra_options")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, one profiled generation per export at the first batch and "
                             "context (onnxruntime's profiler through genai_config session_options)")
    parser.add_argument("--graph-routing-twin", action="store_true",
                        help="phimoe: also export the float dtypes with the sparsemixer in the graph (a twin checkpoint "
                             "whose router_jitter_noise is 0.01 x (1 + 1e-6), off the CUDA sparse mixer's constant), "
                             "to time the op's own sparse mixer against the graph's in the same run")
    parser.add_argument("--merge", type=Path, default=None,
                        help="an earlier run's JSON of the same model: its depths join this one's extrapolation")
    args = parser.parse_args()

    import onnxruntime as ort
    import onnxruntime_genai as og
    import torch
    import transformers

    from exporter.geometries import geometry_config

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    GENAI_EXTRA.extend(args.genai_extra.split())
    depths = [int(d) for d in args.depths.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]
    peers = [p for p in args.peers.split(",") if p]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.ctx.split(",")]
    full = geometry_config(args.model)
    rec = Recorder(args.out, {
        "benchmark": "moe_matrix", "model": args.model, "full_layers": full["num_hidden_layers"],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "device": torch.cuda.get_device_name(0),
        "how": "every export is a genai package run by onnxruntime-genai's Generator with its own genai_config.json "
               "(greedy, min_length = max_length); decode ms = median of the timed generate_next_token calls after "
               "the warm-up; rounds alternate between exports; ours: --variant gqa --ep cuda",
        "depths": {}, "exports": {}})
    if args.merge and args.merge.is_file():
        earlier = json.loads(args.merge.read_text())
        rec.data["merged_from"] = {"command": earlier["command"], "date": earlier["date"]}
        rec.data["depths"].update(earlier["depths"])
        for name, entry in earlier["exports"].items():
            rec.data["exports"].setdefault(name, {"command": entry["command"], "by_depth": {}})["by_depth"].update(
                entry["by_depth"])
    max_seq_len = max(contexts) + args.warmup + args.steps + 64
    vocab = full["vocab_size"]
    for depth in depths:
        if time.perf_counter() - T0 > args.budget_s:
            break
        work = args.work / f"{args.model}-L{depth}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        checkpoint = work / "checkpoint"
        log(f"checkpoint {args.model} at {depth} layers")
        try:
            made = build_checkpoint(args.model, depth, checkpoint)
            if args.mxfp4:
                from exporter.tiny_checkpoint import mxfp4_checkpoint

                mxfp4_checkpoint(checkpoint, work / "checkpoint-mxfp4")
                shutil.rmtree(checkpoint)
                (work / "checkpoint-mxfp4").rename(checkpoint)
                made["mxfp4_bytes"] = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
            rec.data["depths"][str(depth)] = {"checkpoint": made, "runs": {}}
        except Exception as err:
            rec.error(f"checkpoint L{depth}", err)
            continue
        rec.save()
        plan = [(f"ours {d} (fused {'QMoE' if d in ('int4', 'int8') else 'MoE'})", export_ours, d, (max_seq_len,))
                for d in dtypes]
        twin = None
        if args.graph_routing_twin:
            twin = graph_routing_twin(checkpoint, work / "checkpoint-graph-routing")
            plan += [(f"ours {d} (sparsemixer in the graph)", export_ours, d, (max_seq_len,)) for d in dtypes
                     if d not in ("int4", "int8")]
        for peer in peers:
            for d in dtypes:
                if peer == "mobius" and d in ("int4", "int8"):
                    continue  # mobius quantizes only checkpoints already GPTQ / AWQ
                plan.append((f"{peer} {d}", export_mobius if peer == "mobius" else export_genai, d, ()))
        built = {}
        for name, fn, dtype, extra in plan:
            if time.perf_counter() - T0 > args.budget_s:
                break
            log(f"export {name}")
            start = time.perf_counter()
            try:
                source = twin if "in the graph" in name else checkpoint
                target = work / name.split(" (")[0].replace(" ", "-")
                if "in the graph" in name:
                    target = target.with_name(target.name + "-graph-routing")
                directory, command = fn(source, target, dtype, *extra)
            except Exception as err:
                rec.error(f"export {name} L{depth}", err)
                continue
            built[name] = directory
            entry = rec.data["exports"].setdefault(name, {"command": command, "by_depth": {}})
            entry["by_depth"][str(depth)] = {"export_s": round(time.perf_counter() - start, 1), **census(directory)}
            rec.save()
        models = {}
        for name, directory in built.items():
            try:
                models[name] = og.Model(str(directory))
            except Exception as err:
                rec.error(f"load {name} L{depth}", err)
        runs = rec.data["depths"][str(depth)]["runs"]
        for r in range(args.rounds):
            for batch in batches:
                for ctx in contexts:
                    for name, model in models.items():
                        if time.perf_counter() - T0 > args.budget_s:
                            break
                        key = f"b{batch} ctx{ctx}"
                        try:
                            got = generate(model, batch, ctx, args.steps, args.warmup, vocab)
                        except Exception as err:
                            rec.error(f"generate {name} L{depth} {key}", err)
                            continue
                        row = runs.setdefault(name, {}).setdefault(key, {"decode_ms": [], "prefill_ms": []})
                        row["decode_ms"].append(round(got["decode_ms"], 3))
                        row["prefill_ms"].append(round(got["prefill_ms"], 1))
                        row["tokens_row0"] = got["tokens"]
                        log(f"L{depth} {name} {key}: decode {got['decode_ms']:.2f} ms, prefill {got['prefill_ms']:.0f} ms")
                        rec.save()
        del models
        gc.collect()
        if args.profile:
            for name, directory in built.items():
                try:
                    rec.data["depths"][str(depth)].setdefault("profile", {})[name] = profile_decode(
                        directory, batches[0], contexts[0], args.steps, vocab)
                    log(f"profiled {name}: {rec.data['depths'][str(depth)]['profile'][name]['op_us_per_step']}")
                except Exception as err:
                    rec.error(f"profile {name} L{depth}", err)
                rec.save()
        shutil.rmtree(work, ignore_errors=True)  # the next depth needs the disk
    summarize(rec)
    return 0


def summarize(rec: Recorder) -> None:
    """Median per export / batch / context at each depth (rounds after the first), and the per-layer
    extrapolation to the real depth from the shallowest and the deepest depth measured."""
    depths = sorted(int(d) for d in rec.data["depths"])
    full = rec.data["full_layers"]
    table = {}
    for depth in depths:
        for name, rows in rec.data["depths"][str(depth)]["runs"].items():
            for key, row in rows.items():
                # The first round warms each package (first kernel launches, the arena growing): with
                # more than one round it is left out.
                warm = row["decode_ms"][1:] or row["decode_ms"]
                table.setdefault(name, {}).setdefault(key, {})[depth] = float(np.median(warm))
    summary = {}
    for name, rows in table.items():
        for key, by_depth in rows.items():
            entry = {"ms_by_depth": by_depth}
            if len(by_depth) >= 2:
                a, b = sorted(by_depth)[0], sorted(by_depth)[-1]  # the widest span measured
                per_layer = (by_depth[b] - by_depth[a]) / (b - a)
                entry.update(per_layer_ms=round(per_layer, 4), extrapolated_ms=round(by_depth[a] + (full - a) * per_layer, 3))
            summary.setdefault(name, {})[key] = entry
    rec.data["summary"] = summary
    rec.save()


def resummarize(path: Path) -> None:
    """Recompute the summary of a saved run from its recorded rounds."""
    rec = Recorder.__new__(Recorder)
    rec.path, rec.data = path, json.loads(path.read_text())
    summarize(rec)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--resummarize":
        resummarize(Path(sys.argv[2]))
        raise SystemExit(0)
    raise SystemExit(main())
