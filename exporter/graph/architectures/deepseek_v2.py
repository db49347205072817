"""DeepSeek-V2 / V2-Lite / V2.5 (deepseek_v2): deepseek_v3's multi-head latent attention (its rotary always pairs
adjacent dims, in place) and, from ``first_k_dense_replace`` on, experts routed by softmax scores (greedy or within
the best groups), unnormalized and scaled by ``routed_scaling_factor``, beside an ungated shared expert."""

from exporter.graph.architectures.glm4_moe import GroupedExperts

ARCHITECTURE = GroupedExperts(model_type="deepseek_v2")
