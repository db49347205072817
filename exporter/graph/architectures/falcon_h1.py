"""Falcon-H1 (falcon_h1): every layer runs attention (rotary, keys scaled by key_multiplier) and Mamba2
(``mamba``; its output norm optional, normed before the gate by default) side by side on the same normed
input and adds them, then the gated MLP (``feed_forward``) after ``pre_ff_layernorm``; the muP multipliers
of its config (ModelConfig.multipliers) scale the activations where transformers scales them. Each layer
carries a KV cache and the Mamba2 states; the final norm is ``model.final_layernorm``."""

import dataclasses

from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class FalconH1(Architecture):
    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        ff = f"{self.layer_prefix(i)}.feed_forward"
        return [WeightPart(f"{ff}.gate_proj.{suffix}"), WeightPart(f"{ff}.up_proj.{suffix}")]

    def names(self, i: int) -> dict[str, str]:
        p = self.layer_prefix(i)
        return {**super().names(i), "post_attention_norm": f"{p}.pre_ff_layernorm.weight",
                "down": f"{p}.feed_forward.down_proj"}

    final_norm = "model.final_layernorm.weight"


ARCHITECTURE = FalconH1(model_type="falcon_h1", recurrent_block="mamba")
