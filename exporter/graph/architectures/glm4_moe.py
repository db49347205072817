"""GLM-4.5 / GLM-4.6 / GLM-4.7 (glm4_moe): llama's layer with biased q / k / v, optional per-head q / k norms
(``use_qk_norm``), rotary on the first part of each head (partial_rotary_factor, 0.5 by default), and from
``first_k_dense_replace`` on DeepSeek-V3's experts: sigmoid scores picked per group with
``e_score_correction_bias``, renormalized and scaled by ``routed_scaling_factor``, an ungated shared expert."""

import dataclasses

from exporter.graph.architectures.base import Architecture


@dataclasses.dataclass(frozen=True)
class GroupedExperts(Architecture):
    """DeepSeek-V3's expert block names (glm4_moe and deepseek_v3 share them)."""

    def shared_expert_names(self, i: int) -> dict[str, str]:
        return {p: self.moe_name(i, f"shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")}


ARCHITECTURE = GroupedExperts(model_type="glm4_moe", qk_norm_key="use_qk_norm", router_bias="gate.e_score_correction_bias")
