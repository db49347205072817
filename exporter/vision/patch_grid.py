"""Where each patch of a dynamic-resolution image batch sits, computed in the graph from ``image_grid_thw``:
its (row, column) for a 2-D rotary, and the segments attention stays within (the frames, or windows of
merged tokens), so that any grid the image processor makes runs through one graph, with no Loop.

The patches arrive as the Qwen2-VL family's processors lay them out: image after image, frame after
frame, and within a frame block-major over ``merge`` x ``merge`` blocks (the patches one merged token
is made of are consecutive). Everything here is integer index arithmetic on that order:

* patch n -> its image (n compared against the images' cumulative sizes: [patches, images], no Loop),
  then its frame and its index q in the frame, then block (row, col) and the offset in the block.
* A segment layout puts each patch in slot ``segment * length + position``, positions packed from 0 in
  the reference's own order, so a segment's real patches are a prefix (key lengths, no 2-D mask).
  Attention runs batched over [segments, length, ...] and the result is gathered back to patch order.

transformers reorders the whole sequence window by window (``window_index``) and sorts it back after
the merger (``argsort``); attention within a segment, the rest per token and the merger per merged
token (the reorder moves whole merged tokens) make that reorder a no-op on the result, so the graph
keeps patch order and only gathers into the windowed layout around each attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder

I64, I32 = ir.DataType.INT64, ir.DataType.INT32


@dataclasses.dataclass(frozen=True)
class Segments:
    """A padded batched layout of the patches: ``segments`` x ``length`` slots (1-D int64 [1] each)."""

    slots: ir.Value  # [patches] int64: each patch's slot, segment * length + position
    rows: ir.Value  # [segments * length] int64: the patch in each slot (0 in padding slots: never a real key)
    lengths: ir.Value  # [segments] int32: real patches per segment, a prefix (MultiHeadAttention's key lengths)
    shape: ir.Value  # [2] int64: (segments, length)


@dataclasses.dataclass(frozen=True)
class PatchGrid:
    rows: ir.Value  # [patches] int64: the patch's row in its frame (the rotary's first axis)
    cols: ir.Value  # [patches] int64: its column
    heights: ir.Value  # [patches] int64: patch rows of the patch's frame (what a position table is resampled to)
    widths: ir.Value  # [patches] int64: patch columns of its frame
    frames: Segments  # one segment per frame of each image: full attention
    # One per window of window x window merged tokens (edge windows smaller): window attention; None for window 0
    # (a tower with full attention in every block).
    windows: Segments | None


def patch_grid(b: GraphBuilder, pixels: ir.Value, grid_thw: ir.Value, merge: int, window: int) -> PatchGrid:
    """``pixels`` [patches, ...] (only its row count is read) and ``grid_thw`` int64 [images, 3] (frames,
    rows, columns of patches, rows and columns multiples of ``merge``) -> the PatchGrid.

    Windows are those of transformers' get_vision_window_index: per frame, ceil(rows / merge / window) x
    ceil(cols / merge / window) windows in row-major order, merged tokens row-major inside each; the
    empty windows its padding makes are not made here (they hold no patch either way). ``window`` 0: no windows."""
    op = b.op

    def col(k: int) -> ir.Value:
        return op("Gather", [grid_thw, b.scalar_i64(k)], {"axis": 1})  # [images]

    def floor_div(x: ir.Value, d) -> ir.Value:  # non-negative operands: Div truncates = floors
        return op("Div", [x, b.scalar_i64(d) if isinstance(d, int) else d])

    def mul(x: ir.Value, y) -> ir.Value:
        return op("Mul", [x, b.scalar_i64(y) if isinstance(y, int) else y])

    def add(*xs: ir.Value) -> ir.Value:
        total = xs[0]
        for x in xs[1:]:
            total = op("Add", [total, x])
        return total

    t, h, w = col(0), col(1), col(2)
    frame_size = mul(h, w)
    image_size = mul(t, frame_size)
    image_end = op("CumSum", [image_size, b.scalar_i64(0)])
    count = op("Gather", [op("Shape", [pixels]), b.scalar_i64(0)])
    n = op("Range", [b.scalar_i64(0), count, b.scalar_i64(1)])
    # Each patch's image: how many images end at or before it.
    past = op("GreaterOrEqual", [op("Unsqueeze", [n, b.ints(-1)]), image_end])
    image = op("ReduceSum", [op("Cast", [past], {"to": I64}), b.ints(1)], {"keepdims": 0})

    def per_patch(per_image: ir.Value) -> ir.Value:
        return op("Gather", [per_image, image], {"axis": 0})

    local = op("Sub", [n, per_patch(op("Sub", [image_end, image_size]))])
    size = per_patch(frame_size)
    frame = floor_div(local, size)
    q = op("Sub", [local, mul(frame, size)])  # index in the frame
    unit = floor_div(q, merge * merge)  # merged token in the frame
    offset = op("Sub", [q, mul(unit, merge * merge)])  # patch in the merged token
    tokens_w = floor_div(w, merge)
    tokens_h = floor_div(h, merge)
    token_cols = per_patch(tokens_w)
    token_row = floor_div(unit, token_cols)
    token_col = op("Sub", [unit, mul(token_row, token_cols)])
    rows = add(mul(token_row, merge), floor_div(offset, merge))
    cols = add(mul(token_col, merge), op("Mod", [offset, b.scalar_i64(merge)]))

    # Frames: segment = the frame's index over all images, position = q; as long as the largest frame.
    frame_base = per_patch(op("CumSum", [t, b.scalar_i64(0)], {"exclusive": 1}))
    frames = segment_layout(b, n, add(frame_base, frame), q, op("ReduceSum", [t, b.ints(0)], {"keepdims": 1}),
                            op("ReduceMax", [frame_size, b.ints(0)], {"keepdims": 1}))
    grid = dict(rows=rows, cols=cols, heights=per_patch(h), widths=per_patch(w), frames=frames)
    if not window:
        return PatchGrid(**grid, windows=None)

    # Windows: window (row, col) of the merged token; its window's width (the last column's is what is left).
    def ceil_div(x: ir.Value) -> ir.Value:
        return floor_div(op("Add", [x, b.scalar_i64(window - 1)]), window)

    windows_w = ceil_div(tokens_w)
    per_frame = mul(ceil_div(tokens_h), windows_w)
    window_base = per_patch(op("CumSum", [mul(t, per_frame), b.scalar_i64(0)], {"exclusive": 1}))
    window_row, window_col = floor_div(token_row, window), floor_div(token_col, window)
    width = op("Min", [b.scalar_i64(window), op("Sub", [token_cols, mul(window_col, window)])])
    segment = add(window_base, mul(frame, per_patch(per_frame)), mul(window_row, per_patch(windows_w)), window_col)
    inner = add(mul(op("Sub", [token_row, mul(window_row, window)]), width),
                op("Sub", [token_col, mul(window_col, window)]))
    position = add(mul(inner, merge * merge), offset)
    total = op("ReduceSum", [mul(t, per_frame), b.ints(0)], {"keepdims": 1})
    windows = segment_layout(b, n, segment, position, total, b.ints(window * window * merge * merge))
    return PatchGrid(**grid, windows=windows)


def segment_layout(b: GraphBuilder, n: ir.Value, segment: ir.Value, position: ir.Value, count: ir.Value,
                   length: ir.Value) -> Segments:
    """The slot maps of a layout from each patch's (segment, position) (``n``: the patches, 0..patches-1); ``count``
    (segments) and ``length`` (slots per segment, at least the longest segment) 1-D [1]."""
    op = b.op
    slots = op("Add", [op("Mul", [segment, length]), position])
    empty = op("ConstantOfShape", [op("Mul", [count, length])], {"value": ir.tensor(np.zeros(1, np.int64))})
    rows = op("ScatterElements", [empty, slots, n], {"axis": 0})
    ones = op("ConstantOfShape", [op("Shape", [n])], {"value": ir.tensor(np.ones(1, np.int32))})
    zeros = op("ConstantOfShape", [count], {"value": ir.tensor(np.zeros(1, np.int32))})
    lengths = op("ScatterElements", [zeros, segment, ones], {"axis": 0, "reduction": "add"})
    return Segments(slots=slots, rows=rows, lengths=lengths, shape=op("Concat", [count, length], {"axis": 0}))


def to_segments(b: GraphBuilder, x: ir.Value, segments: Segments) -> ir.Value:
    """[patches, channels] -> [segments, length, channels] (padding slots hold patch 0's values)."""
    gathered = b.op("Gather", [x, segments.rows], {"axis": 0})
    return b.op("Reshape", [gathered, b.op("Concat", [segments.shape, b.ints(-1)], {"axis": 0})])


def from_segments(b: GraphBuilder, y: ir.Value, segments: Segments, channels: int) -> ir.Value:
    """[segments, length, channels] -> [patches, channels] in patch order (padding slots dropped)."""
    return b.op("Gather", [b.op("Reshape", [y, b.ints(-1, channels)]), segments.slots], {"axis": 0})
