"""The gated SiLU MLP with gate and up packed into one matmul."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear


def gated_mlp(
    b: GraphBuilder, x: ir.Value, gate_up: ir.Value, down: ir.Value, intermediate: int,
    gate_up_bias: ir.Value | None = None, down_bias: ir.Value | None = None,
) -> ir.Value:
    gate, up = b.op_multi(
        "Split", [linear(b, x, gate_up, gate_up_bias), b.ints(intermediate, intermediate)], {"axis": -1},
        num_outputs=2,
    )
    silu = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    return linear(b, b.op("Mul", [silu, up]), down, down_bias)
