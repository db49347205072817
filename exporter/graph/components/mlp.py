"""The gated MLP (SiLU, or tanh-GELU for gemma) with gate and up packed into one matmul; nemotron_h's
ungated relu^2 MLP."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear


def gated_mlp(
    b: GraphBuilder, x: ir.Value, gate_up: ir.Value, down: ir.Value, intermediate: int,
    gate_up_bias: ir.Value | None = None, down_bias: ir.Value | None = None, act: str = "silu",
    gate_scale: float | None = None,
) -> ir.Value:
    """``gate_scale``: the gate multiplied before its activation (falcon_h1's mlp multiplier)."""
    gate, up = b.op_multi(
        "Split", [linear(b, x, gate_up, gate_up_bias), b.ints(intermediate, intermediate)], {"axis": -1},
        num_outputs=2,
    )
    if gate_scale is not None and gate_scale != 1.0:
        gate = b.op("Mul", [gate, b.scalar(gate_scale)])
    return linear(b, b.op("Mul", [gate_activation(b, gate, act), up]), down, down_bias)


def gate_activation(b: GraphBuilder, gate: ir.Value, act: str) -> ir.Value:
    """A gate's activation: tanh-GELU (gemma) or SiLU."""
    if act == "gelu_pytorch_tanh":
        return b.op("Gelu", [gate], {"approximate": "tanh"})  # opset 20
    # Sigmoid + Mul: ORT fuses it into one QuickGelu(alpha=1) kernel at session creation.
    return b.op("Mul", [gate, b.op("Sigmoid", [gate])])


def relu2_mlp(b: GraphBuilder, x: ir.Value, up: ir.Value, down: ir.Value) -> ir.Value:
    """down(relu(up(x))^2), nemotron_h's MLP and shared expert."""
    activated = b.op("Relu", [linear(b, x, up)])
    return linear(b, b.op("Mul", [activated, activated]), down)


def xielu(b: GraphBuilder, x: ir.Value, alpha_p: float, alpha_n: float, beta: float, eps: float) -> ir.Value:
    """apertus's xIELU with its parameters already through softplus: alpha_p x^2 + beta x for x > 0, else
    (expm1(min(x, eps)) - x) alpha_n + beta x. In bf16 computed in fp32 (onnxruntime's CUDA EP has no bf16
    Greater: measured, the session refuses to build)."""
    widen = b.dtype == ir.DataType.BFLOAT16
    f32 = ir.DataType.FLOAT
    if widen:
        x = b.op("Cast", [x], {"to": f32})

    def const(value):  # in the computing dtype
        return b.scalar_f32(value) if widen else b.scalar(value)

    linear_part = b.op("Mul", [x, const(beta)])
    positive = b.op("Add", [b.op("Mul", [b.op("Mul", [x, x]), const(alpha_p)]), linear_part])
    expm1 = b.op("Sub", [b.op("Exp", [b.op("Min", [x, const(eps)])]), const(1.0)])
    negative = b.op("Add", [b.op("Mul", [b.op("Sub", [expm1, x]), const(alpha_n)]), linear_part])
    y = b.op("Where", [b.op("Greater", [x, const(0.0)]), positive, negative])
    return b.op("Cast", [y], {"to": b.dtype}) if widen else y
