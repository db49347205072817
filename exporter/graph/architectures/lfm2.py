"""LFM2 and LFM2-MoE (Liquid): gated short-convolution layers (conv) between attention layers with per-head q / k
norms; its own names for the norms (operator_norm, ffn_norm, q_layernorm, k_layernorm), the attention
output (out_proj) and the MLP (w1 gate, w3 up, w2 down); the final norm is model.embedding_norm,
applied after the last layer; plain RMSNorm weights."""

import dataclasses

from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class Lfm2(Architecture):
    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        ff = f"{self.layer_prefix(i)}.feed_forward"
        return [WeightPart(f"{ff}.w1.{suffix}"), WeightPart(f"{ff}.w3.{suffix}")]

    def names(self, i: int) -> dict[str, str]:
        p = self.layer_prefix(i)
        return {
            "input_norm": f"{p}.operator_norm.weight",
            "post_attention_norm": f"{p}.ffn_norm.weight",
            "o": f"{p}.self_attn.out_proj",
            "down": f"{p}.feed_forward.w2",
            "q_norm": f"{p}.self_attn.q_layernorm.weight",
            "k_norm": f"{p}.self_attn.k_layernorm.weight",
        }

    final_norm = "model.embedding_norm.weight"


ARCHITECTURE = Lfm2(model_type="lfm2", qk_norm=True, recurrent_block="conv")
# LFM2-MoE: dense layers first (num_dense_layers), then experts (w1 gate, w3 up, w2 down) routed by sigmoid
# scores picked with a learned expert_bias (components/moe.py sigmoid_router).
MOE = Lfm2(model_type="lfm2_moe", qk_norm=True, recurrent_block="conv", moe_block="feed_forward",
           expert_tensors=("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
           router_bias="expert_bias")
