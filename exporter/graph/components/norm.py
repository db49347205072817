"""RMSNorm as the opset-23 RMSNormalization op (fp32 statistics, like transformers), or for the compat
target onnxruntime's SimplifiedLayerNormalization; LayerNorm with a bias (phimoe) as LayerNormalization,
its residual form as com.microsoft SkipLayerNormalization."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder


def rms_norm(b: GraphBuilder, x: ir.Value, weight: ir.Value, eps: float, bias: ir.Value | None = None) -> ir.Value:
    """RMSNorm, or with a ``bias`` a LayerNorm (mean removed, then scale and shift)."""
    # stash_type=1 keeps mean/rsqrt in fp32 for fp16/bf16 inputs, as the reference does.
    if bias is not None:
        return b.op("LayerNormalization", [x, weight, bias], {"axis": -1, "epsilon": float(eps), "stash_type": 1})
    # Older onnxruntime has no RMSNormalization; its own op computes the same (and is what it fuses RMSNorm into).
    op = "SimplifiedLayerNormalization" if b.target.contrib_ops else "RMSNormalization"
    return b.op(op, [x, weight], {"axis": -1, "epsilon": float(eps), "stash_type": 1})


def residual_rms_norm(
    b: GraphBuilder, residual: ir.Value, update: ir.Value, weight: ir.Value, eps: float, bias: ir.Value | None = None,
) -> tuple[ir.Value, ir.Value]:
    """``s = residual + update`` and ``rms_norm(s)`` in one kernel; returns (normed, s).

    com.microsoft SkipSimplifiedLayerNormalization fuses the residual add into the norm: one
    kernel instead of two per norm, which matters when decode is launch-bound (it runs on CPU too).
    """
    if bias is not None:  # LayerNorm: SkipLayerNormalization's beta is the bias
        op, inputs = "SkipLayerNormalization", [update, residual, weight, bias]
    else:
        op, inputs = "SkipSimplifiedLayerNormalization", [update, residual, weight]
    normed, mean, inv_std, summed = b.op_multi(op, inputs, {"epsilon": float(eps)}, num_outputs=4, domain="com.microsoft")
    # The mean and inverse standard deviation outputs (training's) are left unnamed, so the kernel
    # neither allocates nor writes them: on the CPU that was 40% of the op's time (7 us a norm, SmolLM2).
    mean.name = inv_std.name = ""
    return normed, summed
