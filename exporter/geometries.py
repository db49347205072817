"""config.json of real production models (their geometry, no weights), optionally cut to fewer layers.

Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-14B, Qwen2.5-32B, Llama-3.3-70B and the mixtures of experts Qwen3-30B-A3B,
gpt-oss-20b, Mixtral-8x7B and Phi-3.5-MoE, as their published config.json give them; the hybrids Qwen3-Next-80B-A3B
(transformers' Qwen3NextConfig defaults, which are that checkpoint's), Nemotron-3-Nano-30B-A3B (its published block
pattern and sizes), Qwen3.5-0.8B's language model and Granite-4.0-H-Small (sizes published, attention positions assumed);
DeepSeek-V3 and GLM-4.5-Air (transformers' config defaults, which are theirs).

The resource estimate is tested on them and ``benchmarks/scale.py`` builds depth-truncated
random-weight checkpoints from them: the real hidden size, MLP width, heads and vocabulary, with
1, 2 or 4 decoder layers, so each stage's per-layer growth can be measured and extrapolated.
"""

from __future__ import annotations

import json
from pathlib import Path

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

GEOMETRIES: dict[str, dict] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "qwen2.5-14b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 48, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "qwen2.5-32b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
        "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 64, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "llama-3.3-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
    # Mixtures of experts: 128 experts of 768 (8 a token) on 48 layers; 8 of 14336 (2 a token).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    # gpt-oss-20b without its MXFP4 quantization_config (random bf16 experts): 32 experts of 2880, 4 a token.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 4096},
        "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
    },
    # Phi-3.5-MoE-instruct: 16 experts of 6400 (2 a token, phimoe's sparsemixer) on 32 layers, biased
    # LayerNorms, attention and LM head; longrope with its published mscales (the 64 short / long factors
    # here are stand-ins of the right shape: they change the rotary tables' values, not the work).
    "phi-3.5-moe": {
        "architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe", "vocab_size": 32064, "hidden_size": 4096,
        "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 16, "num_experts_per_tok": 2, "router_jitter_noise": 0.01, "input_jitter_noise": 0.01,
        "attention_bias": True, "lm_head_bias": True, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 131072,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                            "short_factor": [round(1.0 + 0.02 * i, 4) for i in range(64)],
                            "long_factor": [round(1.0 + 0.5 * i, 4) for i in range(64)],
                            "short_mscale": 1.243163121016122, "long_mscale": 1.243163121016122},
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 32000,
        "torch_dtype": "bfloat16",
    },
    # Hybrids. Qwen3-Next-80B-A3B: 48 layers, gated DeltaNet on 3 of every 4 (16 key heads, 32 value heads of
    # 128), 512 experts of 512 (10 a token) with a shared expert of 512 on every layer.
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    # Nemotron-3-Nano-30B-A3B: 52 blocks (23 Mamba2 of 64 heads x 64, d_state 128, 8 groups; 23 of 128 relu^2
    # experts of 1856, 6 a token, a shared expert of 3712; 6 attention blocks of 32 heads, 2 KV heads).
    "nemotron-3-nano-30b-a3b": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
        "n_groups": 8, "conv_kernel": 4, "use_conv_bias": True, "intermediate_size": 1856, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # Granite-4.0-H-Small (32B, 9B active): 40 layers, Mamba2 (128 heads of 64, d_state 128, one group) on 36 and
    # attention (32 heads, 8 KV, NoPE) on 4, every layer with 72 experts of 768 (10 a token) and a shared expert of
    # 1536. The sizes are its published config.json's; where the four attention layers sit (5, 15, 25, 35) is
    # taken from the one-in-ten pattern of the Granite 4.0 H family, not read off the file.
    "granite-4.0-h-small": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 100352,
        "hidden_size": 4096, "intermediate_size": 768, "shared_intermediate_size": 1536, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 72, "num_experts_per_tok": 10,
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)], "position_embedding_type": "nope",
        "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "logits_scaling": 8.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "hidden_act": "silu", "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256,
        "torch_dtype": "bfloat16",
    },
    # Qwen3.5-0.8B's language model (its text_config): 24 layers, gated DeltaNet on 3 of every 4 (16 key and 16
    # value heads of 128), gated attention (8 heads, 2 KV heads of 256, a quarter rotary) on the fourth.
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024,
        "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "attn_output_gate": True, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
        "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 248044, "torch_dtype": "bfloat16",
    },
    # DeepSeek-V3 (also R1; Kimi-K2 is this with 384 experts): transformers' DeepseekV3Config defaults, which are its
    # published sizes. 61 layers, the first 3 dense; multi-head latent attention (128 heads, q latent 1536, kv latent
    # 512, rotary key 64, no-rope 128, values 128); 256 experts of 2048 (8 a token in 4 of 8 groups), a shared one.
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_interleave": True, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    # DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite's config.json): 27 layers, the first dense; latent attention without
    # a query latent (16 heads, kv latent 512, rotary key 64, no-rope 128, values 128); 64 experts of 1408 (6 a token,
    # softmax, greedy), two shared: its MoE layers are small enough for a CPU comparison with a layer of experts in it.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "norm_topk_prob": False, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        "hidden_act": "silu", "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
    },
    # GLM-4.5-Air: transformers' Glm4MoeConfig defaults, which are its published sizes. 46 layers, the first dense;
    # 96 heads and 8 KV heads of 128, half of each rotated, biased q / k / v; 128 experts of 1408 (8 a token), a shared one.
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 128,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        "hidden_act": "silu", "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}


def geometry_config(name: str, layers: int | None = None) -> dict:
    """``name``'s config.json as a dict, with ``layers`` decoder layers if given."""
    if name not in GEOMETRIES:
        raise KeyError(f"unknown geometry {name!r}: known are {', '.join(GEOMETRIES)}")
    config = dict(GEOMETRIES[name])
    if layers is not None and "hybrid_override_pattern" in config:  # nemotron_h: one letter a block
        config["hybrid_override_pattern"] = config["hybrid_override_pattern"][:layers]
    elif layers is not None:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
    return config


def write_geometry_config(name: str, out_dir: Path, layers: int | None = None) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(geometry_config(name, layers), indent=2) + "\n")
    return out_dir
