"""The decode matrix of one model in one run: our three variants, the onnxruntime-genai builder's
export, transformers eager and the memory-bandwidth floor, at several context lengths.

Run on the GPU machine (see ../shared/gpu/README.md), one model per call::

    python benchmarks/gpu_matrix.py --model llama-3.2-1b --out $OUT/llama-3.2-1b.json \
        [--genai-builder /tmp/site/onnxruntime_genai/models/builder.py]

Random weights are built on the device from the model's config (nothing that large travels).
Every ORT configuration runs through ``exporter.runtime.session.Decoder`` (IO binding; CUDA graphs
where the contract allows) and writes into one JSON, saved after every step so a partial run
still reports. ``--tiny --ep cpu`` runs the same code on a small model on the CPU (CI smoke).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_check

STATIC_OVERSIZED = 8320
MODELS = {
    # Llama-3.2-1B: tied embeddings, llama3 rope scaling.
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )),
    # Phi-3.5-mini: fused qkv / gate_up, longrope (factor values are stand-ins of the right shape).
    "phi-3.5-mini": ("Phi3Config", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
        sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": list(np.linspace(1.0, 2.7, 48).round(4)),
                         "long_factor": list(np.linspace(1.08, 64.0, 48).round(4))},
    )),
}


class Recorder:
    """The result JSON, written after every update so a cut-short run still has its figures."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")

    def error(self, where: str, err: BaseException) -> None:
        self.data.setdefault("errors", {})[where] = "".join(traceback.format_exception_only(err)).strip()[-3000:]
        self.save()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenizer_into(directory: Path) -> None:
    """A tiny WordLevel tokenizer: the genai builder insists on one; its contents do not matter here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(directory)


def build_checkpoint(name: str, directory: Path, device: str, tiny: bool):
    """Random fp16 weights from the config, saved as a checkpoint; returns the live model too."""
    import torch
    import transformers

    if tiny:
        from exporter.tiny_checkpoint import make_tiny_checkpoint

        make_tiny_checkpoint("llama" if name.startswith("llama") else "phi3", directory, dtype="float16")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float16, attn_implementation="eager")
    else:
        class_name, kwargs = MODELS[name]
        config = getattr(transformers, class_name)(**kwargs)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16, attn_implementation="eager")
        model.save_pretrained(directory)
        if class_name == "Phi3Config":
            # The genai builder reads rope_parameters["type"] (the pre-5.x key); keep both spellings.
            config_path = directory / "config.json"
            saved = json.loads(config_path.read_text())
            saved["rope_parameters"]["type"] = saved["rope_parameters"]["rope_type"]
            config_path.write_text(json.dumps(saved, indent=2))
    tokenizer_into(directory)
    return model.to(device).eval()


def export_variants(checkpoint: Path, work: Path, ep: str, max_seq_len: int, dtype: str = "fp16",
                    quant: dict | None = None, variants=("attn_static", "gqa", "attn_dynamic")) -> dict[str, Path]:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    dirs = {}
    for variant in variants:
        request = ExportRequest(model=str(checkpoint), dtype=dtype, ep=ep, variant=variant,
                                static_cache=variant == "attn_static", max_seq_len=max_seq_len,
                                quant=quant if dtype in ("int4", "int8") else None)
        start = time.perf_counter()
        dirs[variant] = export_model(request, work / variant, overwrite=True, validate=False).out_dir
        log(f"exported {variant} in {time.perf_counter() - start:.1f} s")
    return dirs


def build_genai(builder: Path, checkpoint: Path, out: Path, ep: str, precision: str = "fp16") -> tuple[Path | None, str]:
    """The onnxruntime-genai model builder's export of the same checkpoint, with its defaults."""
    cmd = [sys.executable, str(builder), "-i", str(checkpoint), "-o", str(out), "-p", precision, "-e", ep,
           "-c", str(out.parent / "genai-cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=builder.parent)
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        return None, f"builder exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
    return out, " ".join(cmd)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000.0
    del src, dst
    return 2 * 20 * (1 << 30) / seconds


def weight_bytes_per_token(export_dir: Path) -> int:
    """Bytes of weights one decode step reads: all but gather-only tables (embedding, rope)."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    total = 0
    for name, entry in manifest["initializers"].items():
        if name == "model.embed_tokens.weight" or name.startswith("rope."):
            continue  # a decode step gathers one row of these
        count = int(np.prod(entry["shape"])) if entry["shape"] else 1
        total += count * {"FLOAT16": 2, "BFLOAT16": 2, "FLOAT": 4, "INT64": 8, "UINT8": 1}.get(entry["dtype"], 4)
    return total


def process_gpu_memory() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        return int(used[0]) if used and used[0] else None
    except Exception:
        return None


def bench_hf(model, contexts, steps: int, warmup: int, device: str, vocab: int) -> dict:
    import torch

    rng = np.random.default_rng(0)
    results = {}
    for ctx in contexts:
        prompt = torch.tensor(rng.integers(3, vocab, size=(1, ctx)), device=device)
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            cache = out.past_key_values
            token = torch.ones((1, 1), dtype=torch.long, device=device)
            times = []
            for i in range(warmup + steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append((time.perf_counter() - start) * 1000.0)
        results[str(ctx)] = {"decode_ms_median": float(np.median(times)), "decode_ms_p90": float(np.percentile(times, 90)),
                             "steps": len(times)}
        del cache, out
    return results


def bench_ort(model_path: Path, ep: str, graph: bool, buffer_for, contexts, steps: int, warmup: int, vocab: int,
              gqa_mask: str = "buffer", repeats: int = 1) -> tuple[dict, dict]:
    """Decode + prefill per context for one configuration, each repeat in a session of its own (a
    session made for CUDA graphs is not the one a runtime without graphs would use; and a figure
    is only as good as its spread over sessions); returns (figures, last logits). The median per
    context is the median of the sessions' medians; each session's median is kept."""
    from exporter.runtime.session import Decoder

    figures: dict = {}
    logits: dict = {}
    for repeat in range(repeats):
        before = process_gpu_memory()
        harness = Decoder(model_path, ep, cuda_graph=graph, gqa_mask=gqa_mask)
        rng = np.random.default_rng(0)
        for ctx in contexts:
            buffer = buffer_for(ctx)
            prompt = rng.integers(3, vocab, size=(1, ctx))
            harness.prefill_bound(prompt, harness.new_caches(buffer), buffer)  # warm: allocations, kernel choice
            caches = harness.new_caches(buffer)
            prefill_s, _ = harness.prefill_bound(prompt, caches, buffer)
            times, last = harness.decode_bound(caches, ctx, buffer, steps, warmup, capture=graph)
            row = figures.setdefault(str(ctx), {"session_medians_ms": [], "session_p90s_ms": [], "prefill_ms": [],
                                                "steps": len(times), "buffer": buffer})
            row["session_medians_ms"].append(float(np.median(times)))
            row["session_p90s_ms"].append(float(np.percentile(times, 90)))
            row["prefill_ms"].append(prefill_s * 1000.0)
            logits[str(ctx)] = last.astype(np.float32).ravel()
            del caches
        if repeat == 0:
            after = process_gpu_memory()
            # What the first session added (weights, caches, arena).
            figures["device_memory_bytes"] = after - before if after is not None and before is not None else None
        del harness
        gc.collect()
    for ctx in contexts:
        row = figures[str(ctx)]
        row["decode_ms_median"] = float(np.median(row["session_medians_ms"]))
        row["decode_ms_p90"] = float(np.median(row["session_p90s_ms"]))
        row["prefill_ms"] = float(np.median(row["prefill_ms"]))
        row["prefill_tokens_per_s"] = ctx / (row["prefill_ms"] / 1000.0)
        row["session_spread"] = max(row["session_medians_ms"]) / min(row["session_medians_ms"]) - 1.0
    return figures, logits


def kernel_times(trace: list[dict], first_run: int) -> dict:
    """An onnxruntime profile's kernel time from its ``first_run``-th ``model_run`` on (0: the first):
    microseconds summed per op type (``by_op``), per node (``by_node``), the providers each op type ran
    on, the runs counted and each one's duration."""
    runs = sorted(e["ts"] for e in trace if e.get("name") == "model_run")
    first_run = min(first_run, max(len(runs) - 1, 0))
    start = runs[first_run] if runs else 0
    by_op: dict[str, float] = {}
    by_node: dict[str, float] = {}
    providers: dict[str, set] = {}
    for event in trace:
        if event.get("cat") == "Node" and event["ts"] >= start and event["name"].endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            providers.setdefault(op, set()).add(event.get("args", {}).get("provider", "?"))
            by_op[op] = by_op.get(op, 0.0) + event["dur"]
            node = event["name"][: -len("_kernel_time")]
            by_node[node] = by_node.get(node, 0.0) + event["dur"]
    return {"by_op": by_op, "by_node": by_node, "providers": providers, "first_run": first_run,
            "runs": max(len(runs) - first_run, 1),
            "run_us": [e["dur"] for e in trace if e.get("name") == "model_run" and e["ts"] >= start]}


def profile_decode(model_path: Path, ep: str, ctx: int, steps: int, vocab: int, out_dir: Path) -> dict:
    """ORT's own profile of ``steps`` uncaptured decode steps: time per op type, largest first."""
    import onnxruntime as ort

    from exporter.runtime.session import Decoder

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(out_dir / f"profile_{model_path.parent.name}")
    harness = Decoder(model_path, ep, session_options=options)
    caches = harness.new_caches(ctx + steps + 2)
    harness.prefill_bound(np.random.default_rng(0).integers(3, vocab, size=(1, ctx)), caches, ctx + steps + 2)
    harness.decode_bound(caches, ctx, ctx + steps + 2, steps, 0)
    trace = json.loads(Path(harness.session.end_profiling()).read_text())
    by_op = kernel_times(trace, first_run=1)["by_op"]
    total = sum(by_op.values()) or 1.0
    return {"ctx": ctx, "steps": steps, "op_us_per_step": {k: round(v / steps, 1) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "op_share": {k: round(v / total, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])}}


def independent_check(rec: Recorder, plan: list, contexts: list[int], span: int, args) -> None:
    """benchmarks/decode_check.py (a second harness sharing no code with exporter/) re-measures the
    configurations a recommendation can rest on, in this run; a configuration counts as reproduced
    when every re-measured context agrees within decode_check.TOLERANCE. Each side is the median
    over --repeats fresh sessions."""
    import decode_check

    checked = sorted({contexts[0], contexts[len(contexts) // 2], contexts[-1]})
    rec.data["independent_check"] = {"tool": "benchmarks/decode_check.py", "tolerance": decode_check.TOLERANCE,
                                     "contexts": checked, "configs": {}}
    for name, export_dir, use_graph, buffer_for, mask in plan:
        if name not in rec.data["configs"] or (mask == "buffer" and not use_graph and "gqa" in name):
            continue
        if "attn_dynamic" in name or ("static" in name and "no graph" in name):
            continue  # not what a recommendation picks between
        log(f"independent check {name}")
        rows = {}
        try:
            for ctx in checked:
                sessions = [decode_check.measure(export_dir, graph=use_graph, buffer=buffer_for(ctx), ctx=ctx,
                                                 steps=args.steps, warmup=args.warmup, ep=args.ep)
                            for _ in range(args.repeats)]
                check_ms = float(np.median(sessions))
                matrix_ms = rec.data["configs"][name]["decode"][str(ctx)]["decode_ms_median"]
                rows[str(ctx)] = {"matrix_ms": matrix_ms, "check_ms": check_ms, "ratio": matrix_ms / check_ms,
                                  "check_session_ms": sessions}
        except Exception as err:
            rec.error(f"check {name}", err)
            continue
        rec.data["independent_check"]["configs"][name] = {
            "contexts": rows, "reproduced": all(decode_check.agree(r["matrix_ms"], r["check_ms"]) for r in rows.values())}
        rec.save()


def driving_diagnosis(rec: Recorder, targets: dict[str, Path], ctx: int, span: int, args, vocab: int) -> None:
    """Why the matrix once measured genai's export slower than its runtime runs it: each GQA export
    at one context driven three ways, each in this run. The matrix before this fix reused the
    session made for CUDA graphs for the uncaptured run and fed a mask as wide as the buffer."""
    from exporter.runtime.session import Decoder

    ways = {"graph-enabled session, steps not captured, buffer-wide mask (the old matrix)": (True, "buffer", False),
            "own session, buffer-wide mask": (False, "buffer", None),
            "own session, growing mask (onnxruntime-genai without a graph)": (False, "grow", None)}
    out = rec.data.setdefault("driving_diagnosis", {"ctx": ctx, "buffer": ctx + span, "rounds": args.repeats,
                                                    "decode_ms_median": {}, "session_ms": {}})
    for name, export_dir in targets.items():
        sessions: dict[str, list[float]] = {}
        for _ in range(args.repeats):  # the ways interleaved, so a drift of the machine hits each alike
            for way, (graph, mask, capture) in ways.items():
                log(f"diagnosis {name}: {way}")
                try:
                    harness = Decoder(export_dir, args.ep, cuda_graph=graph, gqa_mask=mask)
                    prompt = np.random.default_rng(0).integers(3, vocab, size=(1, ctx))
                    caches = harness.new_caches(ctx + span)
                    harness.prefill_bound(prompt, caches, ctx + span)
                    times, _ = harness.decode_bound(caches, ctx, ctx + span, args.steps, args.warmup, capture=capture)
                    sessions.setdefault(way, []).append(float(np.median(times)))
                    del harness, caches
                    gc.collect()
                except Exception as err:
                    rec.error(f"diagnosis {name} {way}", err)
        out["session_ms"][name] = sessions
        out["decode_ms_median"][name] = {way: float(np.median(v)) for way, v in sessions.items()}
        rec.save()


def agreement(logits: dict[str, dict], reference: str) -> dict:
    """Max |logit difference| and argmax agreement of every configuration against ``reference``."""
    out = {}
    for name, per_ctx in logits.items():
        if name == reference:
            continue
        out[name] = {ctx: {"max_abs_diff": float(np.max(np.abs(values - logits[reference][ctx]))),
                           "same_argmax": int(values.argmax()) == int(logits[reference][ctx].argmax())}
                     for ctx, values in per_ctx.items() if ctx in logits[reference]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/exportfarm-gpu"))
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ctx", default="128,512,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--hf-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="fresh sessions per configuration (medians pooled)")
    parser.add_argument("--genai-builder", type=Path, default=None)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "int4", "int8"],
                        help="ours and the genai builder's precision (int4 / int8: weight-only MatMulNBits)")
    parser.add_argument("--quant", default=None, help="our quant options as JSON (block_size, symmetric, lm_head_bits, keep)")
    parser.add_argument("--extra-quant", default=None,
                        help="JSON: one more gqa + attn_static export of ours with these quant options (same run)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test of this script)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: hf,genai,check,diagnosis,profile,kernels,nograph,sized-static")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    contexts = [int(c) for c in args.ctx.split(",")]
    device = "cuda" if args.ep == "cuda" else "cpu"
    work = args.work / args.model
    work.mkdir(parents=True, exist_ok=True)
    span = args.warmup + args.steps
    max_seq_len = STATIC_OVERSIZED if not args.tiny else max(contexts) + span + 8

    import onnxruntime as ort
    import torch
    import transformers

    rec = Recorder(args.out, {
        "benchmark": "gpu_matrix", "model": args.model, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "settings": {"contexts": contexts, "steps": args.steps, "warmup": args.warmup, "hf_steps": args.hf_steps,
                     "static_oversized_buffer": STATIC_OVERSIZED, "dtype": args.dtype, "batch": 1,
                     "quant": args.quant, "extra_quant": args.extra_quant,
                     "repeats": args.repeats},
        "configs": {},
    })
    checkpoint = work / "checkpoint"
    log(f"building {args.model} checkpoint")
    model = build_checkpoint(args.model, checkpoint, device, args.tiny)
    vocab = model.config.vocab_size
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if "hf" not in skip:
        try:
            log("transformers eager")
            rec.data["configs"]["transformers eager"] = {"decode": bench_hf(model, contexts, args.hf_steps, 3, device, vocab)}
            rec.save()
        except Exception as err:
            rec.error("transformers eager", err)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    rec.data["bandwidth_bytes_per_s"] = copy_bandwidth(device)

    log("exporting")
    quant = json.loads(args.quant) if args.quant else None
    exports = export_variants(checkpoint, work / "exports", args.ep, max_seq_len, args.dtype, quant)
    extra = {}
    if args.extra_quant:
        extra = export_variants(checkpoint, work / "exports-extra", args.ep, max_seq_len, args.dtype,
                                json.loads(args.extra_quant), variants=("gqa",))
    weight_bytes = weight_bytes_per_token(exports["attn_static"])
    rec.data["floor"] = {
        "weight_bytes_per_token": weight_bytes,
        "kv_bytes_per_token": {str(c): 2 * layers * kv_heads * c * head_dim * 2 for c in contexts},
    }
    bw = rec.data["bandwidth_bytes_per_s"]
    rec.data["floor"]["decode_ms"] = {str(c): (weight_bytes + 2 * layers * kv_heads * c * head_dim * 2) / bw * 1000.0
                                      for c in contexts} if bw == bw else None
    rec.data["export_timings_s"] = {v: json.loads((d / "manifest.json").read_text())["timings_s"] for v, d in exports.items()}
    rec.save()

    genai_dir = None
    if args.genai_builder and "genai" not in skip:
        log("onnxruntime-genai builder")
        genai_dir, detail = build_genai(args.genai_builder, checkpoint, work / "genai", args.ep, args.dtype)
        rec.data["genai_builder"] = {"ok": genai_dir is not None, "detail": detail}
        rec.save()

    graph = device == "cuda"
    sized = lambda c: c + span  # noqa: E731  (a buffer that just fits the run)
    oversized = (lambda c: max(STATIC_OVERSIZED, c + span)) if not args.tiny else (lambda c: max_seq_len)
    # Each peer driven as its own runtime drives it. Ours and genai's GQA exports alike, as
    # onnxruntime-genai runs them: past and present on one max-length buffer; under a CUDA graph a
    # mask as wide as that buffer (genai's static mask), without one a mask as wide as the tokens.
    plan = [
        ("ours attn_static + CUDA graph, buffer = context", exports["attn_static"], graph, sized, "buffer"),
        (f"ours attn_static + CUDA graph, buffer = {STATIC_OVERSIZED}", exports["attn_static"], graph, oversized, "buffer"),
        ("ours attn_static, no graph, buffer = context", exports["attn_static"], False, sized, "buffer"),
        ("ours gqa + CUDA graph, shared buffer", exports["gqa"], graph, sized, "buffer"),
        ("ours gqa, no graph, shared buffer, growing mask", exports["gqa"], False, sized, "grow"),
        ("ours attn_dynamic", exports["attn_dynamic"], False, sized, "buffer"),
    ]
    if extra:
        label = f"ours {args.extra_quant}"
        plan += [(f"{label} gqa + CUDA graph, shared buffer", extra["gqa"], graph, sized, "buffer")]
    if genai_dir is not None:
        plan += [("onnxruntime-genai builder gqa + CUDA graph, shared buffer", genai_dir, graph, sized, "buffer"),
                 ("onnxruntime-genai builder gqa, no graph, shared buffer, growing mask", genai_dir, False, sized, "grow")]
    if "nograph" in skip:  # uncaptured decode, except the attn_dynamic baseline the agreement needs
        plan = [p for p in plan if p[2] or "attn_dynamic" in p[0]]
    if "sized-static" in skip:  # keep the oversized static buffer only
        plan = [p for p in plan if not ("attn_static" in p[0] and "buffer = context" in p[0])]
    # GQA configurations first (what the comparison with the genai builder rests on), so a run cut
    # short by a time limit still holds them.
    plan.sort(key=lambda p: (not ("gqa" in p[0] and p[2]),))
    logits: dict[str, dict] = {}
    for name, export_dir, use_graph, buffer_for, mask in plan:
        log(name)
        try:
            figures, last = bench_ort(export_dir / "model.onnx", args.ep, use_graph, buffer_for, contexts, args.steps,
                                      args.warmup, vocab, mask, args.repeats)
            rec.data["configs"][name] = {"decode": {k: v for k, v in figures.items() if k != "device_memory_bytes"},
                                         "device_memory_bytes": figures["device_memory_bytes"], "cuda_graph": use_graph,
                                         "gqa_mask": mask}
            logits[name] = last
            rec.save()
        except Exception as err:
            rec.error(name, err)
    rec.data["agreement_vs_attn_dynamic"] = agreement(logits, "ours attn_dynamic") if "ours attn_dynamic" in logits else {}
    rec.save()
    gc.collect()

    if "check" not in skip:
        independent_check(rec, plan, contexts, span, args)

    if "diagnosis" not in skip:
        targets = {"ours gqa": exports["gqa"]}
        if genai_dir is not None:
            targets["onnxruntime-genai builder gqa"] = genai_dir
        driving_diagnosis(rec, targets, contexts[len(contexts) // 2], span, args, vocab)

    if "kernels" not in skip:
        from exporter.runtime.kernel_log import probe

        targets = {"ours attn_static": exports["attn_static"], "ours gqa": exports["gqa"], "ours attn_dynamic": exports["attn_dynamic"]}
        if genai_dir is not None:
            targets["onnxruntime-genai builder gqa"] = genai_dir
        for name, export_dir in targets.items():
            log(f"kernel probe {name}")
            try:
                rec.data.setdefault("kernels", {})[name] = probe(export_dir / "model.onnx", args.ep, ctx=min(512, max(contexts)))
            except Exception as err:
                rec.error(f"kernels {name}", err)
            rec.save()

    if "profile" not in skip:
        ctx = 2048 if not args.tiny else min(contexts)
        targets = {"ours attn_static": exports["attn_static"], "ours gqa": exports["gqa"]}
        if genai_dir is not None:
            targets["onnxruntime-genai builder gqa"] = genai_dir
        for name, export_dir in targets.items():
            log(f"profile {name}")
            try:
                rec.data.setdefault("profiles", {})[name] = profile_decode(export_dir / "model.onnx", args.ep, ctx, 16, vocab, work)
            except Exception as err:
                rec.error(f"profile {name}", err)
            rec.save()
    log(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
