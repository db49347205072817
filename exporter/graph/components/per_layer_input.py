"""gemma4's per-layer inputs (PLE): a second embedding of the tokens holding a slice for every layer, mixed with a
projection of the embedded tokens; after its MLP each layer gates its slice into the residual stream."""

from __future__ import annotations

import onnx_ir as ir

from exporter.graph.architectures.base import Architecture
from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.mlp import gate_activation
from exporter.graph.components.norm import rms_norm
from exporter.graph.config import ModelConfig


def per_layer_inputs(b: GraphBuilder, arch: Architecture, cfg: ModelConfig, input_ids: ir.Value,
                     embedded: ir.Value) -> ir.Value:
    """[batch, seq, layers, width]: (norm(embedded projected, / sqrt(hidden)) + the tokens' per-layer embedding *
    sqrt(width)) / sqrt(2), the norm over each layer's slice (transformers' project_per_layer_inputs)."""
    width = cfg.per_layer_input.width
    by_layer = b.ints(0, 0, cfg.num_layers, width)
    tokens = b.op("Mul", [b.op("Gather", [b.weight(arch.per_layer_embed), input_ids], {"axis": 0}),
                          b.scalar(width ** 0.5)])
    projected = b.op("Mul", [linear(b, embedded, b.weight(arch.per_layer_model_projection)),
                             b.scalar(cfg.hidden_size ** -0.5)])
    norm = arch.per_layer_projection_norm
    projected = rms_norm(b, b.op("Reshape", [projected, by_layer]), b.weight(norm, arch.norm_part(norm)), cfg.rms_norm_eps)
    return b.op("Mul", [b.op("Add", [projected, b.op("Reshape", [tokens, by_layer])]), b.scalar(2 ** -0.5)])


def per_layer_update(b: GraphBuilder, arch: Architecture, cfg: ModelConfig, i: int, x: ir.Value,
                     inputs: ir.Value) -> ir.Value:
    """Layer ``i``'s per-layer branch on its output ``x``: norm(projection(act(gate(x)) * its slice of ``inputs``)),
    added to ``x`` by the caller."""
    names = arch.names(i)
    gated = gate_activation(b, linear(b, x, b.weight(names["per_layer_gate"])), cfg.hidden_act)
    mixed = b.op("Mul", [gated, b.op("Gather", [inputs, b.scalar_i64(i)], {"axis": 2})])
    norm = names["post_per_layer_norm"]
    return rms_norm(b, linear(b, mixed, b.weight(names["per_layer_projection"])), b.weight(norm, arch.norm_part(norm)),
                    cfg.rms_norm_eps)
