"""Granite 4.0-H (granitemoehybrid): Mamba2 layers (config.json "mamba", linear_attention to transformers
5) between attention layers without positions (NoPE unless position_embedding_type is "rope"), granite's
multipliers, granitemoe's experts (input_linear rows [gate | up], output_linear, a softmax over the top-k
logits) plus a shared MLP on every layer (shared_mlp: input_linear [gate | up], output_linear), which is the
whole MLP where the config has no experts."""

import dataclasses

from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class GraniteMoeHybrid(Architecture):
    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        return [WeightPart(f"{self.layer_prefix(i)}.shared_mlp.input_linear.{suffix}")]

    def names(self, i: int) -> dict[str, str]:
        return {**super().names(i), "down": f"{self.layer_prefix(i)}.shared_mlp.output_linear"}


ARCHITECTURE = GraniteMoeHybrid(
    model_type="granitemoehybrid", moe_block="block_sparse_moe", router="router.layer.weight",
    stacked_experts=("input_linear.weight", "output_linear.weight"), recurrent_block="mamba", shared_mlp=True,
)
