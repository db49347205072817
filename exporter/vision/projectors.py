"""What turns a tower's hidden states into text-width image features, one function per kind:
gemma3's pooled, soft-normed projection, llava's two-layer MLP, idefics3's pixel shuffle + projection.
Each takes ``prefix``, the checkpoint's name for the projector module (with its trailing dot)."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.norm import rms_norm
from exporter.packaging.checkpoint import WeightPart
from exporter.vision.config import VisionConfig
from exporter.vision.encoder import activation


def gemma3_projector(b: GraphBuilder, states: list[ir.Value], cfg: VisionConfig, prefix: str) -> ir.Value:
    """Gemma3MultiModalProjector: the patch grid average-pooled in k x k blocks (a mean over the
    reshaped blocks, channels last: no transposes), Gemma's RMSNorm (scale 1 + weight), then
    ``@ mm_input_projection_weight`` ([vision hidden, text hidden], already the MatMul's layout)."""
    (x,) = states
    k, side, d = cfg.pool_kernel, cfg.grid // cfg.pool_kernel, cfg.hidden_size
    blocks = b.op("Reshape", [x, b.ints(0, side, k, side, k, d)])
    pooled = b.op("ReduceMean", [blocks, b.ints(2, 4)], {"keepdims": 0})
    pooled = b.op("Reshape", [pooled, b.ints(0, side * side, d)])
    norm = f"{prefix}mm_soft_emb_norm.weight"
    normed = rms_norm(b, pooled, b.weight(norm, WeightPart(norm, add=1.0)), cfg.layer_norm_eps)
    return b.op("MatMul", [normed, b.weight(f"{prefix}mm_input_projection_weight")])


def llava_projector(b: GraphBuilder, states: list[ir.Value], cfg: VisionConfig, prefix: str) -> ir.Value:
    """LlavaMultiModalProjector on the selected hidden states: each without its first token under the
    "default" strategy, concatenated along channels, then linear_1 -> act -> linear_2 (biases where the
    checkpoint has them: multimodal_projector_bias)."""
    if cfg.drop_class_token:
        states = [b.op("Slice", [s, b.ints(1), b.ints(1 << 62), b.ints(1)]) for s in states]
    x = states[0] if len(states) == 1 else b.op("Concat", states, {"axis": -1})

    def bias(name: str) -> ir.Value | None:
        return b.weight(name) if b.has_weight(name) else None

    up = linear(b, x, b.weight(f"{prefix}linear_1.weight"), bias(f"{prefix}linear_1.bias"))
    return linear(b, activation(b, up, cfg.projector_act), b.weight(f"{prefix}linear_2.weight"),
                  bias(f"{prefix}linear_2.bias"))


def pixel_shuffle_projector(b: GraphBuilder, states: list[ir.Value], cfg: VisionConfig, prefix: str) -> ir.Value:
    """Idefics3Connector: s x s neighbouring patches folded into one token of s^2 x hidden channels
    (transformers' pixel_shuffle, reshape for reshape), then modality_projection.proj (no bias)."""
    (x,) = states
    s, n, d = cfg.scale_factor, cfg.grid, cfg.hidden_size
    x = b.op("Reshape", [x, b.ints(0, n, n // s, d * s)])
    x = b.op("Transpose", [x], {"perm": [0, 2, 1, 3]})
    x = b.op("Reshape", [x, b.ints(0, n // s, n // s, d * s * s)])
    x = b.op("Transpose", [x], {"perm": [0, 2, 1, 3]})
    x = b.op("Reshape", [x, b.ints(0, (n // s) ** 2, d * s * s)])
    return linear(b, x, b.weight(f"{prefix}modality_projection.proj.weight"))
