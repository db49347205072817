"""LFM2's gated short convolution (``conv`` layers) on onnxruntime's CausalConvWithState:
B, C, x = in_proj(input); y = out_proj(C * conv(B * x)), the convolution depthwise and causal over
conv_L_cache taps, no activation, carrying its last conv_L_cache - 1 inputs as state
(transformers' Lfm2ShortConv)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.recurrent import causal_conv, masked
from exporter.graph.config import ModelConfig


@dataclasses.dataclass
class ShortConvWeights:
    in_proj: ir.Value  # [3 * hidden, hidden]: B, C, x
    conv: ir.Value  # [hidden, 1, taps]
    out: ir.Value  # [hidden, hidden]
    in_bias: ir.Value | None = None  # conv_bias: in_proj, conv and out_proj all biased
    conv_bias: ir.Value | None = None
    out_bias: ir.Value | None = None


def short_conv(b: GraphBuilder, x: ir.Value, w: ShortConvWeights, cfg: ModelConfig, token_mask: ir.Value | None,
               conv_state: ir.Value) -> tuple[ir.Value, ir.Value]:
    """One layer on the normed input ``x`` [batch, seq, hidden]; returns (output, conv state)."""
    hidden = cfg.hidden_size
    gate_b, gate_c, h = b.op_multi("Split", [linear(b, masked(b, x, token_mask), w.in_proj, w.in_bias),
                                             b.ints(hidden, hidden, hidden)], {"axis": -1}, num_outputs=3)
    conv, state_out = causal_conv(b, b.op("Mul", [gate_b, h]), w.conv, w.conv_bias, conv_state, "none")
    return linear(b, b.op("Mul", [gate_c, conv]), w.out, w.out_bias), state_out
