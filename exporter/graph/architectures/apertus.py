"""Apertus (Swiss AI): llama's layer with per-head q / k norms, its norms named attention_layernorm /
feedforward_layernorm, and an ungated MLP with the xIELU activation, whose four scalars the checkpoint holds
(mlp.act_fn.alpha_p / alpha_n / beta / eps)."""

import dataclasses

from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class Apertus(Architecture):
    def names(self, i: int) -> dict[str, str]:
        p = self.layer_prefix(i)
        return {**super().names(i), "input_norm": f"{p}.attention_layernorm.weight",
                "post_attention_norm": f"{p}.feedforward_layernorm.weight"}

    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        return [WeightPart(f"{self.layer_prefix(i)}.mlp.up_proj.{suffix}")]  # ungated: up alone


ARCHITECTURE = Apertus(model_type="apertus", qk_norm=True, ungated_mlp=True)
