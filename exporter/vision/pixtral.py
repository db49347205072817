"""mistral3's vision graph: the Pixtral tower (transformers' PixtralVisionModel) and the Mistral3MultiModalProjector
with its patch merger, over a batch of images of their own sizes padded to the largest.

Pixtral runs every image at its own resolution: the patch Conv over the padded batch, then each image's patches
(height // patch rows of width // patch columns, row-major) as one sequence, image after image. Everything that
follows from the sizes is integer index arithmetic on ``image_sizes`` in the graph, as exporter.vision.patch_grid does
for Qwen's grids (no Loop, one graph for every size):

* patch n -> its image (n against the images' cumulative patch counts), its (row, column) in that image, and the row
  of the Conv's padded output it is gathered from;
* the 2-D rotary on (row, column): transformers' PixtralVisionRotaryEmbedding gives the rows the even frequencies
  of the head's inv_freq and the columns the odd ones (``rotary_angles``);
* attention within each image (transformers' block-diagonal mask): the images as segments of
  patch_sequence.segment_attention (MultiHeadAttention with key lengths);
* the patch merger: merged token u of an image of w patch columns reads the patches (2 br + ki, 2 bc + kj) of its
  block, side by side channel-major as torch's ``unfold`` lays them out, then ``merging_layer``.

Where the fed ``image_sizes`` are 0 (the input's default, contract.IMAGE_SIZES) each image is the whole of
pixel_values: what onnxruntime-genai (one image per run) and transformers.js (one image) feed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.mlp import gate_activation
from exporter.graph.components.norm import residual_rms_norm, rms_norm
from exporter.vision.config import VisionConfig
from exporter.vision.encoder import activation
from exporter.vision.patch_grid import segment_layout
from exporter.vision.patch_sequence import segment_attention, segment_rotary

FLOAT, I64 = ir.DataType.FLOAT, ir.DataType.INT64


class _Index:
    """Integer index arithmetic on int64 values (non-negative: Div floors)."""

    def __init__(self, b: GraphBuilder):
        self.b = b

    def _v(self, x):
        return self.b.scalar_i64(x) if isinstance(x, int) else x

    def add(self, x, y):
        return self.b.op("Add", [self._v(x), self._v(y)])

    def sub(self, x, y):
        return self.b.op("Sub", [self._v(x), self._v(y)])

    def mul(self, x, y):
        return self.b.op("Mul", [self._v(x), self._v(y)])

    def div(self, x, y):
        return self.b.op("Div", [self._v(x), self._v(y)])

    def take(self, per_image: ir.Value, image: ir.Value) -> ir.Value:
        return self.b.op("Gather", [per_image, image], {"axis": 0})

    def runs(self, counts: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
        """``counts`` [images] -> over their sum of items laid out image after image: (the items 0.., each item's
        image, its index within its image), and each image's first item [images]."""
        op = self.b.op
        ends = op("CumSum", [counts, self.b.scalar_i64(0)])
        total = op("ReduceSum", [counts, self.b.ints(0)], {"keepdims": 0})
        n = op("Range", [self.b.scalar_i64(0), total, self.b.scalar_i64(1)])
        past = op("GreaterOrEqual", [op("Unsqueeze", [n, self.b.ints(-1)]), ends])
        image = op("ReduceSum", [op("Cast", [past], {"to": I64}), self.b.ints(1)], {"keepdims": 0})
        starts = self.sub(ends, counts)
        return n, image, self.sub(n, self.take(starts, image)), starts


def rotary_angles(b: GraphBuilder, rows: ir.Value, cols: ir.Value, cfg: VisionConfig) -> ir.Value:
    """[patches, head_dim / 2] fp32: PixtralVisionRotaryEmbedding's angles before its cos / sin, the row times the even
    entries of inv_freq = 1 / theta^(arange(0, head_dim, 2) / head_dim), then the column times the odd ones (what
    transformers repeats over both halves of the head for rotate_half). inv_freq in fp32 from integers, as transformers
    computes it."""
    op, dim = b.op, cfg.head_dim
    evens = op("Range", [b.scalar_i64(0), b.scalar_i64(dim), b.scalar_i64(2)])
    exponent = op("Div", [op("Cast", [evens], {"to": FLOAT}), op("Cast", [b.scalar_i64(dim)], {"to": FLOAT})])
    inv_freq = op("Reciprocal", [op("Pow", [op("Cast", [b.scalar_i64(cfg.rope_theta)], {"to": FLOAT}), exponent])])
    half = dim // 2

    def angles(position: ir.Value, start: int) -> ir.Value:
        freq = op("Slice", [inv_freq, b.ints(start), b.ints(half), b.ints(0), b.ints(2)])
        return op("Mul", [op("Unsqueeze", [op("Cast", [position], {"to": FLOAT}), b.ints(-1)]), freq])

    return op("Concat", [angles(rows, 0), angles(cols, 1)], {"axis": -1})


def _mlp(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str) -> ir.Value:
    """PixtralMLP: down(act(gate(h)) * up(h)), no biases, gate and up in one MatMul."""
    mlp, inner = f"{prefix}.feed_forward", cfg.intermediate_size
    gate_up = packed(b, [b.weight(f"{mlp}.gate_proj.weight"), b.weight(f"{mlp}.up_proj.weight")])
    gate, up = b.op_multi("Split", [linear(b, h, gate_up), b.ints(inner, inner)], {"axis": -1}, num_outputs=2)
    act = gate_activation(b, gate, cfg.hidden_act) if cfg.hidden_act == "silu" else activation(b, gate, cfg.hidden_act)
    return linear(b, b.op("Mul", [act, up]), b.weight(f"{mlp}.down_proj.weight"))


def pixtral_tower(b: GraphBuilder, pixels: ir.Value, image_sizes: ir.Value, cfg: VisionConfig, tower: str,
                  projector: str) -> ir.Value:
    """``pixels`` [images, channels, H, W] (model dtype, each image top-left, zero padding) + ``image_sizes`` int64
    [images, 2] ((height, width) in pixels; 0: the whole padded image; a [1, 2] row of zeros for every image) ->
    [image tokens, text hidden]: transformers' get_image_features, its per-image tuple concatenated."""
    op, ix, p, d = b.op, _Index(b), cfg.patch_size, cfg.hidden_size
    conv = op("Conv", [pixels, b.weight(f"{tower}patch_conv.weight")], {"kernel_shape": [p, p], "strides": [p, p]})
    table = op("Reshape", [op("Transpose", [conv], {"perm": [0, 2, 3, 1]}), b.ints(-1, d)])  # [images * Hp * Wp, d]
    padded = op("Shape", [conv])  # images, d, Hp, Wp
    images = op("Slice", [padded, b.ints(0), b.ints(1)])
    padded_h, padded_w = (op("Gather", [padded, b.scalar_i64(k)]) for k in (2, 3))
    fed = op("Where", [op("Greater", [image_sizes, b.scalar_i64(0)]), image_sizes, op("Shape", [pixels], {"start": 2})])
    grid = ix.div(op("Expand", [fed, op("Concat", [images, b.ints(2)], {"axis": 0})]), p)  # patch rows, columns
    h, w = (op("Gather", [grid, b.scalar_i64(k)], {"axis": 1}) for k in (0, 1))

    # Each patch: its image, (row, column), and its row of the Conv's padded output.
    n, image, local, image_first = ix.runs(ix.mul(h, w))
    width = ix.take(w, image)
    rows = ix.div(local, width)
    cols = ix.sub(local, ix.mul(rows, width))
    source = ix.add(ix.mul(ix.add(ix.mul(image, padded_h), rows), padded_w), cols)
    x = rms_norm(b, op("Gather", [table, source], {"axis": 0}), b.weight(f"{tower}ln_pre.weight"), cfg.layer_norm_eps)

    # Attention within each image: one segment per image, its patches in order, as long as the largest image.
    segments = segment_layout(b, n, image, local, op("Shape", [h]),
                              op("ReduceMax", [ix.mul(h, w), b.ints(0)], {"keepdims": 1}))
    rotary = segment_rotary(b, rotary_angles(b, rows, cols, cfg), segments)

    layer = lambda i: f"{tower}transformer.layers.{i}"  # noqa: E731
    norm = f"{projector}norm.weight"
    eps = cfg.layer_norm_eps
    if not cfg.num_layers:  # hidden_states[0]: ln_pre's output
        h_normed = rms_norm(b, x, b.weight(norm), cfg.projector_norm_eps)
    else:
        h_normed = rms_norm(b, x, b.weight(f"{layer(0)}.attention_norm.weight"), eps)
    for i in range(cfg.num_layers):
        attn = f"{layer(i)}.attention"
        qkv = packed(b, [b.weight(f"{attn}.{name}_proj.weight") for name in "qkv"])
        out = (b.weight(f"{attn}.o_proj.weight"), None)
        update = segment_attention(b, h_normed, cfg, segments, rotary, (qkv, None), out)
        h_normed, x = residual_rms_norm(b, x, update, b.weight(f"{layer(i)}.ffn_norm.weight"), eps)
        last = i + 1 == cfg.num_layers  # the feature layer: the projector's norm follows
        following, following_eps = ((norm, cfg.projector_norm_eps) if last else
                                    (f"{layer(i + 1)}.attention_norm.weight", eps))
        h_normed, x = residual_rms_norm(b, x, _mlp(b, h_normed, cfg, layer(i)), b.weight(following), following_eps)
    return _patch_merger(b, ix, h_normed, h, w, image_first, cfg, projector)


def _patch_merger(b: GraphBuilder, ix: _Index, normed: ir.Value, h: ir.Value, w: ir.Value, image_first: ir.Value,
                  cfg: VisionConfig, projector: str) -> ir.Value:
    """Mistral3PatchMerger then linear_1 -> act -> linear_2, on the projector's normed patches [patches, d]: per image
    (h x w patches) its (h // m) x (w // m) blocks row-major (a last odd row or column of patches left out, as unfold
    leaves it), each block's m x m patches side by side channel-major ([d, m * m] flattened, torch's unfold order).
    ``h``, ``w``: each image's patch rows and columns; ``image_first``: each image's first patch."""
    op, m, d = b.op, cfg.spatial_merge_size, cfg.hidden_size
    blocks_w = ix.div(w, m)
    _, token_image, token, _ = ix.runs(ix.mul(ix.div(h, m), blocks_w))
    per_row = ix.take(blocks_w, token_image)
    block_row = ix.div(token, per_row)
    block_col = ix.sub(token, ix.mul(block_row, per_row))
    width = ix.take(w, token_image)
    corner = ix.add(ix.take(image_first, token_image),
                    ix.add(ix.mul(ix.mul(block_row, m), width), ix.mul(block_col, m)))  # [tokens]
    ki, kj = np.divmod(np.arange(m * m, dtype=np.int64), m)
    offsets = op("Add", [op("Mul", [op("Unsqueeze", [width, b.ints(-1)]), b.constant(ki, "pixtral_merge_rows")]),
                         b.constant(kj, "pixtral_merge_cols")])  # [tokens, m * m]
    index = op("Add", [op("Unsqueeze", [corner, b.ints(-1)]), offsets])
    blocks = op("Transpose", [op("Gather", [normed, index], {"axis": 0})], {"perm": [0, 2, 1]})  # [tokens, d, m * m]
    merged = linear(b, op("Reshape", [blocks, b.ints(-1, d * m * m)]),
                    b.weight(f"{projector}patch_merger.merging_layer.weight"))

    def bias(name: str) -> ir.Value | None:
        return b.weight(name) if b.has_weight(name) else None

    up = linear(b, merged, b.weight(f"{projector}linear_1.weight"), bias(f"{projector}linear_1.bias"))
    return linear(b, activation(b, up, cfg.projector_act), b.weight(f"{projector}linear_2.weight"),
                  bias(f"{projector}linear_2.bias"))
