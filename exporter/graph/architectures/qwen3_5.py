"""Qwen3.5: Qwen3-Next's layers with its DeltaNet projections stored apart (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) and a dense MLP; its rotary is M-RoPE, which on text (all three position rows
equal) is the plain partial rotary. ``qwen3_5_text`` is the language model's own checkpoint
(Qwen3_5ForCausalLM); ``qwen3_5`` the image-text checkpoint (Qwen3_5ForConditionalGeneration), whose
language model lives under model.language_model and is the decoder of its image-text export
(graph/language_model.py; the decoder then takes inputs_embeds and M-RoPE positions)."""

import dataclasses

from exporter.graph.architectures.base import Architecture


@dataclasses.dataclass(frozen=True)
class LanguageModelOf(Architecture):
    """The language model of an image-text checkpoint: its weights under model.language_model."""

    @staticmethod
    def layer_prefix(i: int) -> str:
        return f"model.language_model.layers.{i}"

    embed_tokens = "model.language_model.embed_tokens.weight"
    final_norm = "model.language_model.norm.weight"


TEXT = Architecture(model_type="qwen3_5_text", qk_norm=True, norm_offset=1.0)
ARCHITECTURE = LanguageModelOf(model_type="qwen3_5", qk_norm=True, norm_offset=1.0)
