"""Mamba2 (granitemoehybrid: Granite 4.0-H's ``linear_attention`` layers; nemotron_h's; falcon_h1's, beside its
attention, with a muP scale per projection row and its output norm optional or before the gate) as gated linear attention on
onnxruntime's fused ops: one input projection [z | x, B, C | dt], CausalConvWithState (bias, SiLU) over
x | B | C, com.microsoft GatedDeltaNet with the plain ``gated`` rule (q = C and k = B per group, v = x * dt
per head, log decay dt * A; one call for a whole prompt, chunked in the op), the D skip, then the gated
RMSNorm (y * silu(z), normed per group) and the output projection.

transformers' math (modeling_granitemoehybrid.py, torch path): dt = softplus(dt_raw + dt_bias),
A = -exp(A_log); per head h of group g = h // (heads / groups): S_h = exp(dt A_h) S_h + (dt x_h) B_g^T,
y_h = S_h C_g + D_h x_h; the state is [batch, heads, head_dim, d_state] in fp32 (GatedDeltaNet's own
layout, no transpose). Its gated norm gates before it norms (norm_before_gate false), over groups of
intermediate / n_groups channels: GatedRMSNorm norms first, so the norm is an RMSNormalization here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.recurrent import MS_DOMAIN, causal_conv, masked
from exporter.graph.config import GATE_ONLY, NORM_THEN_GATE, ModelConfig


@dataclasses.dataclass
class Mamba2Weights:
    in_proj: ir.Value  # [z (inner) | x, B, C (channels) | dt (heads), hidden]
    conv: ir.Value  # [channels, 1, taps]
    conv_bias: ir.Value | None
    a_log: ir.Value  # [heads], fp32
    dt_bias: ir.Value  # [heads], fp32
    d: ir.Value  # [heads]
    norm: ir.Value | None  # [inner]; None: falcon_h1 without its output norm (GATE_ONLY)
    out: ir.Value  # [hidden, inner]
    in_bias: ir.Value | None = None
    out_bias: ir.Value | None = None
    in_scale: ir.Value | None = None  # the projection's outputs scaled (falcon_h1's muP vector over z, x, B, C, dt)


def mamba2(b: GraphBuilder, x: ir.Value, w: Mamba2Weights, cfg: ModelConfig, token_mask: ir.Value | None,
           conv_state: ir.Value, ssm_state: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One layer on the normed input ``x`` [batch, seq, hidden]; returns (output, conv state, ssm state)."""
    rc, f32 = cfg.recurrent, ir.DataType.FLOAT
    heads, head_dim, groups, d_state = rc.value_heads, rc.value_dim, rc.key_heads, rc.key_dim
    inner = heads * head_dim
    projected = linear(b, masked(b, x, token_mask), w.in_proj, w.in_bias)
    if w.in_scale is not None:
        projected = b.op("Mul", [projected, w.in_scale])
    z, xbc, dt = b.op_multi("Split", [projected, b.ints(inner, rc.channels, heads)], {"axis": -1}, num_outputs=3)
    xbc, conv_out = causal_conv(b, xbc, w.conv, w.conv_bias, conv_state, "silu")
    # transformers masks the convolution's output too: at padding it is the conv bias, which would reach the state.
    xs, gb, gc = b.op_multi("Split", [masked(b, xbc, token_mask), b.ints(inner, groups * d_state, groups * d_state)],
                            {"axis": -1}, num_outputs=3)
    # dt = softplus(dt + dt_bias) and the log decay dt * A in fp32, as transformers computes them.
    dt32 = b.op("Softplus", [b.op("Add", [b.op("Cast", [dt], {"to": f32}) if b.dtype != f32 else dt, w.dt_bias])])
    log_decay = b.op("Mul", [dt32, b.op("Neg", [b.op("Exp", [w.a_log])])])
    dt_t = b.op("Cast", [dt32], {"to": b.dtype}) if b.dtype != f32 else dt32
    xh = b.op("Reshape", [xs, b.ints(0, 0, heads, head_dim)])
    v = b.op("Mul", [xh, b.op("Unsqueeze", [dt_t, b.ints(3)])])
    q, k = (b.op("Reshape", [t, b.ints(0, 0, groups, d_state)]) for t in (gc, gb))
    y, state_out = b.op_multi(
        "GatedDeltaNet", [q, k, v, None, log_decay, None, ssm_state],
        {"update_rule": "gated", "gate_activation": "none", "scale": 1.0}, num_outputs=2, domain=MS_DOMAIN)
    y = b.op("Add", [y, b.op("Mul", [xh, b.op("Unsqueeze", [w.d, b.ints(1)])])])  # the D skip, per head
    y, silu_z = b.op("Reshape", [y, b.ints(0, 0, inner)]), b.op("Mul", [z, b.op("Sigmoid", [z])])
    if rc.gated_norm == GATE_ONLY:  # falcon_h1 without mamba_rms_norm
        return linear(b, b.op("Mul", [y, silu_z]), w.out, w.out_bias), conv_out, state_out
    per_group = inner // groups
    ones = b.constant(np.ones(per_group, dtype=b.dtype.numpy()), f"ones_{per_group}")

    def group_norm(t):
        normed = b.op("RMSNormalization", [b.op("Reshape", [t, b.ints(0, 0, groups, per_group)]), ones],
                      {"axis": -1, "epsilon": float(rc.norm_eps), "stash_type": 1})
        return b.op("Mul", [b.op("Reshape", [normed, b.ints(0, 0, inner)]), w.norm])

    if rc.gated_norm == NORM_THEN_GATE:  # falcon_h1's default: normed, weighted, then gated
        out = b.op("Mul", [group_norm(y), silu_z])
    else:
        out = group_norm(b.op("Mul", [y, silu_z]))
    return linear(b, out, w.out, w.out_bias), conv_out, state_out
