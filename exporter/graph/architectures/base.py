"""What an architecture file declares: its weight names and its few differences from llama."""

from __future__ import annotations

import dataclasses

from exporter.packaging.checkpoint import WeightPart

PRE_NORM = "pre"  # llama: x + attn(norm(x)), x + mlp(norm(x))
SANDWICH = "sandwich"  # gemma2/3: x + norm(attn(norm(x))), x + norm(mlp(norm(x)))
POST_NORM = "post"  # olmo2: x + norm(attn(x)), x + norm(mlp(x))


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Weight naming and feature flags; the decoder and attention components do the rest.

    ``qkv_parts`` / ``gate_up_parts`` return the checkpoint tensors (or row slices of a fused one)
    whose row-concatenation is the packed projection weight.
    """

    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_per_head: bool = True  # False: q_norm / k_norm over the whole projection (olmo2)
    fused_qkv: bool = False  # one qkv_proj tensor in the checkpoint (phi3)
    fused_gate_up: bool = False  # one gate_up_proj tensor in the checkpoint (phi3)
    norm_layout: str = PRE_NORM
    norm_offset: float = 0.0  # gemma's RMSNorm scales by (1 + weight): folded into the weight

    @staticmethod
    def layer_prefix(i: int) -> str:
        return f"model.layers.{i}"

    def qkv_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        attn = f"{self.layer_prefix(i)}.self_attn"
        if self.fused_qkv:
            return [WeightPart(f"{attn}.qkv_proj.{suffix}")]
        return [WeightPart(f"{attn}.{p}_proj.{suffix}") for p in ("q", "k", "v")]

    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        mlp = f"{self.layer_prefix(i)}.mlp"
        if self.fused_gate_up:
            return [WeightPart(f"{mlp}.gate_up_proj.{suffix}")]
        return [WeightPart(f"{mlp}.{p}_proj.{suffix}") for p in ("gate", "up")]

    def names(self, i: int) -> dict[str, str]:
        p = self.layer_prefix(i)
        return {
            "input_norm": f"{p}.input_layernorm.weight",
            "post_attention_norm": f"{p}.post_attention_layernorm.weight",
            "pre_feedforward_norm": f"{p}.pre_feedforward_layernorm.weight",
            "post_feedforward_norm": f"{p}.post_feedforward_layernorm.weight",
            "o": f"{p}.self_attn.o_proj",
            "down": f"{p}.mlp.down_proj",
            "q_norm": f"{p}.self_attn.q_norm.weight",
            "k_norm": f"{p}.self_attn.k_norm.weight",
        }

    def norm_part(self, name: str) -> WeightPart:
        return WeightPart(name, add=self.norm_offset)

    embed_tokens = "model.embed_tokens.weight"
    final_norm = "model.norm.weight"
    lm_head = "lm_head.weight"
