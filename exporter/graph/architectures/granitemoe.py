"""Granite-MoE: granite's multipliers with experts stored as two 3-D tensors (input_linear rows
[gate | up], output_linear), routed by a softmax over the top-k logits (renormalized routing)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(
    model_type="granitemoe", moe_block="block_sparse_moe", router="router.layer.weight",
    stacked_experts=("input_linear.weight", "output_linear.weight"),
)
