"""gpt-oss: attention with biases and a learned sink per head (GroupQueryAttention's head_sink: the
only attention op that takes one), sliding-window layers alternating with full ones, and experts
stored as [experts, in, out] with biases, gate and up columns already interleaved, a biased router
softmaxed over its top k, and a clamped SwiGLU (alpha 1.702, limit 7, up + 1)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(
    model_type="gpt_oss", router="router.weight", router_bias="router.bias",
    stacked_experts=("experts.gate_up_proj", "experts.down_proj"), experts_transposed=True,
    expert_biases=("experts.gate_up_proj_bias", "experts.down_proj_bias"), attention_sinks="sinks",
)
