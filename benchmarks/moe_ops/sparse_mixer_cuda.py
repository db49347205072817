"""Is CUDA's MoE ``use_sparse_mixer=1`` phimoe's sparsemixer? One fp16 MoE node (16 experts, k=2,
interleaved SwiGLU) on the CUDA EP against transformers' ``sparsemixer`` (eval) and float64 experts,
over four kinds of router rows; beside it, as a control, the routing our exports use (the sparsemixer
in the graph, the op given log weights and renormalizing, the output scaled back by w1 + w2), through
the same kernel.

Why it is asked: the genai builder exports Phi-3.5-MoE with ``use_sparse_mixer=1`` (one node), ours
computes the sparsemixer in ~30 small nodes per layer, which cost ~0.5 ms a layer when genai runs the
decode without a CUDA graph (benchmarks/results/h200/moe_phi_3_5_moe_profile.json). Reading
onnxruntime's kernel (contrib_ops/cuda/moe, ``sparse_mixer_top2``): the arg-max starts from the value
-1 at expert 0 and the threshold is a constant 0.01 (Phi-3.5-MoE's router_jitter_noise), so a row
whose best (or second best) logit is <= -1 would pick expert 0. This measures it.

    python3 benchmarks/moe_ops/sparse_mixer_cuda.py --out /tmp/sparse_mixer_cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np

E, H, I, T_PER_KIND = 16, 256, 128, 64


def rows(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Router logits [T_PER_KIND, E] of one kind."""
    if kind == "standard normal":
        return rng.standard_normal((T_PER_KIND, E))
    if kind == "all below -1":
        return rng.standard_normal((T_PER_KIND, E)) * 0.5 - 3.0
    if kind == "one positive, rest below -1":
        s = rng.standard_normal((T_PER_KIND, E)) * 0.5 - 3.0
        s[np.arange(T_PER_KIND), rng.integers(0, E, T_PER_KIND)] = 3.0
        return s
    if kind == "near ties above 0":  # many experts inside the 2 eps threshold
        return 1.0 + 0.02 * rng.standard_normal((T_PER_KIND, E))
    raise ValueError(kind)


KINDS = ("standard normal", "all below -1", "one positive, rest below -1", "near ties above 0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a control (the CPU kernel ignores use_sparse_mixer, docs/moe-design.md)")
    args = parser.parse_args()

    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    provider = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[args.ep]
    if provider not in ort.get_available_providers():
        print(f"no {provider} here", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    r16 = lambda a: np.asarray(a, np.float16)  # noqa: E731
    gate, up = (r16(rng.standard_normal((E, I, H)) * 0.05) for _ in range(2))
    down = r16(rng.standard_normal((E, H, I)) * 0.05)
    fc1 = np.empty((E, 2 * I, H), np.float16)
    fc1[:, 0::2], fc1[:, 1::2] = gate, up

    def session(attrs: dict):
        node = helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft",
                                k=2, activation_type="swiglu", swiglu_fusion=1, **attrs)
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", H]),
                          helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["T", E])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", H])],
            [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(down, "fc2")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        options = ort.SessionOptions()
        options.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
        if sess.get_providers()[0] != provider:
            raise RuntimeError(f"the MoE node did not get {provider}: {sess.get_providers()}")
        return sess

    fused = session({"use_sparse_mixer": 1, "normalize_routing_weights": 0})
    ours = session({"normalize_routing_weights": 1})

    g64, u64, d64 = (a.astype(np.float64) for a in (gate, up, down))

    def expert(e: int, v: np.ndarray) -> np.ndarray:
        a = g64[e] @ v
        return d64[e] @ (a / (1 + np.exp(-a)) * (u64[e] @ v))

    report = {"benchmark": "moe_sparse_mixer_cuda", "command": "python3 " + " ".join(sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__, "python": platform.python_version()},
              "shape": {"experts": E, "hidden": H, "intermediate": I, "k": 2, "dtype": "float16"},
              "provider": provider,
              "how": "one MoE node per routing on the provider; reference: transformers' phimoe sparsemixer "
                     "(jitter_eps 0.01, eval) on the fp16-rounded logits, experts in float64 from the fp16 weights; "
                     "a row is wrong when its error is above 5% of the row's largest output",
              "kinds": {}}
    for kind in KINDS:
        logits = r16(rows(kind, rng))
        x = r16(rng.standard_normal((T_PER_KIND, H)))
        weights, chosen = sparsemixer(torch.from_numpy(logits.astype(np.float32)), jitter_eps=0.01, training=False, top_k=2)
        weights, chosen = weights.numpy().astype(np.float64), chosen.numpy()
        ref = np.stack([sum(weights[t, j] * expert(int(chosen[t, j]), x[t].astype(np.float64)) for j in range(2))
                        for t in range(T_PER_KIND)])
        log_w = np.full((T_PER_KIND, E), -np.inf)
        np.put_along_axis(log_w, chosen, np.log(weights), -1)
        outputs = {
            "use_sparse_mixer=1": fused.run(None, {"x": x, "logits": logits})[0],
            "ours (log weights, renormalized, scaled by w1 + w2)":
                ours.run(None, {"x": x, "logits": r16(log_w)})[0].astype(np.float64) * weights.sum(-1, keepdims=True),
        }
        entry = {"rows": T_PER_KIND}
        for name, y in outputs.items():
            diff = np.abs(np.asarray(y, np.float64) - ref)
            scale = np.maximum(np.abs(ref).max(-1), 1e-6)
            wrong = diff.max(-1) > 0.05 * scale
            entry[name] = {"max_abs_error": round(float(diff.max()), 6),
                           "max_error_over_row_scale": round(float((diff.max(-1) / scale).max()), 4),
                           "wrong_rows": int(wrong.sum())}
            print(f"{kind:30s} {name:55s} max err {diff.max():.3g}  wrong rows {int(wrong.sum())}/{T_PER_KIND}")
        report["kinds"][kind] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
