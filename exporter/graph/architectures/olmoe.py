"""OLMoE: llama's pre-norm layer, q/k norms over the whole projection (as olmo2) and optional
clip_qkv, routed experts (norm_topk_prob, default off)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="olmoe", qk_norm=True, qk_norm_per_head=False)
