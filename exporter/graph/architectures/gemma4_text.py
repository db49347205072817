"""Gemma 4 (text: Gemma4ForCausalLM): Gemma 3's sandwich layer with plain-weight RMSNorms, q / k norms and a
weightless norm on the values, no softmax scale; global layers with their own head size (and with
attention_k_eq_v their values the keys, fewer KV heads) and a proportional rope; the last num_kv_shared_layers
attending over an earlier layer's keys and values; per-layer inputs (PLE) gated into each layer's output, which
its layer_scalar multiplies (config.py _gemma4_fields). With enable_moe_block (Gemma 4 26B-A4B) every layer also
runs experts beside its dense MLP, router and experts right under the layer (components/moe.py experts_beside_mlp)."""

import dataclasses

from exporter.graph.architectures.base import SANDWICH, Architecture
from exporter.graph.architectures.qwen3_5 import LanguageModelOf

# The experts (enable_moe_block): router.proj [experts, hidden], experts.gate_up_proj [experts, 2I, hidden] ([gate |
# up] rows), experts.down_proj [experts, hidden, I]; router.scale [hidden], router.per_expert_scale [experts].
EXPERTS = dict(moe_block="", router="router.proj.weight", stacked_experts=("experts.gate_up_proj", "experts.down_proj"),
               router_scales=("router.scale", "router.per_expert_scale"))
ARCHITECTURE = Architecture(model_type="gemma4_text", norm_layout=SANDWICH, qk_norm=True, **EXPERTS)


@dataclasses.dataclass(frozen=True)
class Gemma4LanguageModel(LanguageModelOf):
    """The image-text checkpoint (Gemma4ForConditionalGeneration, as Gemma 4 is published): its text decoder under
    model.language_model, per-layer inputs included, exported alone (the vision and audio towers are not read)."""

    per_layer_embed = "model.language_model.embed_tokens_per_layer.weight"
    per_layer_model_projection = "model.language_model.per_layer_model_projection.weight"
    per_layer_projection_norm = "model.language_model.per_layer_projection_norm.weight"


IMAGE_TEXT = Gemma4LanguageModel(model_type="gemma4", norm_layout=SANDWICH, qk_norm=True, **EXPERTS)
