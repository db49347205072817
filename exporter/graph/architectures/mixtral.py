"""Mixtral: mistral's layer with a sparse mixture of SwiGLU experts (block_sparse_moe: w1 gate,
w3 up, w2 down per expert), softmax routing renormalized over the top k."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(
    model_type="mixtral", moe_block="block_sparse_moe",
    expert_tensors=("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
)
