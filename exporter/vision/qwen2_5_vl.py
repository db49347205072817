"""Qwen2.5-VL's vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel) and its PatchMerger.

Its differences from a ViT: the patch embedding is a Conv3d whose kernel is the whole flattened patch
(so one MatMul on the processor's rows), a 2-D axial rotary on (row, column) of each patch, RMSNorm and a
gated MLP with biases, and attention within windows of merged tokens on every block but
``full_attention_layers`` (within each frame there). The run-time layout comes from patch_grid.

The rotary, the attention within segments and the merger's MLP are exporter.vision.patch_sequence's.
"""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.mlp import gated_mlp
from exporter.graph.components.norm import residual_rms_norm, rms_norm
from exporter.vision.config import VisionConfig
from exporter.vision.patch_grid import Segments, patch_grid
from exporter.vision.patch_sequence import (
    merger_mlp, rotary_angles, segment_attention, segment_rotary, weight_and_bias,
)


def _attention(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str, segments: Segments,
               rotary: tuple[ir.Value, ir.Value]) -> ir.Value:
    """Qwen2_5_VLVisionAttention within ``segments``: packed qkv and proj, both with biases."""
    return segment_attention(b, h, cfg, segments, rotary, weight_and_bias(b, f"{prefix}.attn.qkv"),
                             weight_and_bias(b, f"{prefix}.attn.proj"))


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
    angles = rotary_angles(b, grid, cfg)
    layouts = {}  # full / windowed: (segments, their cos and sin), built for the kinds of block there are

    def layout(full: bool):
        if full not in layouts:
            segments = grid.frames if full else grid.windows
            layouts[full] = segments, segment_rotary(b, angles, segments)
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
    """Qwen2_5_VLPatchMerger after its ln_q (``states``: the normed last hidden state): mlp.0 -> exact GELU ->
    mlp.2 over merge^2 patches side by side."""
    (h,) = states
    return merger_mlp(b, h, cfg, weight_and_bias(b, f"{prefix}mlp.0"), weight_and_bias(b, f"{prefix}mlp.2"))
