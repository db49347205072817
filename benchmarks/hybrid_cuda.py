"""Hybrids on CUDA (issue 46): every family's fp16 and bf16 exports against transformers' fp32 on the GPU
machine, and decode / prefill speed of a depth-truncated real geometry.

    python benchmarks/hybrid_cuda.py --out results.json [--arch ...] [--speed qwen3_5_text,lfm2,granitemoehybrid]

Parity: the tiny checkpoints of exporter/tiny_checkpoint.py (TEXT_HYBRID_ARCHITECTURES), exported for ep cuda in
fp16 and bf16, gqa and attn_dynamic, driven by the project's one driver (exporter.runtime.session.Decoder,
caches and recurrent states on the device between steps), against transformers' fp32 greedy run of the
same weights on a 70-token prompt (past the convolution windows and GatedDeltaNet's 64-token chunk) and
24 steps: decisive steps must give transformers' token, the prefill logits within 5% of their range
(the fp16 bar of tests/test_parity.py). Sigmoid routing runs in standard ops in a cuda export (onnxruntime-gpu
1.31.1 has no MoEGroupRouter), so lfm2_moe and nemotron_h's experts are measured too.

Speed: a random-weight checkpoint of the named family at a real width (Qwen3.5-0.8B / LFM2-350M /
Granite-4.0-H-Tiny-like, depth-truncated to --layers), fp16 gqa for cuda, Decoder's device binding without
CUDA graphs (a hybrid's states alternate between two buffers): prefill of a 2048-token prompt and decode
ms/token (median of 64 after 8 warm-up) at that context.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

GEOMETRIES = {  # width of the real model, its layer pattern repeated to --layers
    "qwen3_5_text": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=151936,
                         layer_types=["linear_attention"] * 3 + ["full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}),
    "lfm2": dict(hidden_size=1024, intermediate_size=6656, num_attention_heads=16, num_key_value_heads=8,
                 vocab_size=65536, layer_types=["conv", "conv", "full_attention"], conv_L_cache=3,
                 block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True),
    "granitemoehybrid": dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48,
                             mamba_d_head="auto", mamba_expand=2, mamba_d_state=128, mamba_n_groups=1,
                             mamba_d_conv=4, num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
                             shared_intermediate_size=1024, vocab_size=100352,
                             layer_types=["mamba"] * 3 + ["attention"]),
    # transformers' NemotronHConfig default sizes (Nemotron-H-8B's width: Mamba2 of 128 heads x 64, d_state 128, 8
    # groups; a relu^2 MLP of 21504; 32 heads of 128, 8 KV heads), blocks M - M * - repeated.
    "nemotron_h": dict(hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                       conv_kernel=4, vocab_size=131072,
                       layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]),
}




def relu2_experts_known_answer(form: str = "relu2") -> dict:
    """nemotron_h's relu^2 experts on CUDA in fp16 against numpy, 4 experts of 64, top 2 of a softmax, 5 tokens:
    ``form`` "swiglu_gate_is_up" (what an export holds: the op's SwiGLU with gate = up, components/moe.py) or
    "relu2", the op's own activation."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    experts, hidden, width, k, tokens = 4, 64, 64, 2, 5
    rng = np.random.default_rng(0)
    up = (rng.standard_normal((experts, width, hidden)) * 0.2).astype(np.float16)
    down = (rng.standard_normal((experts, hidden, width)) * 0.2).astype(np.float16)
    x = rng.standard_normal((tokens, hidden)).astype(np.float16)
    logits = rng.standard_normal((tokens, experts)).astype(np.float16)
    from exporter.graph.components.moe import RELU2_ALPHA

    if form == "relu2":  # not what an export holds: measured to know whether the op's own relu2 can replace it
        attrs, fc1 = {"activation_type": "relu2"}, up
    else:  # each expert's up rows twice, interleaved as gate and up
        attrs = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": RELU2_ALPHA, "activation_beta": 0.0}
        fc1 = np.stack([up, up], axis=2).reshape(experts, 2 * width, hidden)
    node = helper.make_node("MoE", ["x", "r", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=k,
                            normalize_routing_weights=1, **attrs)
    graph = helper.make_graph([node], "relu2", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [tokens, hidden]),
                                                helper.make_tensor_value_info("r", TensorProto.FLOAT16, [tokens, experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                              [onnx.numpy_helper.from_array(fc1, "fc1"), onnx.numpy_helper.from_array(down, "fc2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # onnx's default (14 in 1.23) is newer than onnxruntime 1.31 reads
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
        got = session.run(None, {"x": x, "r": logits})[0].astype(np.float32)
    except Exception as err:
        return {"supported": False, "error": f"{type(err).__name__}: {str(err)[:400]}"}
    p = np.exp(logits.astype(np.float32) - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = np.zeros((tokens, hidden), np.float32)
    for t in range(tokens):
        picked = np.argsort(-p[t])[:k]
        for e, weight in zip(picked, p[t, picked] / p[t, picked].sum()):
            a = np.maximum(up[e].astype(np.float32) @ x[t].astype(np.float32), 0) ** 2
            want[t] += weight * (down[e].astype(np.float32) @ a)
    error = float(np.abs(got - want).max())
    return {"supported": True, "max_abs_error": error, "max_abs": float(np.abs(want).max()),
            "passed": error <= 1e-2 * float(np.abs(want).max())}


def parity(arch: str, work: Path, overrides: dict | None = None) -> list[dict]:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.session import Decoder
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.parity import run_parity
    from exporter.validation.reference import load_reference, reference_greedy

    source = make_tiny_checkpoint(arch, work / arch, **(overrides or {}))
    prompt = [int(t) for t in np.random.default_rng(len(arch)).integers(3, 250, size=70)]
    ref = reference_greedy(load_reference(source), prompt, 24)
    # The yardstick (what validation judges a half export by): transformers itself in that dtype, on the
    # host CPU, its own greedy run against the fp32 one.
    yardstick = {}
    for dtype, torch_dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        half = reference_greedy(load_reference(source, torch_dtype), prompt, 24, draft=ref.tokens)
        error = float(np.abs(np.asarray(half.prefill_logits, np.float32) - ref.prefill_logits).max())
        first = next((i for i, (a, b) in enumerate(zip(half.tokens, ref.tokens)) if a != b), None)
        yardstick[dtype] = {"relative": error / float(ref.prefill_logits.max() - ref.prefill_logits.min()),
                            "first_token_differing": first,  # its own greedy run: after it the runs part
                            "decisive_there": first is not None and ref.gaps[first] >= 0.25}
    rows = []
    for dtype in ("fp16", "bf16"):
        for variant in ("gqa", "attn_dynamic"):
            row = {"arch": arch, "dtype": dtype, "variant": variant, "transformers_same_dtype": yardstick[dtype],
                   **({"overrides": overrides} if overrides else {})}
            try:
                request = ExportRequest(model=str(source), dtype=dtype, ep="cuda", variant=variant, max_seq_len=128)
                out = export_model(request, work / f"{arch}-{dtype}-{variant}", validate=False).out_dir
                result = run_parity(Decoder(out, "cuda"), ref, near_tie_margin=0.1 if dtype == "fp16" else 0.25)
                row.update(prefill_max_abs_error=result.prefill_max_abs_error, logit_range=result.logit_range,
                           relative=result.prefill_max_abs_error / result.logit_range, mismatches=result.mismatches,
                           near_ties=result.near_ties, tie_mismatches=result.tie_mismatches,
                           passed=not result.mismatches and result.prefill_max_abs_error <= 0.05 * result.logit_range)
            except Exception as err:  # reported: which op / dtype the GPU build lacks is the finding
                row.update(passed=False, error=f"{type(err).__name__}: {str(err)[:600]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def speed(arch: str, layers: int, work: Path, context: int = 2048, steps: int = 64, warmup: int = 8) -> dict:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.session import Decoder
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    geometry = dict(GEOMETRIES[arch])
    if "layers_block_type" in geometry:  # nemotron_h: its block list is its depth
        pattern = geometry.pop("layers_block_type")
        geometry["layers_block_type"] = [pattern[i % len(pattern)] for i in range(layers)]
    else:
        pattern = geometry.pop("layer_types")
        geometry.update(num_hidden_layers=layers, layer_types=[pattern[i % len(pattern)] for i in range(layers)])
    geometry.update(max_position_embeddings=8192)
    source = make_tiny_checkpoint(arch, work / f"{arch}-speed", dtype="bfloat16", init_std=0.02, **geometry)
    request = ExportRequest(model=str(source), dtype="fp16", ep="cuda", variant="gqa", max_seq_len=4096)
    start = time.perf_counter()
    out = export_model(request, work / f"{arch}-speed-export", validate=False).out_dir
    export_s = time.perf_counter() - start
    lm = Decoder(out, "cuda")
    prompt = np.random.default_rng(0).integers(3, 1000, size=(1, context))
    prefill = []
    for _ in range(3):
        caches = lm.new_caches(context + warmup + steps + 8)
        elapsed, _ = lm.prefill_bound(prompt, caches, context + warmup + steps + 8)
        prefill.append(elapsed * 1000)
    times, _ = lm.decode_bound(caches, context, context + warmup + steps + 8, steps, warmup)
    return {"arch": arch, "layers": layers, "geometry": geometry, "dtype": "fp16", "variant": "gqa",
            "cuda_graph": False, "context": context, "export_s": round(export_s, 1),
            "prefill_ms": [round(t, 2) for t in prefill], "decode_ms_median": round(statistics.median(times), 3),
            "decode_ms": [round(t, 3) for t in times]}


def main() -> None:
    import onnxruntime as ort

    from exporter.tiny_checkpoint import TEXT_HYBRID_ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="*", default=None)
    parser.add_argument("--speed", default="qwen3_5_text,lfm2,granitemoehybrid")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    schemas = {s.name for s in C.get_all_operator_schema()} if hasattr(C, "get_all_operator_schema") else set()
    # A cuda export routes sigmoid scores in standard ops (components/moe.py), whatever the runtime has: every
    # family is measured, its experts included.
    archs = args.arch if args.arch is not None else list(TEXT_HYBRID_ARCHITECTURES)
    import torch
    import transformers

    results = {"benchmark": "hybrid_cuda", "command": "python benchmarks/hybrid_cuda.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
               "versions": {"onnxruntime": ort.__version__, "transformers": transformers.__version__,
                            "torch": torch.__version__, "python": platform.python_version()},
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "MoEGroupRouter_in_runtime": "MoEGroupRouter" in schemas,
               "relu2_experts_known_answer": {f: relu2_experts_known_answer(f) for f in ("relu2", "swiglu_gate_is_up")},
               "parity": [], "speed": []}
    print(json.dumps({"relu2_experts_known_answer": results["relu2_experts_known_answer"]}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            results["parity"] += parity(arch, Path(tmp))
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        for arch in filter(None, args.speed.split(",")):
            try:
                results["speed"].append(speed(arch, args.layers, Path(tmp)))
            except Exception as err:
                results["speed"].append({"arch": arch, "error": f"{type(err).__name__}: {str(err)[:600]}"})
            print(json.dumps({k: v for k, v in results["speed"][-1].items() if k != "decode_ms"}), flush=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
