"""Phi-3.5-MoE (phimoe): LayerNorms with biases, biased attention and LM head, longrope, and 16
experts (w1 gate, w3 up, w2 down) routed by the sparsemixer: two experts chosen one after the other,
each weighted by its own thresholded softmax (components/moe.py builds it in the graph)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(
    model_type="phimoe", layer_norm=True, sparse_mixer=True, moe_block="block_sparse_moe",
    expert_tensors=("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
)
