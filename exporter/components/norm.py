"""RMSNorm as the opset-23 RMSNormalization op (fp32 statistics, like transformers)."""

from __future__ import annotations

import onnx_ir as ir

from exporter.components.graph import GraphBuilder


def rms_norm(b: GraphBuilder, x: ir.Value, weight: ir.Value, eps: float) -> ir.Value:
    # stash_type=1 keeps mean/rsqrt in fp32 for fp16/bf16 inputs, as the reference does.
    return b.op("RMSNormalization", [x, weight], {"axis": -1, "epsilon": float(eps), "stash_type": 1})
