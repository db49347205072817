"""What an architecture file declares: its weight names and its few differences from llama."""

from __future__ import annotations

import dataclasses

from exporter.packaging.checkpoint import WeightPart

PRE_NORM = "pre"  # llama: x + attn(norm(x)), x + mlp(norm(x))
SANDWICH = "sandwich"  # gemma2/3: x + norm(attn(norm(x))), x + norm(mlp(norm(x)))
POST_NORM = "post"  # olmo2: x + norm(attn(x)), x + norm(mlp(x))
PARALLEL_BLOCK = "parallel"  # cohere2: x + attn(norm(x)) + mlp(norm(x)), one norm


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
    qk_norm_key: str | None = None  # config.json's switch for the q / k norms where the family makes them optional
    fused_qkv: bool = False  # one qkv_proj tensor in the checkpoint (phi3)
    fused_gate_up: bool = False  # one gate_up_proj tensor in the checkpoint (phi3)
    norm_layout: str = PRE_NORM
    norm_offset: float = 0.0  # gemma's RMSNorm scales by (1 + weight): folded into the weight
    # Mixture of experts (config.json says how many and how they route: ModelConfig.moe).
    moe_block: str = "mlp"  # the layer's submodule holding router and experts ("": the layer itself, gemma4)
    router: str = "gate.weight"  # [experts, hidden], under moe_block
    # Per-expert tensors (gate, up, down), ``{e}`` the expert index, under moe_block; or
    expert_tensors: tuple[str, str, str] = ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                                            "experts.{e}.down_proj.weight")
    # 3-D tensors holding every expert: [experts, 2I, hidden] with rows [gate | up], [experts, hidden, I].
    stacked_experts: tuple[str, str] | None = None
    shared_expert: bool = False  # qwen2_moe: a dense MLP beside the experts, scaled by sigmoid(x . gate)
    # gpt-oss: 3-D experts stored [experts, in, out] (read transposed; gate/up columns already
    # interleaved), biases on router and experts, and a learned softmax sink per attention head.
    experts_transposed: bool = False
    expert_biases: tuple[str, str] | None = None  # [experts, 2I] (interleaved like the rows), [experts, hidden]
    router_bias: str | None = None
    # gemma4: the router's input scale [hidden] and its per-expert scale [experts], under moe_block.
    router_scales: tuple[str, str] | None = None
    attention_sinks: str | None = None  # under self_attn: [num_heads]
    layer_norm: bool = False  # LayerNorm with a bias (phimoe) where llama has RMSNorm
    layer_norm_bias: bool = True  # False: the LayerNorm has a weight only (cohere2)
    # An ungated MLP (up_proj, down_proj) with the activation config.json names (apertus: xielu).
    ungated_mlp: bool = False
    sparse_mixer: bool = False  # phimoe's routing: two experts picked one after the other, thresholds, two softmaxes
    # Hybrids (config.recurrent): the recurrent layers' submodule, and for gated DeltaNet how its input
    # projections are stored: "split" (qwen3_5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, rows
    # flat per head) or "interleaved" (qwen3_next: in_proj_qkvz and in_proj_ba, rows grouped per key head).
    recurrent_block: str = "linear_attn"
    deltanet_layout: str = "split"
    shared_mlp: bool = False  # granitemoehybrid: the dense MLP (gate_up_parts / names()["down"]) beside the experts

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
            # gemma4's per-layer input branch (PLE) and the scalar its layers' outputs are multiplied by.
            "per_layer_gate": f"{p}.per_layer_input_gate.weight",
            "per_layer_projection": f"{p}.per_layer_projection.weight",
            "post_per_layer_norm": f"{p}.post_per_layer_input_norm.weight",
            "layer_scalar": f"{p}.layer_scalar",
            # gemma4's experts beside the dense MLP (enable_moe_block): the dense branch's output norm, the experts'
            # input and output norms.
            "post_feedforward_norm_1": f"{p}.post_feedforward_layernorm_1.weight",
            "pre_feedforward_norm_2": f"{p}.pre_feedforward_layernorm_2.weight",
            "post_feedforward_norm_2": f"{p}.post_feedforward_layernorm_2.weight",
        }

    def recurrent_name(self, i: int, tensor: str) -> str:
        """``tensor`` under layer ``i``'s recurrent block (linear_attn, conv)."""
        return f"{self.layer_prefix(i)}.{self.recurrent_block}.{tensor}"

    def deltanet_in_parts(self, i: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int
                          ) -> tuple[list[WeightPart], list[WeightPart]]:
        """Rows of gated DeltaNet's input projections as two packed weights: [q | k | v | z] (q, k and v
        in the convolution's channel order: q heads, k heads, v heads; then z by value head) and
        [b | a], the beta and decay gates by value head (value head j reads key head j // (value_heads
        / key_heads))."""
        name = lambda t: self.recurrent_name(i, f"{t}.weight")  # noqa: E731
        if self.deltanet_layout == "split":
            return ([WeightPart(name(t)) for t in ("in_proj_qkv", "in_proj_z")],
                    [WeightPart(name(t)) for t in ("in_proj_b", "in_proj_a")])
        r = value_heads // key_heads
        block, qkvz, ba = 2 * key_dim + 2 * r * value_dim, name("in_proj_qkvz"), name("in_proj_ba")

        def rows(tensor, start, length, step):
            return [WeightPart(tensor, rows=(h * step + start, h * step + start + length)) for h in range(key_heads)]

        return (rows(qkvz, 0, key_dim, block) + rows(qkvz, key_dim, key_dim, block)
                + rows(qkvz, 2 * key_dim, r * value_dim, block) + rows(qkvz, 2 * key_dim + r * value_dim, r * value_dim, block),
                rows(ba, 0, r, 2 * r) + rows(ba, r, r, 2 * r))

    def moe_name(self, i: int, tensor: str) -> str:
        """``tensor`` under layer ``i``'s mixture-of-experts block."""
        block = f".{self.moe_block}" if self.moe_block else ""
        return f"{self.layer_prefix(i)}{block}.{tensor}"

    def router_name(self, i: int) -> str:
        return self.moe_name(i, self.router)

    @property
    def expert_interleave(self) -> int:
        """How fc1's parts combine: 2, gate and up parts interleaved row by row into ORT's fused SwiGLU
        rows; 1, one part per expert already in that order (gpt-oss)."""
        return 1 if self.experts_transposed else 2

    def expert_parts(self, i: int, experts: int, width: int, has=lambda name: False
                     ) -> tuple[list[WeightPart], list[WeightPart]]:
        """The parts of fc1 (gate and up of each expert, in turn, or each expert's already interleaved
        rows: ``expert_interleave``) and of fc2 (each expert's down projection), expert by expert.
        ``has(name)`` says whether the checkpoint holds a tensor (gpt-oss ships its experts as MXFP4
        ``_blocks`` / ``_scales``, [experts, out, in] unlike its bf16 form)."""
        if self.stacked_experts and self.experts_transposed and has(self.moe_name(i, f"{self.stacked_experts[0]}_blocks")):
            gate_up, down = (self.moe_name(i, t) for t in self.stacked_experts)
            return ([WeightPart(f"{gate_up}_blocks", expert=e, mxfp4_scales=f"{gate_up}_scales") for e in range(experts)],
                    [WeightPart(f"{down}_blocks", expert=e, mxfp4_scales=f"{down}_scales") for e in range(experts)])
        if self.stacked_experts and self.experts_transposed:  # one part per expert, already interleaved
            gate_up, down = (self.moe_name(i, t) for t in self.stacked_experts)
            return ([WeightPart(gate_up, expert=e, transposed=True) for e in range(experts)],
                    [WeightPart(down, expert=e, transposed=True) for e in range(experts)])
        if self.stacked_experts:
            gate_up, down = (self.moe_name(i, t) for t in self.stacked_experts)
            fc1 = [WeightPart(gate_up, rows=rows, expert=e) for e in range(experts) for rows in ((0, width), (width, 2 * width))]
            return fc1, [WeightPart(down, expert=e) for e in range(experts)]
        gate, up, down = (self.moe_name(i, t) for t in self.expert_tensors)
        fc1 = [WeightPart(t.format(e=e)) for e in range(experts) for t in (gate, up)]
        return fc1, [WeightPart(down.format(e=e)) for e in range(experts)]

    def shared_expert_names(self, i: int) -> dict[str, str]:
        return {"gate": self.moe_name(i, "shared_expert.gate_proj.weight"),
                "up": self.moe_name(i, "shared_expert.up_proj.weight"),
                "down": self.moe_name(i, "shared_expert.down_proj.weight"),
                "gate_scale": self.moe_name(i, "shared_expert_gate.weight")}

    def norm_part(self, name: str) -> WeightPart:
        return WeightPart(name, add=self.norm_offset)

    embed_tokens = "model.embed_tokens.weight"
    final_norm = "model.norm.weight"
    lm_head = "lm_head.weight"
    lm_head_bias = "lm_head.bias"  # read where config.json's lm_head_bias says there is one (phimoe)
    # gemma4's per-layer inputs (config.per_layer_input): the packed [vocab, layers * width] embedding, the projection
    # of the embedded tokens to the same width and the norm of each layer's slice of it.
    per_layer_embed = "model.embed_tokens_per_layer.weight"
    per_layer_model_projection = "model.per_layer_model_projection.weight"
    per_layer_projection_norm = "model.per_layer_projection_norm.weight"


@dataclasses.dataclass(frozen=True)
class StackedTransposedExperts(Architecture):
    """Experts stored stacked and transposed, gate and up as two halves: ``stacked_experts`` names [experts, hidden, 2I]
    (gate columns, then up) and [experts, I, hidden] (llama4_text; qwen3_vl_moe's language model), read transposed
    and the halves interleaved row by row into the fused SwiGLU rows of onnxruntime's MoE ops."""

    @property
    def expert_interleave(self) -> int:
        return 2

    def expert_parts(self, i: int, experts: int, width: int, has=lambda name: False
                     ) -> tuple[list[WeightPart], list[WeightPart]]:
        gate_up, down = (self.moe_name(i, t) for t in self.stacked_experts)
        fc1 = [WeightPart(gate_up, rows=rows, expert=e, transposed=True)
               for e in range(experts) for rows in ((0, width), (width, 2 * width))]
        return fc1, [WeightPart(down, expert=e, transposed=True) for e in range(experts)]
