"""Nemotron-H (nemotron_h: Nemotron-H, Nemotron Nano 2, Nemotron 3): blocks of one mixer each after one
RMSNorm (``backbone.layers.i.norm``, the mixer under ``.mixer``), config.json's layers_block_type (or
hybrid_override_pattern) naming it per block: Mamba2 (linear_attention, "M"), attention without positions
(full_attention, "*"), an ungated relu^2 MLP (mlp, "-": up_proj, down_proj) or experts (moe, "E": ungated
relu^2 experts with sigmoid scores picked per group with e_score_correction_bias, a relu^2 shared expert,
optionally run at a latent width between fc1_latent_proj and fc2_latent_proj). The checkpoints keep the
backbone.* names (transformers 5 renames them to model.* only in memory)."""

import dataclasses

from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import WeightPart


@dataclasses.dataclass(frozen=True)
class NemotronH(Architecture):
    @staticmethod
    def layer_prefix(i: int) -> str:
        return f"backbone.layers.{i}"

    def qkv_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        return [WeightPart(f"{self.layer_prefix(i)}.mixer.{p}_proj.{suffix}") for p in ("q", "k", "v")]

    def gate_up_parts(self, i: int, suffix: str = "weight") -> list[WeightPart]:
        return [WeightPart(f"{self.layer_prefix(i)}.mixer.up_proj.{suffix}")]  # ungated: up alone

    def names(self, i: int) -> dict[str, str]:
        p = self.layer_prefix(i)
        return {"input_norm": f"{p}.norm.weight", "o": f"{p}.mixer.o_proj", "down": f"{p}.mixer.down_proj"}

    def shared_expert_names(self, i: int) -> dict[str, str]:
        return {"up": self.moe_name(i, "shared_experts.up_proj.weight"),
                "down": self.moe_name(i, "shared_experts.down_proj.weight")}

    embed_tokens = "backbone.embeddings.weight"
    final_norm = "backbone.norm_f.weight"


# Experts as the expert op's fused SwiGLU with gate = up (each expert's up rows read twice, interleaved):
# components/moe.py turns that SwiGLU into relu^2 (onnxruntime's CPU expert kernels have no relu^2).
ARCHITECTURE = NemotronH(
    model_type="nemotron_h", recurrent_block="mixer", moe_block="mixer", router_bias="gate.e_score_correction_bias",
    expert_tensors=("experts.{e}.up_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
)
