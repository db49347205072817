"""Qwen3.5's vision tower (transformers' Qwen3_5VisionModel) and its Qwen3_5VisionPatchMerger, and Qwen3-VL's
(Qwen3VLVisionModel: the same tower plus its deepstack mergers).

Its differences from Qwen2.5-VL's (exporter.vision.qwen2_5_vl): the patch Conv3d has a bias; a learned square
position table is resampled to each frame's patch grid (bilinear, corners aligned) and added to the patch
embedding; LayerNorms with biases; a plain MLP (linear_fc1 -> hidden_act -> linear_fc2); full attention within
each frame in every block (no windows); the merger's norm is a LayerNorm over one patch (before the patches of
a merged token go side by side).

Qwen3-VL's deepstack: after each block in VisionConfig.deepstack_layers, that block's output through its own
merger (Qwen3VLVisionPatchMerger(use_postshuffle_norm=True): the LayerNorm over the merge^2 patches side by side),
one more map of text-width rows per image token, which transformers' decoder adds to the hidden states at the image
positions after its first layers. The graph gives them beside the merged features on the last axis (the wide
image_features of exporter.contract.image_text_width): the consumers' decoders have no input of their own for them.
"""

from __future__ import annotations

import itertools

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.vision.config import VisionConfig
from exporter.vision.encoder import activation, layer_norm, skip_layer_norm
from exporter.vision.patch_grid import PatchGrid, patch_grid
from exporter.vision.patch_sequence import (
    merger_mlp, rotary_angles, segment_attention, segment_rotary, weight_and_bias,
)

FLOAT, I64 = ir.DataType.FLOAT, ir.DataType.INT64


def _axis_taps(b: GraphBuilder, index: ir.Value, size: ir.Value, side: int):
    """The two table rows (int64 [patches] each) and their weights (fp32) that resample a ``side``-long axis to
    ``size`` positions at ``index``, with transformers' _interpolation_axis_taps_weights' float32 arithmetic
    (bilinear, align_corners): src = index * (side - 1) / max(size - 1, 1); taps floor(src) and floor(src) + 1
    clamped to the table; weights 1 - |src - floor - offset| (never negative here: src - floor is in [0, 1))."""
    op = b.op

    def f32(x: ir.Value) -> ir.Value:
        return op("Cast", [x], {"to": FLOAT})

    last = b.scalar_i64(side - 1)
    src = op("Div", [op("Mul", [f32(index), f32(last)]),
                     f32(op("Max", [op("Sub", [size, b.scalar_i64(1)]), b.scalar_i64(1)]))])
    floor = op("Floor", [src])
    low = op("Cast", [floor], {"to": I64})
    taps = [op("Min", [low, last]), op("Min", [op("Add", [low, b.scalar_i64(1)]), last])]
    fraction = op("Sub", [src, floor])
    one = f32(b.scalar_i64(1))
    weights = [op("Sub", [one, op("Abs", [fraction])]),
               op("Sub", [one, op("Abs", [op("Sub", [fraction, one])])])]
    return taps, weights


def _position_embedding(b: GraphBuilder, grid: PatchGrid, cfg: VisionConfig, table: ir.Value) -> ir.Value:
    """[patches, hidden] in the model dtype: the square position ``table`` resampled to each patch's frame,
    at its (row, column), as Qwen3_5VisionModel resamples pos_embed: four table rows per patch, weighted by
    the products of the two axes' weights, summed in fp32 (transformers' fp32 weights promote the sum)."""
    op, side = b.op, cfg.position_side
    row_taps, row_weights = _axis_taps(b, grid.rows, grid.heights, side)
    col_taps, col_weights = _axis_taps(b, grid.cols, grid.widths, side)
    total = None
    for (row, row_weight), (col, col_weight) in itertools.product(zip(row_taps, row_weights),
                                                                  zip(col_taps, col_weights)):
        rows = op("Gather", [table, op("Add", [op("Mul", [row, b.scalar_i64(side)]), col])], {"axis": 0})
        if b.dtype != FLOAT:
            rows = op("Cast", [rows], {"to": FLOAT})
        weight = op("Unsqueeze", [op("Mul", [row_weight, col_weight]), b.ints(-1)])
        term = op("Mul", [rows, weight])
        total = term if total is None else op("Add", [total, term])
    return total if b.dtype == FLOAT else op("Cast", [total], {"to": b.dtype})


def _mlp(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str) -> ir.Value:
    """Qwen3_5VisionMLP: linear_fc2(act(linear_fc1(h))), both with biases."""
    up = linear(b, h, *weight_and_bias(b, f"{prefix}.mlp.linear_fc1"))
    return linear(b, activation(b, up, cfg.hidden_act), *weight_and_bias(b, f"{prefix}.mlp.linear_fc2"))


def qwen3_5_tower(b: GraphBuilder, pixels: ir.Value, grid_thw: ir.Value, cfg: VisionConfig, tower: str,
                  merger: str) -> ir.Value:
    """``pixels`` [patches, patch_dim] (model dtype) + ``grid_thw`` [images, 3] -> [patches / merge^2,
    cfg.feature_width]: the tower's pooler_output, image after image in the processor's order, and where the tower has
    deepstack mergers (Qwen3-VL) each deepstack map beside it: [pooler | map 0 | ... | map D-1]."""
    eps, d = cfg.layer_norm_eps, cfg.hidden_size
    # Conv3d with kernel = stride = the patch: one MatMul against the kernel flattened as the rows are.
    kernel = b.op("Reshape", [b.weight(f"{tower}patch_embed.proj.weight"), b.ints(d, cfg.patch_dim)])
    x = linear(b, pixels, kernel, b.weight(f"{tower}patch_embed.proj.bias"))
    grid = patch_grid(b, pixels, grid_thw, cfg.spatial_merge_size, window=0)
    x = b.op("Add", [x, _position_embedding(b, grid, cfg, b.weight(f"{tower}pos_embed.weight"))])
    rotary = segment_rotary(b, rotary_angles(b, grid, cfg), grid.frames)

    block = lambda i: f"{tower}blocks.{i}"  # noqa: E731
    h = layer_norm(b, x, f"{block(0)}.norm1" if cfg.num_layers else f"{merger}norm", eps)
    maps = []  # the deepstack maps, in the order transformers collects them (block by block)
    for i in range(cfg.num_layers):
        attention = segment_attention(b, h, cfg, grid.frames, rotary, weight_and_bias(b, f"{block(i)}.attn.qkv"),
                                      weight_and_bias(b, f"{block(i)}.attn.proj"))
        h, x = skip_layer_norm(b, x, attention, f"{block(i)}.norm2", eps)
        following = f"{block(i + 1)}.norm1" if i + 1 < cfg.num_layers else f"{merger}norm"
        h, x = skip_layer_norm(b, x, _mlp(b, h, cfg, block(i)), following, eps)
        if i in cfg.deepstack_layers:  # x: the block's output, what transformers hands the deepstack merger
            k = cfg.deepstack_mergers[cfg.deepstack_layers.index(i)]
            maps.append(deepstack_merger(b, x, cfg, deepstack_merger_prefix(tower, k)))
    merged = patch_merger(b, [h], cfg, merger)
    # Wide rows (contract.image_text_width): neither onnxruntime-genai's nor transformers.js's decoder takes an input
    # for the deepstack maps, but both hand the decoder image_features' rows unchanged inside inputs_embeds, so the maps
    # ride there, beside the merged features, and the decoder takes them apart again.
    return b.op("Concat", [merged, *maps], {"axis": -1}) if maps else merged


def deepstack_merger_prefix(tower: str, k: int) -> str:
    """The checkpoint's name of deepstack merger ``k`` (with its trailing dot), under the tower's prefix."""
    return f"{tower}deepstack_merger_list.{k}."


def deepstack_merger(b: GraphBuilder, x: ir.Value, cfg: VisionConfig, prefix: str) -> ir.Value:
    """Qwen3VLVisionPatchMerger(use_postshuffle_norm=True) on a block's output ``x`` [patches, hidden]: merge^2
    consecutive patches (one merged token's) side by side, its LayerNorm over all of them (eps 1e-6, fixed in
    transformers), then linear_fc1 -> exact GELU -> linear_fc2 to the text width."""
    wide = b.op("Reshape", [x, b.ints(-1, cfg.hidden_size * cfg.spatial_merge_size ** 2)])
    return merger_mlp(b, layer_norm(b, wide, f"{prefix}norm", cfg.layer_norm_eps), cfg,
                      weight_and_bias(b, f"{prefix}linear_fc1"), weight_and_bias(b, f"{prefix}linear_fc2"))


def patch_merger(b: GraphBuilder, states: list[ir.Value], cfg: VisionConfig, prefix: str) -> ir.Value:
    """Qwen3_5VisionPatchMerger(use_postshuffle_norm=False) after its norm (``states``: the normed last hidden
    state): linear_fc1 -> exact GELU -> linear_fc2 over merge^2 patches side by side."""
    (h,) = states
    return merger_mlp(b, h, cfg, weight_and_bias(b, f"{prefix}linear_fc1"), weight_and_bias(b, f"{prefix}linear_fc2"))
