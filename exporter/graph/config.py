"""A checkpoint's config.json, read into the few numbers the graph builder needs."""

from __future__ import annotations

import dataclasses
import types
import json
import threading
from pathlib import Path

from exporter.errors import ExportError
from exporter.packaging.prequantized import read_format

_TRANSFORMERS_IMPORT = threading.Lock()

# rope types whose frequencies are fixed per position (so a cos/sin table can be baked in).
# proportional: gemma4's global layers (the first partial_rotary_factor of a whole head's angles turn, the rest stay 0).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu2", "xielu")  # relu2: nemotron_h's relu(x)^2; xielu: apertus


FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types
# llama4_text: attention within fixed chunks of attention_chunk_size positions (the chunk holding the query).
CHUNKED = "chunked_attention"
# Layers with a fixed-size recurrent state instead of a KV cache (docs/graph-contracts.md, "Recurrent
# state"): gated DeltaNet (qwen3_next, qwen3_5) and LFM2's gated short convolution.
LINEAR, CONV = "linear_attention", "conv"
# nemotron_h's blocks hold one mixer each: besides attention and Mamba2 (linear_attention), a block that is
# only an MLP or only experts, with neither a KV cache nor a state.
MLP_BLOCK, MOE_BLOCK = "mlp", "moe"
# falcon_h1's layers run attention and Mamba2 side by side on the same normed input: a KV cache and states.
PARALLEL = "hybrid"
# model_type -> the layer types its config.json may name (a type not listed is refused by name).
HYBRID_LAYER_TYPES = {
    "qwen3_next": (FULL, LINEAR), "qwen3_5_text": (FULL, LINEAR), "qwen3_5": (FULL, LINEAR),
    "qwen3_5_moe_text": (FULL, LINEAR), "qwen3_5_moe": (FULL, LINEAR), "lfm2": (FULL, CONV), "lfm2_moe": (FULL, CONV),
    # Granite 4.0-H: its Mamba2 layers are linear_attention to transformers 5 (config.json's "mamba", remapped).
    "granitemoehybrid": (FULL, LINEAR),
    "nemotron_h": (FULL, LINEAR, MLP_BLOCK, MOE_BLOCK),
    "falcon_h1": (PARALLEL,),
}
# Other families whose layer types are not the usual full / sliding ones.
LAYER_TYPES = {**HYBRID_LAYER_TYPES, "llama4_text": (FULL, CHUNKED)}
GATED_DELTANET, SHORT_CONV, MAMBA2 = "gated_deltanet", "short_conv", "mamba2"
MAMBA2_TYPES = ("granitemoehybrid", "nemotron_h", "falcon_h1")
# Mamba2's output norm: gate then norm (granite, nemotron; falcon_h1 with mamba_norm_before_gate false), norm
# then gate (falcon_h1's default), or no norm, only the gate (falcon_h1 without mamba_rms_norm).
GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY = "gate_then_norm", "norm_then_gate", "gate_only"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    rotary_dim: int
    # longrope switches from short to long factors once a sequence outgrows this length.
    original_max_position_embeddings: int | None = None
    # Models with a rope per layer type (gemma3: local and global) name theirs.
    layer_type: str | None = None
    # The standardized rope parameters (rope_theta, factor, short/long factors, ...), frozen.
    params: tuple = ()

    @property
    def parameters(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's attention where a model varies it by layer (gemma4): its head size and KV heads, the layer
    whose keys and values it attends over (itself, or the earlier layer whose cache it shares: it projects
    queries only and carries no cache of its own), and whether its values are its keys (one projection)."""

    head_dim: int
    num_kv_heads: int
    kv_source: int
    value_is_key: bool = False


@dataclasses.dataclass(frozen=True)
class PerLayerInputConfig:
    """gemma4's per-layer inputs (PLE): a second embedding of ``vocab`` rows holding ``width`` values per layer,
    mixed with a projection of the embedded tokens, each layer gating its slice into the residual stream."""

    vocab: int
    width: int


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent layers of a hybrid model: what they compute and the sizes of their states.

    gated DeltaNet (``linear_attention`` layers): a causal depthwise convolution over ``channels`` =
    q, k and v (``conv_kernel`` taps), then the gated delta rule per value head with a
    [key_dim, value_dim] state; ``key_heads`` q / k heads, each shared by value_heads / key_heads
    value heads. LFM2's short convolution (``conv`` layers): ``channels`` = hidden, no recurrence."""

    kind: str  # GATED_DELTANET | SHORT_CONV | MAMBA2 (key_heads: its groups, key_dim: d_state, value_*: heads)
    conv_kernel: int
    channels: int
    key_heads: int = 0
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    conv_bias: bool = False
    norm_eps: float = 1e-6  # the gated output norm's (gated DeltaNet, Mamba2)
    proj_bias: bool = False  # Mamba2: in_proj and out_proj biased
    gated_norm: str = GATE_THEN_NORM  # Mamba2's output norm (GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY)

    @property
    def conv_state(self) -> int:
        """Positions the convolution state keeps: the kernel's taps before the current token."""
        return self.conv_kernel - 1


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's routing and expert sizes, whatever its config.json calls them."""

    num_experts: int
    top_k: int
    expert_intermediate: int  # each expert's MLP width
    normalize: bool  # the top-k routing weights renormalized to sum to 1 (norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    shared_expert_intermediate: int | None = None  # qwen2_moe: a dense MLP beside the experts, gated
    # gpt-oss's clamped SwiGLU: gate * sigmoid(alpha * gate) * (up + 1), gate <= limit, |up| <= limit.
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    sparse_mixer_eps: float | None = None  # phimoe: router_jitter_noise, the sparsemixer's threshold at inference
    # lfm2_moe: sigmoid scores, experts picked by score + a learned bias, the picked scores renormalized and
    # scaled by routed_scaling_factor (None: the softmax routing of every other family).
    sigmoid_routing: bool = False
    routed_scaling: float | None = None
    # nemotron_h: the sigmoid routing limited to the best ``topk_group`` of ``groups`` expert groups (ranked by
    # their two best biased scores), ungated relu^2 experts, and a latent width the experts run at (projected
    # down before them and back after; None: hidden).
    groups: int = 1
    topk_group: int = 1
    relu2_experts: bool = False
    latent: int | None = None
    # ernie4_5_moe: softmax scores, the top k of score + a learned bias picked, the picked scores renormalized.
    biased_softmax: bool = False
    # llama4_text: the picked expert's sigmoid(logit) scales its input, not its output (one expert a token).
    input_scaled: bool = False
    # deepseek_v2: softmax scores, the top k picked (with ``groups`` > 1 within the best ``topk_group`` groups, ranked
    # by their best score: group_limited_greedy), the picked scores unnormalized, scaled by routed_scaling_factor.
    scaled_softmax: bool = False
    # gemma4 (enable_moe_block): experts beside the dense MLP on every layer, each branch through norms of its own,
    # routed from the residual stream (a weightless RMSNorm times a learned scale, softmax, the top k renormalized, each
    # times a learned per-expert scale); GEGLU experts (components/moe.py experts_beside_mlp).
    beside_dense_mlp: bool = False

    @property
    def op_normalize(self) -> bool:
        """The expert op's normalize_routing_weights: the model's, or set where the graph computes the
        routing itself and hands the op log weights (phimoe's sparsemixer)."""
        return self.normalize or self.sparse_mixer_eps is not None or self.group_limited

    @property
    def group_limited(self) -> bool:
        """deepseek_v2's group_limited_greedy: the graph picks the experts and hands the op log weights."""
        return self.scaled_softmax and self.groups > 1


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (deepseek_v3): queries through an optional low-rank latent (``q_rank``), keys
    and values of every head expanded from one shared latent of ``kv_rank`` (kv_b_proj), beside one shared
    rotary key of ``rope_dim``; per head a query / key of ``nope_dim`` + ``rope_dim`` and a value of
    ``value_dim``. ``interleaved``: the rotary pairs adjacent dims (rope_interleave, its checkpoints' layout)."""

    q_rank: int | None
    kv_rank: int
    nope_dim: int
    rope_dim: int
    value_dim: int
    interleaved: bool


# model_type -> config.json key of the expert count (qwen3_moe's own class writes num_local_experts
# through its attribute map, so both are read) and of the expert width.
MOE_TYPES = {
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
    "granitemoe": ("num_local_experts", "intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
    "phimoe": ("num_local_experts", "intermediate_size"),
    "qwen3_next": ("num_experts", "moe_intermediate_size"),
    "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size"),
    "qwen3_5_moe": ("num_experts", "moe_intermediate_size"),
    "granitemoehybrid": ("num_local_experts", "intermediate_size"),
    "lfm2_moe": ("num_experts", "moe_intermediate_size"),
    "nemotron_h": ("n_routed_experts", "moe_intermediate_size"),
    "glm4_moe": ("n_routed_experts", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
    "deepseek_v2": ("n_routed_experts", "moe_intermediate_size"),
    "glm4_moe_lite": ("n_routed_experts", "moe_intermediate_size"),
    "ernie4_5_moe": ("moe_num_experts", "moe_intermediate_size"),
    "llama4_text": ("num_local_experts", "intermediate_size"),
}
# DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores, experts picked within the best topk_group of n_group groups
# by score + e_score_correction_bias, the picked scores renormalized and scaled by routed_scaling_factor; SwiGLU
# experts, an ungated shared expert of n_shared_experts x moe_intermediate_size, the first_k_dense_replace layers dense
# (glm4_moe_lite: mlp_layer_types says which).
GROUPED_SIGMOID_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")
# Families with qwen2_moe's shared expert (a dense MLP beside the experts, scaled by sigmoid(x . gate)).
SHARED_EXPERT_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")


def _sparse_from_first_dense(hf, num_layers: int) -> tuple[bool, ...]:
    """DeepSeek's layout: dense MLPs on the first first_k_dense_replace layers, experts after; glm4_moe_lite names
    each layer in mlp_layer_types ("dense" / "sparse")."""
    kinds = getattr(hf, "mlp_layer_types", None)
    if kinds:
        unknown = sorted(set(kinds) - {"dense", "sparse"})
        if unknown or len(kinds) != num_layers:
            raise ExportError(f"config.json's mlp_layer_types {list(kinds)} must name each of the {num_layers} layers "
                              "\"dense\" or \"sparse\"")
        return tuple(k == "sparse" for k in kinds)
    dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    return tuple(i >= dense for i in range(num_layers))


def _deepseek_v2_moe(hf, experts: int, top_k: int, num_layers: int) -> MoeConfig | None:
    """DeepSeek-V2's routing (transformers' DeepseekV2TopkRouter): softmax scores, topk_method greedy (the top k of
    all experts) or group_limited_greedy (within the topk_group groups of n_group whose best score is highest), the
    picked scores as they are (its norm_topk_prob is never read) times routed_scaling_factor; an ungated shared
    expert of n_shared_experts x moe_intermediate_size."""
    method = getattr(hf, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ExportError(f"deepseek_v2 with topk_method {method!r} is not exported: transformers' DeepseekV2 router "
                          "takes greedy and group_limited_greedy")
    if getattr(hf, "mlp_bias", False):
        raise ExportError("deepseek_v2 with mlp_bias (biased dense and shared-expert projections) is not exported: no "
                          "such checkpoint is known")
    groups = int(getattr(hf, "n_group", 1) or 1) if method == "group_limited_greedy" else 1
    topk_group = int(getattr(hf, "topk_group", 1) or 1) if groups > 1 else 1
    if experts % groups or not 1 <= topk_group <= groups:
        raise ExportError(f"config.json n_group {groups} / topk_group {topk_group} do not divide {experts} experts: "
                          "n_group must divide n_routed_experts and topk_group lie between 1 and n_group")
    sparse = _sparse_from_first_dense(hf, num_layers)
    if not any(sparse):
        return None
    shared = int(getattr(hf, "n_shared_experts", 0) or 0) * int(hf.moe_intermediate_size)
    return MoeConfig(experts, top_k, int(hf.moe_intermediate_size), False, sparse, shared or None,
                     routed_scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0), groups=groups,
                     topk_group=topk_group, scaled_softmax=True)


def _gemma4_moe(hf, num_layers: int) -> MoeConfig | None:
    """Gemma 4's experts (transformers' Gemma4TextRouter / Gemma4TextExperts, as in Gemma 4 26B-A4B): on every layer
    beside the dense MLP when enable_moe_block is set, top_k_experts of num_experts GEGLU experts of
    moe_intermediate_size."""
    if not hf.enable_moe_block:
        return None
    experts, top_k, width = hf.num_experts, hf.top_k_experts, hf.moe_intermediate_size
    if not experts or not top_k or not width or top_k > experts:
        raise ExportError(f"gemma4_text with enable_moe_block needs num_experts, top_k_experts and "
                          f"moe_intermediate_size, top_k_experts at most num_experts; config.json gives {experts}, "
                          f"{top_k} and {width}")
    if hf.hidden_activation != "gelu_pytorch_tanh":
        raise ExportError(f"gemma4_text experts with hidden_activation {hf.hidden_activation!r} are not exported: they "
                          "are built as GEGLU (gelu_pytorch_tanh, every Gemma 4 checkpoint's), which is what "
                          "onnxruntime's CUDA MoE op computes")
    return MoeConfig(int(experts), int(top_k), int(width), True, (True,) * num_layers, beside_dense_mlp=True)


def _moe_config(hf, model_type: str, num_layers: int) -> MoeConfig | None:
    if TEXT_FAMILY_OF.get(model_type, model_type) == "gemma4_text":
        return _gemma4_moe(hf, num_layers)
    if model_type not in MOE_TYPES:
        return None
    if model_type == "granitemoehybrid" and not getattr(hf, "num_local_experts", 0):
        return None  # Granite 4.0-H's dense sizes: the shared MLP alone
    experts_key, width_key = MOE_TYPES[model_type]
    experts = getattr(hf, experts_key, None) or getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None)
    if not experts or not top_k or top_k > experts:
        raise ExportError(f"config.json of this {model_type} model names {experts} experts and {top_k} per token: "
                          "num_experts_per_tok must be between 1 and the expert count")
    # granitemoe and gpt-oss softmax the top-k logits, which is renormalizing softmax's top k; mixtral
    # always renormalizes.
    # qwen3_5_moe always renormalizes (its config has no norm_topk_prob), and so does Qwen3-VL-MoE's language model
    # (qwen3_vl_moe_text, read as qwen3_moe: exporter/graph/language_model.py), whatever its config says.
    always = ("mixtral", "granitemoe", "gpt_oss", "qwen3_5_moe_text", "qwen3_5_moe", "granitemoehybrid",
              "qwen3_vl_moe_text")
    normalize = (True if model_type in always or getattr(hf, "model_type", None) in always
                 else bool(getattr(hf, "norm_topk_prob", False)))
    step = getattr(hf, "decoder_sparse_step", None) or 1
    dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    shared = getattr(hf, "shared_expert_intermediate_size", None) if model_type in SHARED_EXPERT_TYPES else None
    # Older transformers (5.17) hard-code gpt-oss's alpha in its experts; newer ones read swiglu_alpha.
    swiglu = (float(getattr(hf, "swiglu_alpha", 1.702)), float(getattr(hf, "swiglu_limit", 7.0))) \
        if model_type == "gpt_oss" else (None, None)
    if model_type == "lfm2_moe":
        if not getattr(hf, "norm_topk_prob", True):
            raise ExportError("lfm2_moe with norm_topk_prob false (the picked sigmoid scores unnormalized) is not "
                              "exported: no such checkpoint is known; set it true only if the model was trained so")
        step, dense = 1, set(range(int(getattr(hf, "num_dense_layers", 0))))
        sparse = tuple(i not in dense for i in range(num_layers))
        return MoeConfig(int(experts), int(top_k), int(hf.moe_intermediate_size), True, sparse,
                         sigmoid_routing=True, routed_scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0))
    if model_type == "nemotron_h":
        if MOE_BLOCK not in hf.layer_types:
            return None  # Nemotron-H's dense checkpoints: Mamba2, attention and MLP blocks only
        if not getattr(hf, "norm_topk_prob", True):
            raise ExportError("nemotron_h with norm_topk_prob false (the picked sigmoid scores unnormalized) is not "
                              "exported: no such checkpoint is known; set it true only if the model was trained so")
        groups, topk_group = int(getattr(hf, "n_group", 1) or 1), int(getattr(hf, "topk_group", 1) or 1)
        if experts % groups or not 1 <= topk_group <= groups:
            raise ExportError(f"config.json n_group {groups} / topk_group {topk_group} do not divide {experts} experts: "
                              "n_group must divide n_routed_experts and topk_group lie between 1 and n_group")
        latent = getattr(hf, "moe_latent_size", None)
        return MoeConfig(int(experts), int(top_k), int(hf.moe_intermediate_size), True,
                         tuple(t == MOE_BLOCK for t in hf.layer_types),
                         int(hf.moe_shared_expert_intermediate_size),  # transformers builds it whatever n_shared_experts says
                         sigmoid_routing=True, routed_scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
                         groups=groups, topk_group=topk_group, relu2_experts=True, latent=int(latent) if latent else None)
    if model_type in GROUPED_SIGMOID_TYPES:
        if not getattr(hf, "norm_topk_prob", True):
            raise ExportError(f"{model_type} with norm_topk_prob false (the picked sigmoid scores unnormalized) is not "
                              "exported: the expert op renormalizes what the router picks; no such checkpoint is known")
        groups, topk_group = int(getattr(hf, "n_group", 1) or 1), int(getattr(hf, "topk_group", 1) or 1)
        if experts % groups or not 1 <= topk_group <= groups:
            raise ExportError(f"config.json n_group {groups} / topk_group {topk_group} do not divide {experts} experts: "
                              "n_group must divide n_routed_experts and topk_group lie between 1 and n_group")
        sparse = _sparse_from_first_dense(hf, num_layers)
        if not any(sparse):
            return None  # every layer dense (a depth-truncated checkpoint)
        shared = int(getattr(hf, "n_shared_experts", 0) or 0) * int(hf.moe_intermediate_size)
        return MoeConfig(int(experts), int(top_k), int(hf.moe_intermediate_size), True, sparse, shared or None,
                         sigmoid_routing=True, routed_scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
                         groups=groups, topk_group=topk_group)
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe(hf, int(experts), int(top_k), num_layers)
    if model_type == "llama4_text":
        if top_k != 1:
            raise ExportError(f"llama4_text with num_experts_per_tok {top_k} is not exported: its router scales each picked "
                              "expert's input by its own score, which the expert op does for one expert a token (every "
                              "Llama 4 checkpoint picks one)")
        layers = set(hf.moe_layers or ())
        return MoeConfig(int(experts), 1, int(hf.intermediate_size), True, tuple(i in layers for i in range(num_layers)),
                         int(hf.intermediate_size), input_scaled=True)
    if model_type == "ernie4_5_moe":
        if getattr(hf, "use_bias", False):
            raise ExportError("ernie4_5_moe with use_bias (biased expert and shared-expert projections) is not exported: "
                              "no such checkpoint is known")
        end = hf.moe_layer_end_index if hf.moe_layer_end_index >= 0 else num_layers - 1
        step = int(hf.moe_layer_interval or 1)
        sparse = tuple((i + 1) % step == 0 and hf.moe_layer_start_index <= i <= end for i in range(num_layers))
        shared = int(hf.moe_num_shared_experts or 0) * int(hf.moe_intermediate_size)
        return MoeConfig(int(experts), int(top_k), int(hf.moe_intermediate_size), True, sparse, shared or None,
                         biased_softmax=True)
    mixer = None
    if model_type == "phimoe":  # the sparsemixer picks two experts whatever num_experts_per_tok says
        mixer, top_k = float(getattr(hf, "router_jitter_noise", 0.01)), 2
        if experts < 2:
            raise ExportError("phimoe's sparsemixer picks two experts: config.json must name at least two")
    return MoeConfig(int(experts), int(top_k), int(getattr(hf, width_key)), normalize, sparse,
                     int(shared) if shared else None, *swiglu, mixer)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture-independent numbers; ``architecture`` names the file that knows the rest."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    hf_config: object = dataclasses.field(repr=False, compare=False, default=None)
    # Per layer: full_attention or sliding_attention (a window of sliding_window tokens, itself included).
    layer_types: tuple[str, ...] = ()
    # Per layer: whether rotary applies (smollm3 leaves it out on every Nth layer).
    rope_layers: tuple[bool, ...] = ()
    # Per layer type, when the rope differs between them (gemma3); else every layer uses ``rope``.
    rope_by_layer_type: dict = dataclasses.field(default_factory=dict)
    hidden_act: str = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None  # gemma2: tanh(scores / cap) * cap
    final_softcap: float | None = None
    embedding_scale: float | None = None  # gemma: sqrt(hidden); granite: embedding_multiplier
    residual_scale: float | None = None  # granite: residual_multiplier on every branch
    logits_divisor: float | None = None  # granite: logits_scaling
    moe: MoeConfig | None = None  # mixture-of-experts routing and sizes (None: a dense model)
    clip_qkv: float | None = None  # olmoe: q, k and v clamped to +-clip_qkv after their norms
    lm_head_bias: bool = False  # phimoe
    recurrent: RecurrentConfig | None = None  # a hybrid's recurrent layers (layer_types LINEAR / CONV)
    attention_output_gate: bool = False  # qwen3_next / qwen3_5: o_proj(attn * sigmoid(gate)), gate from q_proj
    # falcon_h1's muP multipliers (1.0 where absent): attention_in / attention_out / key, ssm_in / ssm_out, ssm (z, x,
    # B, C, dt of Mamba2's projection), mlp_gate / mlp_down. Applied to activations, as transformers applies them.
    multipliers: dict = dataclasses.field(default_factory=dict)
    # deepseek_v3's multi-head latent attention; its caches hold the latent: one KV head of kv_rank + rope_dim.
    latent: LatentAttentionConfig | None = None
    # The value caches' head size where it is not head_dim (a traced latent-attention cache: keys the latent, values
    # the rotary key; exporter.contract.VALUE_HEAD_DIM); None: values as wide as keys.
    value_head_dim: int | None = None
    rotary_interleaved: bool = False  # the rotary pairs adjacent dims (ernie4_5, cohere2), not the two halves
    qk_norm_after_rotary: bool = False  # hunyuan_v1_dense: q / k norms on the rotated heads
    # ministral3: queries scaled by 1 + beta * log(1 + floor(position / original_max)): (beta, original_max)
    position_query_scale: tuple[float, int] | None = None
    # llama4_text: chunked layers' chunk; the NoPE layers' queries scaled by 1 + attn_scale * log1p(floor((position
    # + 1) / floor_scale)): (attn_scale, floor_scale); weightless q / k norms after the rotary on the rotary layers.
    attention_chunk: int | None = None
    temperature_tuning: tuple[float, float] | None = None
    weightless_qk_norm: bool = False
    # gemma4: per layer its attention shapes and KV sharing (empty: the model-wide numbers and a cache of its own), per
    # layer its MLP width (double-wide on the KV-shared layers), values through a weightless RMSNorm, per-layer inputs.
    layer_attention: tuple[LayerAttention, ...] = ()
    layer_intermediate: tuple[int, ...] = ()
    value_norm: bool = False
    per_layer_input: PerLayerInputConfig | None = None

    def for_layer(self, layer: int) -> ModelConfig:
        """The config as layer ``layer`` sees it: its head size, KV heads and MLP width where they vary by layer."""
        changes = {}
        if self.layer_attention:
            own = self.layer_attention[layer]
            changes.update(head_dim=own.head_dim, num_kv_heads=own.num_kv_heads)
        if self.layer_intermediate:
            changes["intermediate_size"] = self.layer_intermediate[layer]
        changes = {k: v for k, v in changes.items() if getattr(self, k) != v}
        return dataclasses.replace(self, **changes) if changes else self

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values ``layer`` attends over: itself, or the earlier one it shares them with."""
        return self.layer_attention[layer].kv_source if self.layer_attention else layer

    def value_is_key(self, layer: int) -> bool:
        """Whether ``layer``'s values are its keys (gemma4's attention_k_eq_v): one projection, no v_proj."""
        return bool(self.layer_attention) and self.layer_attention[layer].value_is_key

    def has_cache(self, layer: int) -> bool:
        """Whether ``layer`` carries a KV cache of its own: it attends, over its own keys and values."""
        return self.is_attention(layer) and self.kv_source(layer) == layer

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` carries a recurrent state (and no KV cache, unless it is falcon_h1's parallel layer)."""
        return bool(self.layer_types) and self.layer_types[layer] in (LINEAR, CONV, PARALLEL)

    def is_feed_forward(self, layer: int) -> bool:
        """Whether ``layer`` is a block with only an MLP or only experts (nemotron_h): no cache, no state."""
        return bool(self.layer_types) and self.layer_types[layer] in (MLP_BLOCK, MOE_BLOCK)

    def is_attention(self, layer: int) -> bool:
        """Whether ``layer`` attends (and carries a KV cache)."""
        return not self.layer_types or self.layer_types[layer] not in (LINEAR, CONV, MLP_BLOCK, MOE_BLOCK)

    @property
    def single_mixer(self) -> bool:
        """Each layer one mixer (attention, recurrence, MLP or experts) after one norm (nemotron_h), not
        attention or recurrence followed by an MLP."""
        return self.architecture == "nemotron_h"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_attention(i))

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of ``layer`` (None: not a chunked layer)."""
        if self.layer_types and self.layer_types[layer] == CHUNKED:
            return self.attention_chunk
        return None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def uses_rope(self, layer: int) -> bool:
        return self.is_attention(layer) and (not self.rope_layers or self.rope_layers[layer])

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.rope_by_layer_type.get(self.layer_types[layer], self.rope) if self.rope_by_layer_type else self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def value_size(self) -> int:
        """One token's values in one layer's cache (``kv_size`` unless the values have a head size of their own)."""
        return self.num_kv_heads * (self.value_head_dim or self.head_dim)


def read_raw_config(checkpoint_dir: Path) -> dict:
    from exporter.packaging.source_files import checkpoint_file

    path = checkpoint_file(checkpoint_dir, "config.json", required=False)
    if path is None:
        raise ExportError(f"{checkpoint_dir} has no config.json: point --model at a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{path} is not valid JSON ({err}): re-download the checkpoint") from None


# Architectures whose config.json, when complete, says all the exporter needs without
# transformers' config classes (their defaults and __post_init__ are reproduced in plain_config;
# tests/test_config_plain.py compares the result with transformers' for each).
PLAIN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
_ROPE_TYPES_PLAIN = ("default", "linear", "llama3", "yarn", "longrope")


def plain_config(raw: dict) -> types.SimpleNamespace | None:
    """config.json as the attributes load_model_config reads, normalized as transformers would, or
    None when this config needs transformers (another architecture, a missing field whose default
    lives in its config class, nested or unknown rope parameters)."""
    model_type = raw.get("model_type")
    if model_type not in PLAIN_TYPES or any(raw.get(k) is None for k in _REQUIRED):
        return None
    if model_type in ("mistral", "qwen2", "qwen3") and "sliding_window" not in raw:
        return None  # the class default (4096) would apply
    if model_type in ("qwen2", "qwen3") and ("use_sliding_window" not in raw or "max_window_layers" not in raw):
        return None
    if raw.get("num_key_value_heads") is None or (model_type == "qwen3" and raw.get("head_dim") is None):
        return None  # class defaults (e.g. qwen2 32 kv heads, qwen3 head_dim 128), not derived values
    if raw.get("rope_parameters") is not None and raw.get("rope_scaling") is not None:
        return None  # transformers prefers rope_scaling there; do not guess
    top_original = raw.get("original_max_position_embeddings")
    if (model_type == "phi3") != (top_original is not None):
        return None  # phi3's class default (4096) applies when absent; elsewhere its meaning varies
    params = raw.get("rope_parameters")
    if params is None and raw.get("rope_theta") is not None:
        params = {"rope_theta": raw["rope_theta"], **(raw.get("rope_scaling") or {})}
    if not isinstance(params, dict) or not params or any(isinstance(v, dict) for v in params.values()):
        return None
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", raw.get("rope_theta"))
    if params["rope_type"] not in _ROPE_TYPES_PLAIN or params["rope_theta"] is None:
        return None
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if top_original is not None:  # phi3: the top-level value wins, as transformers standardizes it
            params["original_max_position_embeddings"] = top_original
        params.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    values = dict(raw)
    values["rope_parameters"] = params
    values["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):  # their __post_init__: the window only with use_sliding_window
        values["sliding_window"] = raw["sliding_window"] if raw["use_sliding_window"] else None
        if raw.get("layer_types") is None:
            values["layer_types"] = [
                SLIDING if values["sliding_window"] is not None and i >= raw["max_window_layers"] else FULL
                for i in range(raw["num_hidden_layers"])]
    return types.SimpleNamespace(**values)


# config.json values the exporter sizes things by: (smallest, largest) for each. The largest are far
# past any published model, there to stop a typo or a hostile file from sizing a table in gigabytes
# (max_position_embeddings 4e8 sized a 12.8 GB rope table) before any shape is compared.
_BOUNDS = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
    "head_dim": (1, 2048), "max_position_embeddings": (1, 1 << 27), "sliding_window": (0, 1 << 27),  # 0: none (qwen2_moe)
    "num_experts": (1, 4096), "num_local_experts": (1, 4096), "num_experts_per_tok": (1, 4096),
    "top_k_experts": (1, 4096), "moe_intermediate_size": (1, 1 << 20), "shared_expert_intermediate_size": (1, 1 << 20),
    "decoder_sparse_step": (1, 1024),
}


def check_config_values(raw: dict) -> None:
    """Every sizing value of config.json an integer within its bounds, rms_norm_eps a small positive
    number, the heads consistent: refused by name before anything is sized by them."""
    config = {**(raw.get("text_config") or {}), **raw} if isinstance(raw.get("text_config"), dict) else raw
    for key, (low, high) in _BOUNDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ExportError(f"config.json {key} must be an integer, not {value!r}: fix the checkpoint's config.json")
        if not low <= value <= high:
            raise ExportError(f"config.json {key} = {value} is outside {low}..{high}: fix the checkpoint's config.json")
    eps = config.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
        raise ExportError(f"config.json rms_norm_eps must be a number between 0 and 1, not {eps!r}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ExportError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")


def check_not_prequantized(raw: dict) -> None:
    """A checkpoint whose weights are stored quantized holds packed blocks where the exporter reads
    float tensors: refused by name, with the way around, unless it is one the exporter imports (GPTQ
    and AWQ linears MatMulNBits can hold, gpt-oss's MXFP4 experts)."""
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict):
        return
    method = quant.get("quant_method", "a quantization")
    if method == "mxfp4" and raw.get("model_type") == "gpt_oss":
        return  # gpt-oss's MXFP4 experts are decoded as they are read (WeightPart.mxfp4_scales)
    if read_format(raw) is not None:
        return  # GPTQ / AWQ linears: imported as they are (packaging/prequantized.py); read_format refuses the rest
    how = ("load it with transformers' Mxfp4Config(dequantize=True) and save_pretrained the bf16 result"
           if method == "mxfp4" else "export the float checkpoint it was quantized from, or dequantize it first")
    raise ExportError(f"config.json declares {method!r} pre-quantized weights, which the exporter does not import: {how}")


def load_model_config(checkpoint_dir: Path, supported: dict[str, object]) -> ModelConfig:
    """Read config.json: directly when it says everything (plain_config), else through transformers'
    AutoConfig (which normalizes rope, head_dim and per-architecture defaults)."""
    raw = read_raw_config(checkpoint_dir)
    model_type = raw.get("model_type")
    if model_type not in supported:
        names = ", ".join(sorted(supported))
        raise ExportError(f"unsupported architecture {model_type!r} in config.json: supported are {names}")
    check_config_values(raw)
    check_not_prequantized(raw)
    hf = plain_config(raw)
    if hf is None:
        hf = _transformers_config(checkpoint_dir)
    return _model_config(hf, model_type)


def _transformers_config(checkpoint_dir: Path):
    with _TRANSFORMERS_IMPORT:  # transformers' lazy modules are not safe to import from many threads
        from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(checkpoint_dir))
    except Exception as err:  # transformers' own checks of config.json (layer types it does not know, ...)
        raise ExportError(f"transformers refuses {checkpoint_dir}/config.json: {' '.join(str(err).split())[:900]}: fix config.json or "
                          "use a transformers release that reads it") from None


# Image-text checkpoints whose config.json's text_config describes the language model the exporter reads (its weights
# under model.language_model): gemma4's exported alone, the vision tower's ignored; qwen3_5's as the decoder of its
# image-text export (graph/language_model.py IMAGE_TEXT_HYBRIDS; exports of earlier versions hold it alone).
LANGUAGE_MODEL_OF = ("qwen3_5", "qwen3_5_moe", "gemma4")
# The text family each one's language model is (what its features are read as).
TEXT_FAMILY_OF = {"gemma4": "gemma4_text"}


def text_model_config(hf_text, model_type: str) -> ModelConfig:
    """The ModelConfig of an image-text checkpoint's language model from its transformers text config
    (``get_text_config()``) and that config's own model_type (exporter/graph/language_model.py)."""
    return _model_config(hf_text, model_type)


def _recurrent_config(hf, model_type: str, layer_types: tuple[str, ...]) -> RecurrentConfig | None:
    if (LINEAR in layer_types or PARALLEL in layer_types) and model_type in MAMBA2_TYPES:
        limit = tuple(getattr(hf, "time_step_limit", None) or (0.0, float("inf")))
        if limit != (0.0, float("inf")):
            # transformers clamps dt to it in a prefill but not in a one-token decode step: no single graph
            # reproduces both.
            raise ExportError(f"time_step_limit {list(limit)} in config.json: transformers applies it to a prompt but not "
                              "to a decode step, which one graph cannot match; only the default (0, inf) is exported")
        gated_norm = GATE_THEN_NORM
        if model_type == "nemotron_h":  # its own names for the same sizes
            heads, head_dim, groups, d_state = hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.ssm_state_size
            taps, conv_bias, proj_bias = hf.conv_kernel, hf.use_conv_bias, hf.use_bias
        else:
            heads, head_dim, groups, d_state = hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state
            taps, conv_bias, proj_bias = hf.mamba_d_conv, hf.mamba_conv_bias, hf.mamba_proj_bias
            if model_type == "falcon_h1":
                gated_norm = (GATE_ONLY if not hf.mamba_rms_norm else NORM_THEN_GATE if hf.mamba_norm_before_gate
                              else GATE_THEN_NORM)
        heads, head_dim, groups, d_state = int(heads), int(head_dim), int(groups), int(d_state)
        if heads % groups:
            raise ExportError(f"{heads} Mamba heads are not a multiple of its {groups} groups: fix config.json")
        return RecurrentConfig(MAMBA2, int(taps), heads * head_dim + 2 * groups * d_state, groups, heads,
                               d_state, head_dim, conv_bias=bool(conv_bias), norm_eps=float(hf.rms_norm_eps),
                               proj_bias=bool(proj_bias), gated_norm=gated_norm)
    if LINEAR in layer_types:
        return RecurrentConfig(
            GATED_DELTANET, int(hf.linear_conv_kernel_dim),
            2 * hf.linear_num_key_heads * hf.linear_key_head_dim + hf.linear_num_value_heads * hf.linear_value_head_dim,
            int(hf.linear_num_key_heads), int(hf.linear_num_value_heads), int(hf.linear_key_head_dim),
            int(hf.linear_value_head_dim), norm_eps=float(hf.rms_norm_eps))
    if CONV in layer_types:
        return RecurrentConfig(SHORT_CONV, int(hf.conv_L_cache), int(hf.hidden_size), conv_bias=bool(hf.conv_bias))
    return None


# Multi-head latent attention: DeepSeek-V3 (and Kimi-K2), DeepSeek-V2 (its rotary always pairs adjacent dims: complex
# multiplication in place), GLM-4.7-Flash (glm4_moe_lite).
LATENT_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
# Families whose rotary pairs adjacent dims (x0, x1), (x2, x3), ... (transformers' rotate_half on [..., ::2]).
INTERLEAVED_ROTARY_TYPES = ("ernie4_5", "ernie4_5_moe", "cohere2", "llama4_text")
# Families whose global (full_attention) layers attend without positions when the others slide (exaone4, cohere2).
NOPE_GLOBAL_TYPES = ("exaone4", "cohere2")


def _position_query_scale(params: dict) -> tuple[float, int] | None:
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    if not params.get("original_max_position_embeddings"):
        raise ExportError("config.json's rope_parameters give llama_4_scaling_beta without original_max_position_embeddings: "
                          "the query scale needs both")
    return float(beta), int(params["original_max_position_embeddings"])


def _latent_config(hf, model_type: str, params: dict) -> LatentAttentionConfig:
    if not hf.kv_lora_rank or not hf.qk_rope_head_dim or not hf.v_head_dim:
        raise ExportError(f"config.json of this {model_type} model lacks kv_lora_rank, qk_rope_head_dim or v_head_dim: "
                          "multi-head latent attention needs all three")
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise ExportError(f"{model_type} with partial_rotary_factor {partial} is not exported: latent attention rotates "
                          "the whole qk_rope_head_dim (transformers' tables would not match its rotary key either)")
    return LatentAttentionConfig(int(hf.q_lora_rank) if hf.q_lora_rank else None, int(hf.kv_lora_rank),
                                 int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim), int(hf.v_head_dim),
                                 model_type == "deepseek_v2" or bool(getattr(hf, "rope_interleave", True)))


def _lfm2_intermediate(hf) -> int:
    """LFM2's MLP width, adjusted as its MLP module adjusts it (transformers' Lfm2MLP)."""
    width = hf.intermediate_size
    if getattr(hf, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if getattr(hf, "block_ffn_dim_multiplier", None) is not None:
            width = int(hf.block_ffn_dim_multiplier * width)
        multiple = hf.block_multiple_of
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _model_config(hf, model_type: str) -> ModelConfig:
    if model_type in LANGUAGE_MODEL_OF and getattr(hf, "text_config", None) is not None:
        hf = hf.text_config
    family = TEXT_FAMILY_OF.get(model_type, model_type)  # gemma4's language model is a gemma4_text
    if model_type in ("lfm2", "lfm2_moe"):  # its own name for the norms' epsilon
        hf.rms_norm_eps = hf.norm_eps
    if model_type == "nemotron_h":
        hf.rms_norm_eps = hf.layer_norm_epsilon
    if model_type == "cohere2":
        hf.rms_norm_eps = hf.layer_norm_eps
    if family == "gemma4_text":  # head sizes and KV heads by layer (_gemma4_fields); the model-wide ones: the sliding layers'
        hf.allow_global_per_layer_attribute_access = True
    multipliers = {}
    if model_type == "falcon_h1":
        multipliers = {"attention_in": hf.attention_in_multiplier, "attention_out": hf.attention_out_multiplier,
                       "key": hf.key_multiplier, "ssm_in": hf.ssm_in_multiplier, "ssm_out": hf.ssm_out_multiplier,
                       "ssm": tuple(hf.ssm_multipliers), "mlp_gate": hf.mlp_multipliers[0], "mlp_down": hf.mlp_multipliers[1]}
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    params = dict(getattr(hf, "rope_parameters", None) or {})
    latent = _latent_config(hf, model_type, params) if model_type in LATENT_TYPES else None
    if params.get("rope_type") == "dynamic" and params.get("alpha") and model_type == "hunyuan_v1_dense":
        # Hunyuan's "dynamic" with a fixed alpha (NTK-alpha) only stretches the base: a static rope (transformers'
        # own ntk_alpha), the exponent from the head dim.
        params = {"rope_type": "default",
                  "rope_theta": float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))}
    if latent is not None:  # the rope covers the shared rotary key; the caches one head of latent + rotary key
        head_dim = latent.rope_dim
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    if per_type:  # gemma3: {"sliding_attention": {...}, "full_attention": {...}}
        ropes = {t: _rope(hf, p, _layer_type_head_dim(hf, family, t, head_dim), t) for t, p in params.items()}
        rope = ropes.get(FULL) or next(iter(ropes.values()))
    else:
        ropes, rope = {}, _rope(hf, params, head_dim, None)
    if any(r.rope_type == "longrope" for r in ropes.values()):
        raise ExportError("longrope with a rope per layer type is not supported: no such model is known to the exporter")
    sliding = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        sliding = None
    if not layer_types or len(layer_types) != hf.num_hidden_layers:
        layer_types = ((SLIDING if sliding else FULL),) * hf.num_hidden_layers
    known = LAYER_TYPES.get(model_type, (FULL, SLIDING))
    unknown = sorted(set(layer_types) - set(known))
    if unknown:
        raise ExportError(f"unsupported layer types {unknown} in config.json of this {model_type} model: the exporter "
                          f"builds {', '.join(known)} layers for it")
    if sliding is None and model_type not in LAYER_TYPES:
        layer_types = (FULL,) * hf.num_hidden_layers
    no_rope = getattr(hf, "no_rope_layers", None)  # smollm3: 1 = rotary, 0 = none
    rope_layers = tuple(bool(v) for v in no_rope) if no_rope else ()
    if model_type in NOPE_GLOBAL_TYPES and sliding is not None:
        rope_layers = tuple(t == SLIDING for t in layer_types)
    if (model_type == "granitemoehybrid" and getattr(hf, "position_embedding_type", None) != "rope"
            or model_type == "nemotron_h"):
        rope_layers = (False,) * hf.num_hidden_layers  # Granite 4.0-H and Nemotron-H attend without positions (NoPE)
    act = (getattr(hf, "hidden_activation", None) or getattr(hf, "mlp_hidden_act", None)
           or getattr(hf, "hidden_act", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ExportError(f"unsupported MLP activation {act!r}: supported are {', '.join(SUPPORTED_ACTIVATIONS)}")
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    attention_scale = getattr(hf, "attention_multiplier", None) or (scalar ** -0.5 if scalar else None)
    gemma4 = _gemma4_fields(hf, layer_types) if family == "gemma4_text" else {}
    if gemma4:
        attention_scale = 1.0  # its q / k norms stand in for the softmax scale
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if latent is not None:
        from transformers.modeling_rope_utils import yarn_apply_mscale  # yarn's mscale_all_dim on the softmax scale

        attention_scale = yarn_apply_mscale(rope.parameters, (latent.nope_dim + latent.rope_dim) ** -0.5)
        head_dim, num_kv_heads = latent.kv_rank + latent.rope_dim, 1
    embedding_scale = getattr(hf, "embedding_multiplier", None)
    if family in ("gemma2", "gemma3_text", "gemma4_text"):
        embedding_scale = hf.hidden_size ** 0.5
    return ModelConfig(
        architecture=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=(_lfm2_intermediate(hf) if model_type == "lfm2" else hf.shared_intermediate_size
                           if model_type == "granitemoehybrid" else hf.intermediate_size_mlp if model_type == "llama4_text"
                           else (getattr(hf, "intermediate_size", None) or 0)),
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        rope=rope,
        attention_bias=bool(getattr(hf, "attention_bias", False) or getattr(hf, "use_bias", False)),  # ernie: use_bias
        mlp_bias=bool(getattr(hf, "mlp_bias", False) or getattr(hf, "use_bias", False)),
        sliding_window=sliding,
        hf_config=hf,
        layer_types=layer_types,
        rope_layers=rope_layers,
        rope_by_layer_type=ropes,
        hidden_act=act,
        attention_scale=attention_scale,
        attention_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
        embedding_scale=embedding_scale,
        residual_scale=getattr(hf, "residual_multiplier", None),
        logits_divisor=(1.0 / hf.lm_head_multiplier if model_type == "falcon_h1" and hf.lm_head_multiplier != 1.0
                        else 1.0 / hf.logit_scale if model_type == "cohere2" and hf.logit_scale not in (None, 1.0)
                        else getattr(hf, "logits_scaling", None)),
        moe=_moe_config(hf, model_type, hf.num_hidden_layers),
        clip_qkv=getattr(hf, "clip_qkv", None),
        lm_head_bias=bool(getattr(hf, "lm_head_bias", False)),
        recurrent=_recurrent_config(hf, model_type, layer_types),
        attention_output_gate=model_type in HYBRID_LAYER_TYPES and model_type not in ("lfm2", "lfm2_moe", *MAMBA2_TYPES),
        multipliers=multipliers,
        latent=latent,
        rotary_interleaved=model_type in INTERLEAVED_ROTARY_TYPES,
        qk_norm_after_rotary=model_type in ("hunyuan_v1_dense", "llama4_text"),
        attention_chunk=int(hf.attention_chunk_size) if model_type == "llama4_text" and hf.attention_chunk_size else None,
        temperature_tuning=((float(hf.attn_scale), float(hf.floor_scale))
                            if model_type == "llama4_text" and hf.attn_temperature_tuning else None),
        weightless_qk_norm=model_type == "llama4_text" and bool(hf.use_qk_norm),
        position_query_scale=_position_query_scale(params) if model_type == "ministral3" else None,
        **gemma4,
    )


def _layer_type_head_dim(hf, model_type: str, layer_type: str, head_dim: int) -> int:
    """The head size of a layer type's rope: gemma4's global layers have their own (global_head_dim)."""
    return int(hf.per_layer_config[layer_type].head_dim) if model_type == "gemma4_text" else head_dim


def _gemma4_fields(hf, layer_types: tuple[str, ...]) -> dict:
    """Gemma 4's per-layer attention (global layers with their own head size and, with attention_k_eq_v, KV heads
    whose values are the keys), the last num_kv_shared_layers reading the K/V of the last earlier layer of their type
    (with use_double_wide_mlp, an MLP twice as wide), values through a weightless RMSNorm, and the per-layer inputs;
    refused by name where the exporter does not build what config.json switches on."""
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        raise ExportError("gemma4_text with use_bidirectional_attention \"all\" attends both ways, which a causal "
                          "decoder with a KV cache cannot: export a checkpoint whose text attention is causal")
    layers = hf.num_hidden_layers
    try:
        modes = hf.kv_sharing_modes
    except ValueError as err:  # a shared layer type no earlier layer produces
        raise ExportError(f"config.json's num_kv_shared_layers {hf.num_kv_shared_layers}: {err}") from None
    if modes and modes[0] == "reuse":
        raise ExportError(f"num_kv_shared_layers {hf.num_kv_shared_layers} of {layers} layers: some layer must "
                          "project the keys and values the shared layers read")
    store = {layer_types[i]: i for i in range(layers) if modes[i] != "reuse"}  # the last of each type before sharing
    attention = []
    for i in range(layers):
        own = hf.per_layer_config[i]
        attention.append(LayerAttention(
            int(own.head_dim), int(own.num_key_value_heads), store[layer_types[i]] if modes[i] == "reuse" else i,
            bool(hf.attention_k_eq_v) and layer_types[i] != SLIDING))
    wide = bool(hf.use_double_wide_mlp)
    per_layer = int(hf.hidden_size_per_layer_input or 0)
    return {"layer_attention": tuple(attention),
            "layer_intermediate": tuple(hf.intermediate_size * (2 if wide and m == "reuse" else 1) for m in modes),
            "value_norm": True,
            "per_layer_input": PerLayerInputConfig(int(hf.vocab_size_per_layer_input), per_layer) if per_layer else None}


def _rope(hf, params: dict, head_dim: int, layer_type: str | None) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ExportError(
            f"unsupported rope type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    if rope_type == "proportional":  # the whole head turns, the angles past partial_rotary_factor's share by 0
        partial = 1.0
    original_max = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", None)
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    frozen = {**params, "rope_theta": theta, "rope_type": rope_type}
    if rope_type in ("llama3", "yarn", "longrope") and frozen.get("original_max_position_embeddings") is None:
        frozen["original_max_position_embeddings"] = original_max or hf.max_position_embeddings
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        rotary_dim=int(head_dim * partial),
        original_max_position_embeddings=original_max if rope_type == "longrope" else None,
        layer_type=layer_type,
        params=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in frozen.items())),
    )
