"""Qwen3-VL-MoE's language model (qwen3_vl_moe_text, under an image-text checkpoint's model.language_model): qwen3_moe's
layers (per-head q / k norms, softmax top-k routing) with the experts stored stacked, in one of two layouts that
transformers reads alike (its qwen3_vl_moe conversion: Transpose(1, 2, check_dims=True), transposing only a tensor whose
shape is not the module's): as transformers holds them and transformers 5's save_pretrained writes them, [experts, 2I,
hidden] (gate rows then up) and [experts, hidden, I] (TEXT); or as Qwen's hub checkpoints hold them, [experts, hidden,
2I] and [experts, I, hidden], read transposed (HUB). Not a text family of its own (there is no Qwen3-VL-MoE causal-LM
checkpoint): its config is read as qwen3_moe's (exporter/graph/language_model.py, TEXT_ARCHITECTURE_OF)."""

from exporter.graph.architectures.base import Architecture, StackedTransposedExperts

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
TEXT = Architecture(model_type="qwen3_moe", qk_norm=True, stacked_experts=EXPERTS)
HUB = StackedTransposedExperts(model_type="qwen3_moe", qk_norm=True, stacked_experts=EXPERTS, experts_transposed=True)


def stored_layout(gate_up_shape: tuple[int, ...], expert_width: int) -> Architecture:
    """TEXT or HUB by the stored gate_up_proj's shape, as transformers decides: the module's own shape [experts, 2I,
    hidden] (a square one included) is read as it is, any other transposed."""
    return TEXT if len(gate_up_shape) == 3 and gate_up_shape[1] == 2 * expert_width else HUB
