"""Qwen3.5-MoE: Qwen3.5's layers with Qwen3-Next's experts (a shared expert beside them) on every layer,
the top-k weights always renormalized. ``qwen3_5_moe_text`` the language model's own checkpoint,
``qwen3_5_moe`` the image-text one (its language model, the decoder of its image-text export)."""

from exporter.graph.architectures.base import Architecture
from exporter.graph.architectures.qwen3_5 import LanguageModelOf

TEXT = Architecture(model_type="qwen3_5_moe_text", qk_norm=True, norm_offset=1.0, shared_expert=True)
ARCHITECTURE = LanguageModelOf(model_type="qwen3_5_moe", qk_norm=True, norm_offset=1.0, shared_expert=True)
