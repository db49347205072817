"""The ViT vision towers (CLIP, SigLIP): patch embedding, bidirectional pre-norm encoder layers.

Fused where onnxruntime has the op: opset-24 ``Attention`` (no mask, not causal) on BSNH Q/K/V,
LayerNormalization for the first norm and com.microsoft SkipLayerNormalization for every norm that
follows a residual add, Gelu (opset 20) / com.microsoft QuickGelu for the MLP. The patch embedding is
one Conv whose kernel and stride are the patch size.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.norm import residual_rms_norm, rms_norm
from exporter.vision.config import CLIP, VisionConfig


def activation(b: GraphBuilder, x: ir.Value, act: str) -> ir.Value:
    """transformers' ACT2FN[act] for the activations config.ACTIVATIONS lists."""
    if act == "gelu_pytorch_tanh":
        return b.op("Gelu", [x], {"approximate": "tanh"})
    if act == "gelu":
        return b.op("Gelu", [x])
    return b.op("QuickGelu", [x], {"alpha": 1.702}, domain="com.microsoft")  # quick_gelu: x * sigmoid(1.702 x)


def layer_norm(b: GraphBuilder, x: ir.Value, prefix: str, eps: float) -> ir.Value:
    """LayerNorm with weight and bias (statistics in fp32, as torch computes them)."""
    return rms_norm(b, x, b.weight(f"{prefix}.weight"), eps, bias=b.weight(f"{prefix}.bias"))


def skip_layer_norm(b: GraphBuilder, residual: ir.Value, update: ir.Value, prefix: str, eps: float):
    """(LayerNorm(residual + update), residual + update) in one SkipLayerNormalization."""
    return residual_rms_norm(b, residual, update, b.weight(f"{prefix}.weight"), eps, bias=b.weight(f"{prefix}.bias"))


def patch_embeddings(b: GraphBuilder, pixels: ir.Value, cfg: VisionConfig, tower: str,
                     position_ids: np.ndarray | ir.Value | None = None) -> ir.Value:
    """pixel_values [images, channels, H, W] (model dtype) -> [images, patches (+1 class token), hidden]:
    the patch Conv, CLIP's class token in front, the learned position embedding added (``position_ids``:
    rows of the table per token, where they are not simply 0..n-1; a graph value [images, patches] where
    each image has its own, computed in the graph: exporter.vision.crops)."""
    p = cfg.patch_size
    conv_bias = f"{tower}embeddings.patch_embedding.bias"
    inputs = [pixels, b.weight(f"{tower}embeddings.patch_embedding.weight")]
    if b.has_weight(conv_bias):  # SigLIP's Conv has a bias, CLIP's none
        inputs.append(b.weight(conv_bias))
    patches = b.op("Conv", inputs, {"kernel_shape": [p, p], "strides": [p, p]})
    # [images, hidden, grid, grid] -> [images, grid * grid, hidden], row-major patches as torch's flatten(2)
    x = b.op("Transpose", [b.op("Reshape", [patches, b.ints(0, cfg.hidden_size, -1)])], {"perm": [0, 2, 1]})
    if cfg.tower == CLIP:
        cls = b.op("Reshape", [b.weight(f"{tower}embeddings.class_embedding"), b.ints(1, 1, cfg.hidden_size)])
        images = b.op("Slice", [b.op("Shape", [pixels]), b.ints(0), b.ints(1)])
        cls = b.op("Expand", [cls, b.op("Concat", [images, b.ints(1, cfg.hidden_size)], {"axis": 0})])
        x = b.op("Concat", [cls, x], {"axis": 1})
    table = b.weight(f"{tower}embeddings.position_embedding.weight")
    if isinstance(position_ids, ir.Value):  # [images, patches] -> [images, patches, hidden]
        table = b.op("Gather", [table, position_ids], {"axis": 0})
    elif position_ids is not None:
        table = b.op("Gather", [table, b.constant(position_ids.astype(np.int64), "vision_position_ids")], {"axis": 0})
    return b.op("Add", [x, table])


def _attention(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str,
               key_mask: ir.Value | None = None) -> ir.Value:
    """Bidirectional multi-head self-attention, Q/K/V packed into one MatMul; ``key_mask``: bool
    [images, 1, patches, patches], the patches each query may attend to (the Attention op's boolean attn_mask)."""
    attn = f"{prefix}.self_attn"
    qkv = packed(b, [b.weight(f"{attn}.{n}_proj.weight") for n in "qkv"])
    bias = packed(b, [b.weight(f"{attn}.{n}_proj.bias") for n in "qkv"])
    d = cfg.hidden_size
    q, k, v = b.op_multi("Split", [linear(b, h, qkv, bias), b.ints(d, d, d)], {"axis": -1}, num_outputs=3)
    inputs = [q, k, v] if key_mask is None else [q, k, v, key_mask]
    y = b.op("Attention", inputs, {"q_num_heads": cfg.num_heads, "kv_num_heads": cfg.num_heads, "is_causal": 0,
                                   "scale": float(cfg.head_dim ** -0.5)})
    return linear(b, y, b.weight(f"{attn}.out_proj.weight"), b.weight(f"{attn}.out_proj.bias"))


def _mlp(b: GraphBuilder, h: ir.Value, cfg: VisionConfig, prefix: str) -> ir.Value:
    up = linear(b, h, b.weight(f"{prefix}.mlp.fc1.weight"), b.weight(f"{prefix}.mlp.fc1.bias"))
    return linear(b, activation(b, up, cfg.hidden_act), b.weight(f"{prefix}.mlp.fc2.weight"),
                  b.weight(f"{prefix}.mlp.fc2.bias"))


def vision_tower(b: GraphBuilder, pixels: ir.Value, cfg: VisionConfig, tower: str,
                 position_ids: np.ndarray | ir.Value | None = None, key_mask: ir.Value | None = None) -> list[ir.Value]:
    """The tower's hidden states the projector reads: transformers' ``hidden_states[i]`` for each of
    ``cfg.feature_layers`` (no final norm), or ``[last_hidden_state]`` (post_layernorm applied) when
    it reads the last. Layers past the deepest one read are not built. ``key_mask``: the patches each
    image's attention reads (idefics3's patch attention mask; None: all of them)."""
    eps = cfg.layer_norm_eps
    x = patch_embeddings(b, pixels, cfg, tower, position_ids)
    if cfg.tower == CLIP:
        x = layer_norm(b, x, f"{tower}pre_layrnorm", eps)  # (sic: transformers' name)
    states = [x]  # hidden_states[0]: what the first layer reads
    layer = lambda i: f"{tower}encoder.layers.{i}"  # noqa: E731
    h = layer_norm(b, x, f"{layer(0)}.layer_norm1", eps) if cfg.num_layers else None
    for i in range(cfg.num_layers):
        h, x = skip_layer_norm(b, x, _attention(b, h, cfg, layer(i), key_mask), f"{layer(i)}.layer_norm2", eps)
        update = _mlp(b, h, cfg, layer(i))
        last = i + 1 == cfg.num_layers
        if last and cfg.feature_layers is None:  # last_hidden_state: the post-layernorm of the residual stream
            h, x = skip_layer_norm(b, x, update, f"{tower}post_layernorm", eps)
            return [h]
        if last or (cfg.feature_layers and i + 1 in cfg.feature_layers):
            x = b.op("Add", [x, update])  # a hidden state read before the next layer's norm
            h = None if last else layer_norm(b, x, f"{layer(i + 1)}.layer_norm1", eps)
        else:
            h, x = skip_layer_norm(b, x, update, f"{layer(i + 1)}.layer_norm1", eps)
        states.append(x)
    if cfg.feature_layers is None:  # a tower of no layers: the embeddings, post-normed
        return [layer_norm(b, x, f"{tower}post_layernorm", eps)]
    return [states[i] for i in cfg.feature_layers]
