"""Hunyuan dense (hunyuan_v1_dense): llama's layer with per-head q / k norms (query_layernorm, key_layernorm)
applied to the rotated heads (ModelConfig.qk_norm_after_rotary), and its NTK-alpha rope (config.json's
"dynamic" with a fixed alpha: a stretched base, static)."""

import dataclasses

from exporter.graph.architectures.base import Architecture


@dataclasses.dataclass(frozen=True)
class Hunyuan(Architecture):
    def names(self, i: int) -> dict[str, str]:
        attn = f"{self.layer_prefix(i)}.self_attn"
        return {**super().names(i), "q_norm": f"{attn}.query_layernorm.weight", "k_norm": f"{attn}.key_layernorm.weight"}


ARCHITECTURE = Hunyuan(model_type="hunyuan_v1_dense", qk_norm=True)
