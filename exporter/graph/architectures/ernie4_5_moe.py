"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ernie4_5's attention (interleaved rotary) with, on the layers
moe_layer_start_index..end every moe_layer_interval, experts picked from the softmax scores by score +
``moe_statics.e_score_correction_bias`` and renormalized, beside an ungated shared expert."""

from exporter.graph.architectures.glm4_moe import GroupedExperts

ARCHITECTURE = GroupedExperts(model_type="ernie4_5_moe", router_bias="moe_statics.e_score_correction_bias")
