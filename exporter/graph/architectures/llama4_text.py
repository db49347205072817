"""Llama 4 (text: Scout, Maverick; llama4_text, or the language model of Llama4ForConditionalGeneration):
chunked local attention (attention_chunk_size) on the rotary layers and global NoPE layers every
no_rope_layer_interval-th, whose queries are temperature-tuned by position; the rotary pairs adjacent dims
(its complex form); weightless q / k RMS norms after the rotary on the rotary layers; on moe_layers one expert a
token from 16 or 128 whose input (not output) is scaled by sigmoid of its router logit, beside an always-on shared
MLP. The MLP is ``feed_forward``; the experts are stored stacked [experts, hidden, 2I] (gate columns then up)
and [experts, I, hidden], read transposed."""

import dataclasses

from exporter.graph.architectures.base import StackedTransposedExperts
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class Llama4Text(StackedTransposedExperts):
    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        return [WeightPart(f"{self.layer_prefix(i)}.feed_forward.{p}_proj.{suffix}") for p in ("gate", "up")]

    def names(self, i: int) -> dict[str, str]:
        return {**super().names(i), "down": f"{self.layer_prefix(i)}.feed_forward.down_proj"}

    def shared_expert_names(self, i: int) -> dict[str, str]:
        return {p: self.moe_name(i, f"shared_expert.{p}_proj.weight") for p in ("gate", "up", "down")}


ARCHITECTURE = Llama4Text(model_type="llama4_text", moe_block="feed_forward", router="router.weight",
                          stacked_experts=("experts.gate_up_proj", "experts.down_proj"), experts_transposed=True)
