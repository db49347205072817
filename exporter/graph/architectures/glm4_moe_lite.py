"""GLM-4.7-Flash (glm4_moe_lite): deepseek_v3's multi-head latent attention and grouped sigmoid routing, the dense
and sparse layers named in ``mlp_layer_types``."""

from exporter.graph.architectures.glm4_moe import GroupedExperts

ARCHITECTURE = GroupedExperts(model_type="glm4_moe_lite", router_bias="gate.e_score_correction_bias")
