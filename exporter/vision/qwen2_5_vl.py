"""Qwen2.5-VL's vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel) and its PatchMerger.

Its differences from a ViT: the patch embedding is a Conv3d whose kernel is the whole flattened patch
(so one MatMul on the processor's rows), a 2-D axial rotary on (row, column) of each patch, RMSNorm and a
gated MLP with biases, and attention within windows of merged tokens on every block but
``full_attention_layers`` (within each frame there). The run-time layout comes from patch_grid.

Attention is com.microsoft MultiHeadAttention over the segments batched [segments, length, hidden] with
their key lengths: onnxruntime's opset-24 Attention takes no key lengths and refuses a mask that does not
spell out every query row ([segments, 1, length, length] bools), and a block-diagonal mask over all
patches would cost patches^2 per window block where the windows cost patches x window length.
"""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.mlp import gated_mlp
from exporter.graph.components.norm import residual_rms_norm, rms_norm
from exporter.vision.config import VisionConfig
from exporter.vision.patch_grid import PatchGrid, Segments, from_segments, patch_grid, to_segments

FLOAT = ir.DataType.FLOAT


def _rotary_angles(b: GraphBuilder, grid: PatchGrid, cfg: VisionConfig) -> ir.Value:
    """[patches, head_dim / 2] fp32: row * inv_freq then column * inv_freq, as Qwen2_5_VLVisionRotaryEmbedding.

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


def _segment_rotary(b: GraphBuilder, angles: ir.Value, segments: Segments) -> tuple[ir.Value, ir.Value]:
    """cos and sin [segments, length, head_dim / 2] fp32 in the segments' layout."""
    laid_out = to_segments(b, angles, segments)
    return b.op("Cos", [laid_out]), b.op("Sin", [laid_out])


def _attention(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str, segments: Segments,
               rotary: tuple[ir.Value, ir.Value]) -> ir.Value:
    """Qwen2_5_VLVisionAttention within ``segments``: packed qkv, q and k rotated in fp32 (as transformers
    rotates them), MultiHeadAttention on the batched segments, back to patch order, then proj."""
    d, heads = cfg.hidden_size, cfg.num_heads
    qkv = linear(b, h, b.weight(f"{prefix}.attn.qkv.weight"), b.weight(f"{prefix}.attn.qkv.bias"))
    qk, v = b.op_multi("Split", [to_segments(b, qkv, segments), b.ints(2 * d, d)], {"axis": -1}, num_outputs=2)
    if b.dtype != FLOAT:
        qk = b.op("Cast", [qk], {"to": FLOAT})
    # q and k side by side are 2 x heads heads of one rotation (the same angles for every head).
    qk = b.op("RotaryEmbedding", [qk, *rotary], {"num_heads": 2 * heads, "interleaved": 0})
    if b.dtype != FLOAT:
        qk = b.op("Cast", [qk], {"to": b.dtype})
    q, k = b.op_multi("Split", [qk, b.ints(d, d)], {"axis": -1}, num_outputs=2)
    y = b.op("MultiHeadAttention", [q, k, v, None, segments.lengths],
             {"num_heads": heads, "scale": float(cfg.head_dim ** -0.5)}, domain="com.microsoft")
    return linear(b, from_segments(b, y, segments, d), b.weight(f"{prefix}.attn.proj.weight"),
                  b.weight(f"{prefix}.attn.proj.bias"))


def _mlp(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str) -> ir.Value:
    """Qwen2_5_VLMLP(bias=True): down(act(gate(h)) * up(h)), gate and up in one MatMul."""
    mlp = f"{prefix}.mlp"
    return gated_mlp(b, h, packed(b, [b.weight(f"{mlp}.gate_proj.weight"), b.weight(f"{mlp}.up_proj.weight")]),
                     b.weight(f"{mlp}.down_proj.weight"), cfg.intermediate_size,
                     gate_up_bias=packed(b, [b.weight(f"{mlp}.gate_proj.bias"), b.weight(f"{mlp}.up_proj.bias")]),
                     down_bias=b.weight(f"{mlp}.down_proj.bias"), act=cfg.hidden_act)


def qwen2_5_vl_tower(b: GraphBuilder, pixels: ir.Value, grid_thw: ir.Value, cfg: VisionConfig, tower: str,
                     merger: str) -> ir.Value:
    """``pixels`` [patches, patch_dim] (model dtype) + ``grid_thw`` [images, 3] -> [patches / merge^2,
    text hidden]: the tower's pooler_output, image after image in the processor's order."""
    eps, d = cfg.layer_norm_eps, cfg.hidden_size
    # Conv3d with kernel = stride = the patch: one MatMul against the kernel flattened as the rows are.
    kernel = b.op("Reshape", [b.weight(f"{tower}patch_embed.proj.weight"), b.ints(d, cfg.patch_dim)])
    x = linear(b, pixels, kernel)
    grid = patch_grid(b, pixels, grid_thw, cfg.spatial_merge_size, cfg.window)
    angles = _rotary_angles(b, grid, cfg)
    layouts = {}  # full / windowed: (segments, their cos and sin), built for the kinds of block there are

    def layout(full: bool):
        if full not in layouts:
            segments = grid.frames if full else grid.windows
            layouts[full] = segments, _segment_rotary(b, angles, segments)
        return layouts[full]

    block = lambda i: f"{tower}blocks.{i}"  # noqa: E731
    h = rms_norm(b, x, b.weight(f"{block(0)}.norm1.weight" if cfg.num_layers else f"{merger}ln_q.weight"), eps)
    for i in range(cfg.num_layers):
        segments, rotary = layout(i in cfg.full_attention_layers)
        h, x = residual_rms_norm(b, x, _attention(b, h, cfg, block(i), segments, rotary),
                                 b.weight(f"{block(i)}.norm2.weight"), eps)
        following = f"{block(i + 1)}.norm1" if i + 1 < cfg.num_layers else f"{merger}ln_q"
        h, x = residual_rms_norm(b, x, _mlp(b, h, cfg, block(i)), b.weight(f"{following}.weight"), eps)
    return patch_merger(b, [h], cfg, merger)


def patch_merger(b: GraphBuilder, states: list[ir.Value], cfg: VisionConfig, prefix: str) -> ir.Value:
    """Qwen2_5_VLPatchMerger after its ln_q (``states``: the normed last hidden state): merge^2 consecutive
    patches side by side, then mlp.0 -> exact GELU -> mlp.2 to the text width."""
    (h,) = states
    wide = cfg.hidden_size * cfg.spatial_merge_size ** 2
    x = b.op("Reshape", [h, b.ints(-1, wide)])
    x = b.op("Gelu", [linear(b, x, b.weight(f"{prefix}mlp.0.weight"), b.weight(f"{prefix}mlp.0.bias"))])
    return linear(b, x, b.weight(f"{prefix}mlp.2.weight"), b.weight(f"{prefix}mlp.2.bias"))
