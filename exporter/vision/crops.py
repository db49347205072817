"""idefics3 / smolvlm's vision encoder on what transformers.js 4.3 feeds it (the hf layout's onnx/vision_encoder): each
prompt's images split into crops, the prompts' crops zero-padded to the batch's most, and a pixel mask.

transformers' Idefics3Model.get_image_features (SmolVLMModel's likewise) flattens pixel_values [batch, crops, 3, H, W]
to crops, drops the crops whose pixels are all zero (the padding ones) by value, keeps the pixel_attention_mask rows of
the others, and makes a patch attention mask of it (a patch is real where any of its pixels is). The tower then reads
each crop's patch grid through that mask: its position ids are bucketized from the real patches' rows and columns, and
its attention reads the real patches only. All of it is computed here in the graph, so crops with padded pixels give
transformers' features too (transformers.js's own processor makes only whole crops: the mask is all True on a real one).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder
from exporter.vision.config import VisionConfig

# The families whose hf layout's vision_encoder takes the crops (graphs.build_crops_vision_graph).
CROPS_FAMILIES = ("idefics3", "smolvlm")
# SmolVLMModel.get_image_features keeps the first crop when every crop is zero ("If no images, leave one empty
# image"); Idefics3Model's drops them all.
KEEPS_AN_EMPTY_CROP = ("smolvlm",)


def real_crops(b: GraphBuilder, pixels: ir.Value, mask: ir.Value, cfg: VisionConfig) -> tuple[ir.Value, ir.Value]:
    """pixel_values [batch, crops, channels, S, S] fp32 and pixel_attention_mask [batch, crops, S, S] bool -> (the
    crops not all zero in the model dtype [real, channels, S, S], their masks [real, S, S]), batch after batch as
    transformers keeps them. The zero test is on the model dtype's pixels, as transformers casts before it."""
    size = cfg.image_size
    flat = b.op("Reshape", [pixels, b.ints(-1, cfg.num_channels, size, size)])
    if b.dtype != ir.DataType.FLOAT:
        flat = b.op("Cast", [flat], {"to": b.dtype})
    nonzero = b.op("Cast", [b.op("Not", [b.op("Equal", [flat, b.scalar(0.0)])])], {"to": ir.DataType.FLOAT})
    any_nonzero = b.op("ReduceMax", [nonzero, b.ints(1, 2, 3)], {"keepdims": 0})  # [batch * crops], 1.0 or 0.0
    real = b.op("Cast", [any_nonzero], {"to": ir.DataType.BOOL})
    if cfg.model_type in KEEPS_AN_EMPTY_CROP:  # real[0] |= not any(real)
        some = b.op("Cast", [b.op("ReduceMax", [any_nonzero], {"keepdims": 1})], {"to": ir.DataType.BOOL})
        none = b.op("Not", [some])
        ones = b.op("ConstantOfShape", [b.op("Shape", [real])], {"value": ir.tensor(np.array([1], np.int64))})
        first = b.op("Equal", [b.op("CumSum", [ones, b.scalar_i64(0)]), b.scalar_i64(1)])
        real = b.op("Or", [real, b.op("And", [first, none])])
    kept = b.op("Reshape", [b.op("NonZero", [real]), b.ints(-1)])
    crops = b.op("Gather", [flat, kept], {"axis": 0})
    masks = b.op("Gather", [b.op("Reshape", [mask, b.ints(-1, size, size)]), kept], {"axis": 0})
    return crops, masks


def patch_mask(b: GraphBuilder, masks: ir.Value, cfg: VisionConfig) -> ir.Value:
    """Pixel masks [real, S, S] bool -> the patch attention mask [real, grid, grid] bool: a patch is real where any
    of its pixels is (transformers' unfold, sum > 0; pixels past the last whole patch dropped as unfold drops them)."""
    p, n = cfg.patch_size, cfg.grid
    if n * p != cfg.image_size:
        masks = b.op("Slice", [masks, b.ints(0, 0), b.ints(n * p, n * p), b.ints(1, 2)])
    blocks = b.op("Reshape", [b.op("Cast", [masks], {"to": ir.DataType.INT32}), b.ints(0, n, p, n, p)])
    return b.op("Cast", [b.op("ReduceMax", [blocks, b.ints(2, 4)], {"keepdims": 0})], {"to": ir.DataType.BOOL})


def _boundaries(n: int) -> np.ndarray:
    """Idefics3VisionEmbeddings' bucket boundaries, torch.arange(1 / n, 1.0, 1 / n) in float32 as torch computes them
    (its float arange rounds by its own rule; the length, too, is torch's)."""
    import torch

    return torch.arange(1 / n, 1.0, 1 / n).numpy().astype(np.float32)


def position_ids(b: GraphBuilder, patches: ir.Value, cfg: VisionConfig) -> ir.Value:
    """The patch attention mask [real, grid, grid] -> each patch's row of the position table [real, grid * grid]
    int64, as Idefics3VisionEmbeddings computes them: the real patches' rows (columns) counted down the first column
    (along the first row), each index times 1 / count in float32, clamped below 1, bucketized into the table's grid
    (right=True: the boundaries at or below it), row * grid + column; 0 at a padded patch. A whole crop gives
    families.idefics3_position_ids."""
    n = cfg.grid
    f32 = ir.DataType.FLOAT
    steps = b.constant(np.arange(n, dtype=np.float32), "crop_patch_index")
    edges = b.constant(_boundaries(n), "crop_position_boundaries")
    limit = b.constant(np.array(1.0 - 1e-6, np.float32), "crop_coordinate_limit")

    def buckets(along: ir.Value) -> ir.Value:  # [real, grid] bool, one line of patches -> [real, grid] int64
        count = b.op("ReduceSum", [b.op("Cast", [along], {"to": ir.DataType.INT64}), b.ints(1)], {"keepdims": 1})
        # Reciprocal, not Div(1, count): onnxruntime's DivMulFusion turns Div(1, c) * i into i / c, which rounds
        # otherwise than transformers' i * (1 / c) (SmolVLM's 25-patch grid: positions 5 and 10 land a bucket higher)
        step = b.op("Reciprocal", [b.op("Cast", [count], {"to": f32})])  # [real, 1]
        coords = b.op("Min", [b.op("Mul", [steps, step]), limit])  # [real, grid]
        below = b.op("LessOrEqual", [edges, b.op("Unsqueeze", [coords, b.ints(-1)])])  # [real, grid, edges]
        return b.op("ReduceSum", [b.op("Cast", [below], {"to": ir.DataType.INT64}), b.ints(-1)], {"keepdims": 0})

    rows = buckets(b.op("Gather", [patches, b.scalar_i64(0)], {"axis": 2}))  # down the first column
    cols = buckets(b.op("Gather", [patches, b.scalar_i64(0)], {"axis": 1}))  # along the first row
    ids = b.op("Add", [b.op("Mul", [b.op("Unsqueeze", [rows, b.ints(2)]), b.scalar_i64(n)]),
                       b.op("Unsqueeze", [cols, b.ints(1)])])
    ids = b.op("Reshape", [ids, b.ints(0, -1)])
    return b.op("Where", [b.op("Reshape", [patches, b.ints(0, -1)]), ids, b.scalar_i64(0)])


def key_mask(b: GraphBuilder, patches: ir.Value, cfg: VisionConfig) -> ir.Value:
    """The patch attention mask [real, grid, grid] -> the Attention op's bool attn_mask [real, 1, patches, patches]:
    every query reads the real patches only (transformers' bidirectional mask of it). Spelled out over the queries:
    onnxruntime's Attention does not broadcast a mask's query dim."""
    keys = b.op("Reshape", [patches, b.ints(0, 1, 1, -1)])
    return b.op("Expand", [keys, b.ints(1, 1, cfg.grid * cfg.grid, 1)])
