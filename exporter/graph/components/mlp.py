"""The gated MLP (SiLU, or tanh-GELU for gemma) with gate and up packed into one matmul."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear


def gated_mlp(
    b: GraphBuilder, x: ir.Value, gate_up: ir.Value, down: ir.Value, intermediate: int,
    gate_up_bias: ir.Value | None = None, down_bias: ir.Value | None = None, act: str = "silu",
) -> ir.Value:
    gate, up = b.op_multi(
        "Split", [linear(b, x, gate_up, gate_up_bias), b.ints(intermediate, intermediate)], {"axis": -1},
        num_outputs=2,
    )
    if act == "gelu_pytorch_tanh":
        activated = b.op("Gelu", [gate], {"approximate": "tanh"})  # opset 20
    else:
        # Sigmoid + Mul: ORT fuses it into one QuickGelu(alpha=1) kernel at session creation.
        activated = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    return linear(b, b.op("Mul", [activated, up]), down, down_bias)
