"""Command R7B / Command A (cohere2): one LayerNorm without bias before attention and MLP side by side
(x + attn(h) + mlp(h)), the rotary pairing adjacent dims on the sliding-window layers only (the global ones
NoPE), logits scaled by logit_scale; tied embeddings."""

from exporter.graph.architectures.base import PARALLEL_BLOCK, Architecture

ARCHITECTURE = Architecture(model_type="cohere2", norm_layout=PARALLEL_BLOCK, layer_norm=True, layer_norm_bias=False)
