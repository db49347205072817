"""Small random-weight checkpoints of real architectures, built offline with transformers.

Tests, ``make run`` and the benchmarks use them: the hub is not reachable everywhere, and a
few-MB checkpoint of the real model class is what the exporter must be right about.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Small but real shapes: GQA (kv heads < heads), head_dim 16 (GroupQueryAttention's rotary needs %16).
BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # A window of 8 tokens: the tests' 12-token prompts and 24 steps run well past it.
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": (
        "Phi3Config",
        {
            # Phi-3.5-mini's longrope, scaled down: the long factors apply past 64 positions.
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [1.5 + 0.25 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
            "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
        },
    ),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.03125, "logits_scaling": 0.5},
    ),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "no_rope_layers": [1, 0], "pad_token_id": 0}),
    # Mixtures of experts: 8 experts of width 32, 2 or 3 per token (docs/moe-design.md).
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "qwen2_moe": (
        # norm_topk_prob off (the class default) and a dense layer (mlp_only_layers) beside the sparse one.
        "Qwen2MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "intermediate_size": 96,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1], "use_sliding_window": False},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True}),
    # clip_qkv 2.0 is reached by the tiny model's normed queries and keys.
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False,
                              "clip_qkv": 2.0}),
    "granitemoe": (
        "GraniteMoeConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "embedding_multiplier": 12.0,
         "residual_multiplier": 0.22, "attention_multiplier": 0.03125, "logits_scaling": 0.5},
    ),
    # Sliding-window layers alternating with full ones, as gpt-oss-20b's, with a window of 8 tokens.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    # Phi-3.5-MoE's layout: biased LayerNorms, attention and LM head; a sparsemixer threshold of 0.1 so
    # that some tokens' second expert is masked down to a weight of 1 and others' is not.
    # Its longrope scaled down as phi3's (long past 64 positions), with Phi-3.5-MoE's own mscales.
    "phimoe": (
        "PhimoeConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "attention_bias": True,
         "lm_head_bias": True, "router_jitter_noise": 0.1, "max_position_embeddings": 256,
         "original_max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                             "short_factor": [1.0 + 0.05 * i for i in range(8)],
                             "long_factor": [1.5 + 0.25 * i for i in range(8)], "short_mscale": 1.1, "long_mscale": 1.25}},
    ),
}
# Hybrids: recurrent layers between attention layers, [recurrent, attention, recurrent, attention].
# Gated DeltaNet with 2 key heads of 16 and 4 value heads of 8 (dk != dv, value heads sharing key heads,
# so a layout or head-mapping error shows), a 4-tap convolution; attention heads of 32 with half of
# them rotated (GroupQueryAttention's rotary needs rotary_dim / 2 % 8 == 0).
_DELTANET = dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
_QWEN_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
ARCH_CONFIGS.update({
    # Experts on layers 1-3, a dense MLP on layer 0 (mlp_only_layers).
    "qwen3_next": ("Qwen3NextConfig", {**_DELTANET, **_QWEN_EXPERTS, "decoder_sparse_step": 1, "mlp_only_layers": [0],
                                       "norm_topk_prob": True}),
    "qwen3_5_text": ("Qwen3_5TextConfig", _DELTANET),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**_DELTANET, **_QWEN_EXPERTS}),
    # The image-text checkpoint (Qwen3_5ForConditionalGeneration): the language model above under
    # model.language_model, beside a one-block vision tower. Exported, it is an image-text export (no processor here:
    # exporter/vision/tiny_checkpoint.py's qwen3_5_genai has one), not a text one (TEXT_HYBRID_ARCHITECTURES).
    "qwen3_5": ("Qwen3_5Config", {"text_config": _DELTANET, "vision_config": dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)}),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", {"text_config": {**_DELTANET, **_QWEN_EXPERTS}, "vision_config": dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)}),
    # LFM2: short convolutions (3 taps) on layers 0 and 2; its MLP width 128 adjusted as LFM2 does (-> 96).
    "lfm2": ("Lfm2Config", {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "conv_L_cache": 3, "block_multiple_of": 32,
                            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True}),
    # LFM2-MoE: LFM2's layers, a dense MLP on layer 0, then 8 experts of 32 (2 a token) routed by sigmoid
    # scores picked with a learned bias.
    "lfm2_moe": ("Lfm2MoeConfig", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2,
                                   "conv_L_cache": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "num_dense_layers": 1, "use_expert_bias": True,
                                   "norm_topk_prob": True, "routed_scaling_factor": 1.5}),
    # Granite 4.0-H: Mamba2 on layers 0 and 2 (4 heads of hidden / 4, 2 groups, d_state 16, 4 taps), NoPE attention,
    # granite's multipliers, 8 experts of 32 with a shared MLP of 48.
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4,
        "mamba_d_head": "auto", "mamba_expand": 1, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4,
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
        "position_embedding_type": "nope", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.03125, "logits_scaling": 0.5}),
    # Nemotron-H: one mixer a block, every kind once or twice (Mamba2, experts, NoPE attention, relu^2 MLP);
    # Mamba2 as above; 8 relu^2 experts of 32 in 2 groups (1 picked) at a latent width of 32, a shared expert of 48.
    "nemotron_h": ("NemotronHConfig", {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
        "moe_latent_size": 32, "layer_norm_epsilon": 1e-5}),
    # Falcon-H1: attention and Mamba2 side by side in both layers (Mamba2 as above, its output normed before
    # the gate), every muP multiplier away from 1 so a misplaced one shows; the head's 3.0 gives decisive logits
    # (at 1.5, 13 of 24 fp16 greedy steps had top-2 gaps under tests/test_hybrid.py's 0.25, none changed).
    "falcon_h1": ("FalconH1Config", {
        "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": "auto", "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_rms_norm": True, "mamba_norm_before_gate": True, "key_multiplier": 0.7,
        "attention_in_multiplier": 0.9, "attention_out_multiplier": 1.3, "ssm_in_multiplier": 1.1,
        "ssm_out_multiplier": 0.8, "ssm_multipliers": [1.2, 0.9, 1.1, 0.8, 1.3], "mlp_multipliers": [1.1, 0.9],
        "embedding_multiplier": 2.0, "lm_head_multiplier": 3.0}),
})
# Latent attention and grouped sigmoid routing (issue 47). Both: 8 experts of 32 in 4 groups (2 groups picked,
# 2 experts a token) by sigmoid scores with a learned selection bias, a shared expert of 32, routed_scaling_factor
# 1.5, the first layer dense. glm4_moe: GQA with biased q / k / v, per-head q / k norms, half the head rotated.
# deepseek_v3: multi-head latent attention, q through a rank-32 latent, keys and values through a rank-32 latent
# (kv_lora_rank) plus one shared rotary key of 16 (qk_rope_head_dim), no-rope query / key parts of 16, values of
# 24 (v_head_dim != qk head dim, so a mix-up shows), the interleaved rotary of its checkpoints.
_GROUPED_EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1)
ARCH_CONFIGS.update({
    "glm4_moe": ("Glm4MoeConfig", {**_GROUPED_EXPERTS, "num_hidden_layers": 3, "head_dim": 32, "attention_bias": True,
                                   "use_qk_norm": True, "partial_rotary_factor": 0.5,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}}),
    "deepseek_v3": ("DeepseekV3Config", {**_GROUPED_EXPERTS, "num_hidden_layers": 3, "num_key_value_heads": 4,
                                         "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                                         "qk_nope_head_dim": 16, "v_head_dim": 24, "rope_interleave": True,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # deepseek_v2: the same latent attention without a q latent (V2-Lite's), softmax routing limited to the best
    # group of 4 (group_limited_greedy, DeepSeek-V2's; with 2 groups kept, 2 experts a token would be the greedy pick
    # always), the picked scores unnormalized and scaled by 1.5.
    "deepseek_v2": ("DeepseekV2Config", {**_GROUPED_EXPERTS, "num_hidden_layers": 3, "num_key_value_heads": 4,
                                         "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                                         "qk_nope_head_dim": 16, "v_head_dim": 24, "topk_method": "group_limited_greedy", "topk_group": 1,
                                         "norm_topk_prob": False,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # glm4_moe_lite (GLM-4.7-Flash): deepseek_v3's attention and routing, the dense layer named in mlp_layer_types.
    "glm4_moe_lite": ("Glm4MoeLiteConfig", {**{k: v for k, v in _GROUPED_EXPERTS.items() if k != "first_k_dense_replace"},
                                            "num_hidden_layers": 3, "num_key_value_heads": 4,
                                            "mlp_layer_types": ["dense", "sparse", "sparse"], "q_lora_rank": 32,
                                            "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                            "v_head_dim": 24,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
})
# The 2025-26 families built by hand (issue 47).
# Dense: seed_oss's biased q / k / v; ernie4_5's interleaved rotary with every projection biased; olmo3's and exaone4's
# post-norm layers with a window of 8 on every other layer (exaone4's global layers without rotary), olmo3 with a
# rope per layer type.
ARCH_CONFIGS.update({
    "seed_oss": ("SeedOssConfig", {"attention_bias": True}),
    "ernie4_5": ("Ernie4_5Config", {"use_bias": True}),
    "olmo3": ("Olmo3Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}}),
    "exaone4": ("Exaone4Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    # ministral3: yarn from 8 positions, so the query scale steps up every 8 tokens over a prompt and 24 steps.
    "ministral3": ("Ministral3Config", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}),
    # hunyuan_v1_dense: q / k norms after the rotary, the NTK-alpha rope its checkpoints call dynamic.
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                      "alpha": 1000.0, "factor": 1.0}}),
    # cohere2: a window of 8 on every other layer (the others NoPE), its logit scale.
    "cohere2": ("Cohere2Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                  "logit_scale": 0.5}),
    # apertus: xIELU away from its init values (the checkpoint's scalars are what is read), llama3 rope.
    # ernie4_5_moe: 8 experts of 32 (2 a token) picked from softmax scores by a learned bias, a shared expert of
    # 2 x 32, on layers 1 and 2 (moe_layer_start_index); the interleaved rotary.
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"num_hidden_layers": 3, "moe_num_experts": 8, "moe_k": 2,
                                            "moe_intermediate_size": 32, "moe_num_shared_experts": 2,
                                            "moe_layer_start_index": 1}),
    # llama4_text: 4 layers, chunks of 8 on layers 0-2 (rotary, weightless q / k norms), layer 3 global NoPE with its
    # query temperature stepping every 4 positions; 8 experts of 32 (1 a token) with a shared MLP on layers 1 and 3,
    # dense MLPs of 128 on 0 and 2.
    "llama4_text": ("Llama4TextConfig", {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 1,
                                         "intermediate_size": 32, "intermediate_size_mlp": 128,
                                         "interleave_moe_layer_step": 2, "attention_chunk_size": 8, "floor_scale": 4,
                                         "attn_scale": 0.1, "use_qk_norm": True}),
    "apertus": ("ApertusConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "original_max_position_embeddings": 32, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0}}),
})
# Gemma 4 (text) with every switch of its text decoder on at once (tests/test_gemma4.py): 6 layers, [sliding, global] x 3
# with a window of 8; global heads of 32 (sliding: 16) whose values are their keys (attention_k_eq_v), in one KV head,
# rotated by the proportional rope (a quarter of their angles turn); the last 2 layers (4 sliding, 5 global) attending
# over layers 2 and 3's keys and values, with MLPs twice as wide (use_double_wide_mlp); per-layer inputs of 8 a layer;
# logits soft-capped at 10. make_tiny_checkpoint draws every layer_scalar off 1 and gives the per-layer inputs the vocab.
ARCH_CONFIGS["gemma4_text"] = ("Gemma4TextConfig", {
    "num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": 8,
    "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
    "final_logit_softcapping": 10.0, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}}})
# The image-text Gemma 4 checkpoint (Gemma4ForConditionalGeneration, as Google publishes it): the text decoder above
# under model.language_model, beside a one-layer vision tower (not read: the language model is exported alone).
ARCH_CONFIGS["gemma4"] = ("Gemma4Config", {"text_config": ARCH_CONFIGS["gemma4_text"][1], "vision_config": dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    patch_size=4, position_embedding_size=64, pooling_kernel_size=2)})
NEW_ARCHITECTURES = ("gemma4_text", "glm4_moe", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "ernie4_5_moe", "seed_oss", "ernie4_5", "olmo3", "exaone4", "ministral3", "hunyuan_v1_dense",
                     "cohere2", "apertus", "llama4_text")
NEW_MOE_ARCHITECTURES = ("glm4_moe", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "ernie4_5_moe", "llama4_text")
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "lfm2",
                        "lfm2_moe", "granitemoehybrid", "nemotron_h", "falcon_h1")
# The hybrids whose export is a text decoder (model.onnx on input_ids, what exporter.runtime.session.Decoder and
# genai's text types run): all but the image-text checkpoints, whose export is the image-text one (vision, embedding,
# the decoder on inputs_embeds: graph/language_model.py IMAGE_TEXT_HYBRIDS); their language models are qwen3_5_text
# and qwen3_5_moe_text.
TEXT_HYBRID_ARCHITECTURES = tuple(a for a in HYBRID_ARCHITECTURES if a not in ("qwen3_5", "qwen3_5_moe"))
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "phimoe")


def make_tiny_checkpoint(
    arch: str, out_dir: Path, *, dtype: str = "float32", tie_word_embeddings: bool = False,
    max_shard_size: str | None = None, seed: int = 0, init_std: float = 0.2, **overrides,
) -> Path:
    """Write config.json + safetensors of a random ``arch`` model to ``out_dir``; returns it."""
    import torch
    import transformers

    class_name, extra = ARCH_CONFIGS[arch]
    kwargs = {**BASE, **extra, "tie_word_embeddings": tie_word_embeddings, "initializer_range": init_std, **overrides}
    if arch in ("phi3", "granitemoehybrid"):
        kwargs.pop("head_dim", None)  # derived from hidden / heads
    if arch in ("gemma4_text", "gemma4"):  # a per-layer input row for every token id
        kwargs.setdefault("vocab_size_per_layer_input", kwargs["vocab_size"])
    if arch == "nemotron_h":  # its layer count is its block list's length, its norms' epsilon layer_norm_epsilon
        kwargs.pop("num_hidden_layers"), kwargs.pop("rms_norm_eps")
    if "text_config" in extra:  # an image-text checkpoint: the sizes are its language model's
        text = {k: v for k, v in kwargs.items() if k not in ("text_config", "vision_config")}
        kwargs = {"text_config": {**text, **extra["text_config"]}, "vision_config": extra["vision_config"],
                  "initializer_range": init_std,
                  "tie_word_embeddings": tie_word_embeddings}
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    if "text_config" in extra:
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        # Larger-than-default weights give decisive logits, so greedy parity is a real test.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # apertus's xIELU: off its init, per layer
                param.uniform_(-0.5, 0.5)
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # gemma4's experts (ones at init)
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # lfm2_moe's selection bias (zeros at init): large enough to pick
                buffer.normal_(0.0, 0.5)
            elif name.endswith("layer_scalar"):  # gemma4's (ones at init): what multiplies each layer's output
                buffer.uniform_(0.6, 1.4)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size) if max_shard_size else model.save_pretrained(out_dir)
    return out_dir


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def to_mxfp4(w):
    """[..., K] fp32 -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8, the values they hold):
    each 32 scaled by the power of two that brings its largest magnitude within 6, rounded to the
    nearest e2m1 value, two codes a byte with the low nibble first (OCP MX, as gpt-oss ships it)."""
    import numpy as np

    grid = np.array(_E2M1, np.float32)
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    peak = np.abs(blocks).max(axis=-1)
    exponent = np.where(peak > 0, np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)), -127).clip(-127, 127)
    scaled = blocks / np.power(2.0, exponent)[..., None]
    index = np.abs(np.abs(scaled)[..., None] - grid).argmin(axis=-1)
    codes = (index + 8 * (scaled < 0)).astype(np.uint8)
    values = np.where(scaled < 0, -1.0, 1.0) * grid[index] * np.power(2.0, exponent)[..., None]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).astype(np.uint8), values.reshape(w.shape).astype(np.float32)


def mxfp4_checkpoint(source: Path, out: Path, *, twin: Path | None = None):
    """A gpt-oss checkpoint as its real ones ship (experts as MXFP4 ``_blocks`` / ``_scales``,
    [experts, out, in], ``quantization_config`` mxfp4) made from a float one; ``twin``: the same model
    with those experts' values as plain float tensors (what transformers' dequantized model holds).
    Returns (out, twin)."""
    import json
    import shutil

    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    for d in (out, twin):
        if d is not None:
            shutil.copytree(source, d)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(file))  # torch: bf16 checkpoints too
        mxfp4, plain = {}, {}
        for name, value in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                wide = value.float().transpose(-1, -2).contiguous().numpy()  # [experts, out, in]
                packed, scales, values = to_mxfp4(wide)
                mxfp4[f"{name}_blocks"], mxfp4[f"{name}_scales"] = torch.from_numpy(packed), torch.from_numpy(scales)
                plain[name] = torch.from_numpy(np.ascontiguousarray(values)).transpose(-1, -2).contiguous().to(value.dtype)
            else:
                mxfp4[name] = plain[name] = value
        save_file(mxfp4, str(out / file.name), metadata={"format": "pt"})
        if twin is not None:
            save_file(plain, str(twin / file.name), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names the new tensors
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for name, f in data["weight_map"].items()
                              for n in ([f"{name}_blocks", f"{name}_scales"]
                                        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else [name])}
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, twin


def shards_in_subfolder(source: Path, out: Path, decoy: Path, folder: str = "sub") -> Path:
    """``source`` with its safetensors moved into ``out/<folder>/`` as ``model-0000i-of-0000n.safetensors``
    and named there by model.safetensors.index.json (a layout hub repositories ship), while ``decoy``'s
    safetensors (another model of the same shapes) lie at the top level under the same names: a reader
    that takes a shard's base name instead of the index's path reads the decoy's weights. (No top-level
    model.safetensors: transformers would load that before the index.) Returns ``out``."""
    import json
    import shutil

    from safetensors import safe_open

    source, out = Path(source), Path(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    (out / folder).mkdir()
    files, decoys = sorted(source.glob("*.safetensors")), sorted(Path(decoy).glob("*.safetensors"))
    weight_map = {}
    for i, (file, other) in enumerate(zip(files, decoys, strict=True), 1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        shutil.copyfile(file, out / folder / name)
        shutil.copyfile(other, out / name)
        with safe_open(str(file), framework="numpy") as handle:
            weight_map.update({tensor: f"{folder}/{name}" for tensor in handle.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


# A byte-level BPE needs its 256 byte symbols + 3 specials + merges: pass vocab_size=TINY_TOKENIZER_VOCAB
# to make_tiny_checkpoint so every token id has a row.
TINY_TOKENIZER_VOCAB = 300
_TINY_CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "export the model to onnx and run it fast on every device",
    "a tiny tokenizer for a tiny model that still speaks in bytes",
    "hello world, hello onnx runtime, hello generation",
)


def make_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_TOKENIZER_VOCAB, bos: bool = False) -> Path:
    """Write tokenizer.json + tokenizer_config.json of a small byte-level BPE (trained offline) to ``out_dir``.

    Special tokens match BASE: ``<pad>`` 0, ``<s>`` 1 (bos), ``</s>`` 2 (eos). Byte-level, like the
    llama-3 / qwen2 tokenizers, so any text encodes and onnxruntime-genai's tokenizer reads it.
    ``bos``: every encoded text starts with ``<s>`` (a post-processor template, as Llama's and
    Gemma's tokenizers add BOS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(list(_TINY_CORPUS) * 4, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                                 special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", default="llama", choices=sorted(ARCH_CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    make_tiny_checkpoint(args.arch, args.out_dir, dtype=args.dtype)
    print(f"wrote a random-weight {args.arch} checkpoint to {args.out_dir}")


if __name__ == "__main__":
    main()
