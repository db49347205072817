"""DeepSeek-V3 / R1 and Kimi-K2 (deepseek_v3): multi-head latent attention (components/latent_attention.py) and,
from ``first_k_dense_replace`` on, routed experts with sigmoid scores picked per group (glm4_moe's), an ungated
shared expert of ``n_shared_experts`` x ``moe_intermediate_size``."""

from exporter.graph.architectures.glm4_moe import GroupedExperts

ARCHITECTURE = GroupedExperts(model_type="deepseek_v3", router_bias="gate.e_score_correction_bias")
