"""What the recurrent layers of a hybrid share: the step's token mask and the causal convolution that
carries its last inputs as state (com.microsoft CausalConvWithState, docs/graph-contracts.md
"Recurrent state").

A padded token must not reach a recurrent state: the layers zero their input at padding (as
transformers' apply_mask_to_padding_states does), so with left padding the state stays zero until
a row's first real token, exactly as if the prompt started there.
"""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder

MS_DOMAIN = "com.microsoft"


def masked(b: GraphBuilder, x: ir.Value, token_mask: ir.Value | None) -> ir.Value:
    """``x`` [batch, seq, width] with padding tokens zeroed (``token_mask`` [batch, seq, 1] in the
    model dtype, 1 for a real token; None: every token is real)."""
    return x if token_mask is None else b.op("Mul", [x, token_mask])


def causal_conv(b: GraphBuilder, x: ir.Value, weight: ir.Value, bias: ir.Value | None, state: ir.Value,
                activation: str) -> tuple[ir.Value, ir.Value]:
    """Depthwise causal convolution of ``x`` [batch, seq, channels] (``weight`` [channels, 1, taps]) after
    the ``state`` [batch, taps - 1, channels] of inputs before it; returns (output [batch, seq,
    channels], the state after it: the last taps - 1 inputs, channels last like ``x``, no transposes).
    (onnxruntime 1.32's CPU kernel is float32 only, and runs fp16 through casts it inserts itself.)"""
    y, state_out = b.op_multi("CausalConvWithState", [x, weight, bias, state],
                              {"activation": activation, "channels_last": 1}, num_outputs=2, domain=MS_DOMAIN)
    return y, state_out
