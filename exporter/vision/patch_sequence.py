"""The pieces the patch-sequence towers (Qwen2.5-VL's, Qwen3.5's) share, knowing none of their weight names:
the 2-D axial rotary on each patch's (row, column), attention within the segments of a PatchGrid, and the
merger's MLP over ``spatial_merge_size^2`` neighbouring patches side by side.

Attention is com.microsoft MultiHeadAttention over the segments batched [segments, length, hidden] with
their key lengths: onnxruntime's opset-24 Attention takes no key lengths and refuses a mask that does not
spell out every query row ([segments, 1, length, length] bools), and a block-diagonal mask over all
patches would cost patches^2 per block where the segments cost patches x segment length.
"""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.vision.config import VisionConfig
from exporter.vision.patch_grid import PatchGrid, Segments, from_segments, to_segments

FLOAT = ir.DataType.FLOAT


def weight_and_bias(b: GraphBuilder, module: str) -> tuple[ir.Value, ir.Value]:
    """A Linear's (or LayerNorm's) two checkpoint tensors, ``module`` its name without the trailing dot."""
    return b.weight(f"{module}.weight"), b.weight(f"{module}.bias")


def rotary_angles(b: GraphBuilder, grid: PatchGrid, cfg: VisionConfig) -> ir.Value:
    """[patches, head_dim / 2] fp32: row * inv_freq then column * inv_freq, as transformers' axial vision
    rotaries (Qwen2_5_VisionRotaryEmbedding, Qwen3_5VisionRotaryEmbedding) lay them out.

    inv_freq = 1 / theta^(2i / (head_dim / 2)) is computed in the graph in fp32 from integers, the same
    float32 arithmetic as transformers', so that a half build holds no fp32 initializer."""
    op = b.op
    spatial = cfg.head_dim // 2
    exponent = op("Div", [op("Cast", [op("Range", [b.scalar_i64(0), b.scalar_i64(spatial), b.scalar_i64(2)])],
                             {"to": FLOAT}),
                          op("Cast", [b.scalar_i64(spatial)], {"to": FLOAT})])
    theta = op("Cast", [b.scalar_i64(cfg.rope_theta)], {"to": FLOAT})
    inv_freq = op("Reciprocal", [op("Pow", [theta, exponent])])

    def angles(position: ir.Value) -> ir.Value:
        return op("Mul", [op("Unsqueeze", [op("Cast", [position], {"to": FLOAT}), b.ints(-1)]), inv_freq])

    return op("Concat", [angles(grid.rows), angles(grid.cols)], {"axis": -1})


def segment_rotary(b: GraphBuilder, angles: ir.Value, segments: Segments) -> tuple[ir.Value, ir.Value]:
    """cos and sin [segments, length, head_dim / 2] fp32 in the segments' layout."""
    laid_out = to_segments(b, angles, segments)
    return b.op("Cos", [laid_out]), b.op("Sin", [laid_out])


def segment_attention(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, segments: Segments,
                      rotary: tuple[ir.Value, ir.Value], qkv: tuple[ir.Value, ir.Value],
                      proj: tuple[ir.Value, ir.Value]) -> ir.Value:
    """Self-attention within ``segments``: packed q, k, v (``qkv``: weight and bias, q's rows then k's then v's),
    q and k rotated in fp32 (as transformers rotates them), MultiHeadAttention on the batched segments, back to
    patch order, then ``proj`` (weight and bias)."""
    d, heads = cfg.hidden_size, cfg.num_heads
    packed_qkv = linear(b, h, *qkv)
    qk, v = b.op_multi("Split", [to_segments(b, packed_qkv, segments), b.ints(2 * d, d)], {"axis": -1}, num_outputs=2)
    if b.dtype != FLOAT:
        qk = b.op("Cast", [qk], {"to": FLOAT})
    # q and k side by side are 2 x heads heads of one rotation (the same angles for every head).
    qk = b.op("RotaryEmbedding", [qk, *rotary], {"num_heads": 2 * heads, "interleaved": 0})
    if b.dtype != FLOAT:
        qk = b.op("Cast", [qk], {"to": b.dtype})
    q, k = b.op_multi("Split", [qk, b.ints(d, d)], {"axis": -1}, num_outputs=2)
    y = b.op("MultiHeadAttention", [q, k, v, None, segments.lengths],
             {"num_heads": heads, "scale": float(cfg.head_dim ** -0.5)}, domain="com.microsoft")
    return linear(b, from_segments(b, y, segments, d), *proj)


def merger_mlp(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, fc1: tuple[ir.Value, ir.Value],
               fc2: tuple[ir.Value, ir.Value]) -> ir.Value:
    """A merger after its norm (``h``: the normed last hidden state, patch order): merge^2 consecutive patches
    (one merged token's, in the processor's order) side by side, then ``fc1`` -> exact GELU -> ``fc2`` (weight and
    bias each) to the text width."""
    wide = cfg.hidden_size * cfg.spatial_merge_size ** 2
    x = b.op("Gelu", [linear(b, b.op("Reshape", [h, b.ints(-1, wide)]), *fc1)])
    return linear(b, x, *fc2)
