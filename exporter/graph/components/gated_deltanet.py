"""Gated DeltaNet (qwen3_next, qwen3_5 ``linear_attention`` layers) on onnxruntime's fused ops: one
input projection, CausalConvWithState (SiLU) over q | k | v, GatedDeltaNet (the gated delta rule with
its gates, q / k L2 norms and the 1/sqrt(dk) scale inside, one call for a whole prompt, chunked in the
op) and GatedRMSNorm (per value head, gated by SiLU(z)), then the output projection.

transformers' math (modeling_qwen3_next.py): conv1d(silu) over mixed_qkv, beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias), q / k L2-normalized and q scaled by dk^-0.5, the state
decayed by exp(g) then updated by the delta rule, the output RMS-normed per head times silu(z).
The gates are computed in the graph in fp32 (the op's own softplus / sigmoid gates are named
differently across onnxruntime releases) and the op runs the rule. Its state is [batch, value_heads, value_dim, key_dim] in fp32 whatever the model dtype
(transformers keeps its recurrent state in fp32 too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.recurrent import MS_DOMAIN, causal_conv, masked
from exporter.graph.config import ModelConfig


# transformers' l2norm: x / sqrt(sum(x^2) + 1e-6) (fla's too). GatedDeltaNet's own (qk_l2_norm) adds
# about 1e-12 instead, which differs where a head's vector is short: on a tiny checkpoint with
# transformers' default init the logits moved by 7.6e-4 of their range.
L2_NORM_EPS = 1e-6


def _l2_norm(b: GraphBuilder, x: ir.Value, dim: int) -> ir.Value:
    """transformers' l2norm over the last axis of ``x`` (fp32) as one RMSNormalization:
    x / sqrt(sum x^2 + eps) = rmsnorm(x, eps / dim) / sqrt(dim)."""
    scale = b.constant(np.full(dim, dim ** -0.5, dtype=np.float32), f"l2_norm_scale_{dim}")
    return b.op("RMSNormalization", [x, scale], {"axis": -1, "epsilon": L2_NORM_EPS / dim, "stash_type": 1})


# The beta and decay gates' projection ([b | a], 2 x value_heads rows): its own MatMul, which the
# quantize pass keeps in float (passes/quantize.py, role "recurrent_gate"), as it keeps a router: a few
# rows (64 of Qwen3.5's) that set how fast every head forgets, whose error exp(A_log) multiplies. On
# the tiny random Qwen3.5 int4's agreement with the fp32 reference went from 0.46 to 0.51 with them
# kept (its int4 is poor either way: tiny random weights; exact to its dequantized weights).
DELTANET_GATES = "in_proj_ba.weight"


# Which op runs the recurrence (GraphBuilder.deltanet_op): GatedDeltaNet (gates, fp16 / bf16 kernels,
# state [batch, value_heads, value_dim, key_dim]) wherever onnxruntime >= 1.32 runs the export; the older
# LinearAttention (update_rule gated_delta, float kernels only on the CPU, state [batch, value_heads,
# key_dim, value_dim]) for the hf layout: transformers.js 4.3 runs onnxruntime-node 1.30, which has
# LinearAttention's CPU kernel and none for GatedDeltaNet.
GATED_DELTANET_OP, LINEAR_ATTENTION = "GatedDeltaNet", "LinearAttention"


def _gates(b: GraphBuilder, decay: ir.Value, beta: ir.Value, w: "DeltaNetWeights") -> tuple[ir.Value, ir.Value]:
    """(log decay -exp(A_log) * softplus(a + dt_bias), beta sigmoid(b)), fp32 [batch, seq, value_heads]."""
    f32 = ir.DataType.FLOAT
    if b.dtype != f32:
        decay, beta = (b.op("Cast", [t], {"to": f32}) for t in (decay, beta))
    softplus = b.op("Softplus", [b.op("Add", [decay, w.dt_bias])])
    return b.op("Mul", [b.op("Neg", [b.op("Exp", [w.a_log])]), softplus]), b.op("Sigmoid", [beta])


def _linear_attention(b: GraphBuilder, q, k, v, decay, beta, state, w: "DeltaNetWeights", cfg: ModelConfig):
    """The gated delta rule on LinearAttention (fp32 q / k / v): its gates computed here (beta =
    sigmoid(b), log decay = -exp(A_log) * softplus(a + dt_bias)), keys repeated to the value heads (the op
    pairs each key head with one value head; value head j reads key head j // (value_heads / key_heads))."""
    rc = cfg.recurrent
    r = rc.value_heads // rc.key_heads
    if r > 1:
        k = b.op("Expand", [b.op("Unsqueeze", [k, b.ints(3)]), b.ints(1, 1, 1, r, 1)])
    q, k, v = (b.op("Reshape", [t, b.ints(0, 0, -1)]) for t in (q, k, v))
    log_decay, beta = _gates(b, decay, beta, w)
    y, state_out = b.op_multi("LinearAttention", [q, k, v, state, log_decay, beta],
                              {"q_num_heads": rc.key_heads, "kv_num_heads": rc.value_heads,
                               "update_rule": "gated_delta"}, num_outputs=2, domain=MS_DOMAIN)
    return y, state_out


@dataclasses.dataclass
class DeltaNetWeights:
    in_proj: ir.Value  # [q | k | v | z, hidden]: q, k, v in the convolution's channel order
    gates: ir.Value  # [b | a, hidden]
    conv: ir.Value  # [channels, 1, taps]
    a_log: ir.Value  # [value_heads], fp32
    dt_bias: ir.Value  # [value_heads], fp32
    norm: ir.Value  # [value_dim], the gated norm's weight (plain, not 1 + w)
    out: ir.Value  # [hidden, value_heads * value_dim]


def gated_deltanet(b: GraphBuilder, x: ir.Value, w: DeltaNetWeights, cfg: ModelConfig, token_mask: ir.Value | None,
                   conv_state: ir.Value, recurrent_state: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One layer on the normed input ``x`` [batch, seq, hidden]; returns (output, conv state,
    recurrent state)."""
    rc = cfg.recurrent
    values = rc.value_heads * rc.value_dim
    x = masked(b, x, token_mask)
    mixed, z = b.op_multi("Split", [linear(b, x, w.in_proj), b.ints(rc.channels, values)], {"axis": -1}, num_outputs=2)
    beta, decay = b.op_multi("Split", [linear(b, x, w.gates), b.ints(rc.value_heads, rc.value_heads)], {"axis": -1},
                             num_outputs=2)
    qkv, conv_out = causal_conv(b, mixed, w.conv, None, conv_state, "silu")
    # From here to the output norm in fp32, as transformers computes the rule (q / k / v widened before
    # its L2 norms). Measured on an H200 (benchmarks/results/h200/hybrid_cuda_parity.json), bf16 exports
    # of the tiny Qwen3.5 / Qwen3-Next land 1.4-3.7% of the logit range from fp32 transformers, where
    # transformers' own bf16 run lands 1.5-4.0% (with q / k rounded to bf16 first: 1.6-3.7%, an H100).
    f32 = ir.DataType.FLOAT
    if b.dtype != f32:
        qkv = b.op("Cast", [qkv], {"to": f32})
    queries = rc.key_heads * rc.key_dim
    q, k, v = b.op_multi("Split", [qkv, b.ints(queries, queries, values)], {"axis": -1}, num_outputs=3)
    q, k = (_l2_norm(b, b.op("Reshape", [t, b.ints(0, 0, rc.key_heads, rc.key_dim)]), rc.key_dim) for t in (q, k))
    v = b.op("Reshape", [v, b.ints(0, 0, rc.value_heads, rc.value_dim)])
    if b.deltanet_op == LINEAR_ATTENTION:
        core, state_out = _linear_attention(b, q, k, v, decay, beta, recurrent_state, w, cfg)
    else:
        # The gates computed here, in fp32, and given to the op as they are (no gate / beta activation):
        # onnxruntime-gpu 1.31.1's CUDA kernel takes fp32 gates only and names the softplus gate "qwen"
        # where 1.32 names it "softplus" (every qwen3.5 half export failed to load there).
        log_decay, beta = _gates(b, decay, beta, w)
        core, state_out = b.op_multi("GatedDeltaNet", [q, k, v, None, log_decay, beta, recurrent_state], {},
                                     num_outputs=2, domain=MS_DOMAIN)
    core = b.op("Reshape", [core, b.ints(0, 0, values)])
    if b.dtype != f32:
        core = b.op("Cast", [core], {"to": b.dtype})
    # SiLU gate: the op's default (onnxruntime-node 1.30, which transformers.js 4.3 runs on, knows no activation attribute).
    y = b.op("GatedRMSNorm", [core, w.norm, z], {"epsilon": float(rc.norm_eps)}, domain=MS_DOMAIN)
    return linear(b, y, w.out), conv_out, state_out
