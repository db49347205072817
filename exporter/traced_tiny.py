"""Small random-weight checkpoints of any causal LM transformers knows, for the traced fallback.

``exporter.tiny_checkpoint`` writes hand-tuned checkpoints of the architectures exportfarm builds by
hand; the traced fallback (exporter/graph/traced.py) takes every other model type, so its tests and
benchmarks/traced_fallback.py need checkpoints of types nobody tuned a config for. This module makes
one from the config class alone: its defaults, with every size it names brought down to a few MB
(whatever the class calls them: ``hidden_size``, ``n_embd``, ``d_model`` ...), and weights larger
than transformers' initialization so greedy decoding is decisive and parity is a real test.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

# Each size, under the names config classes give it, and its tiny value. A class takes the first
# name of each group that its constructor names; sizes it has no name for keep their defaults.
SIZES = (
    (("vocab_size",), 256),
    (("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim"), 64),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    (("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"), 2),
    (("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "inner_hidden_size", "d_ff",
      "decoder_ffn_dim"), 128),
    (("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"), 256),
    (("head_dim",), 16),
    (("moe_intermediate_size", "expert_intermediate_size"), 32),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), 2),
    (("n_group", "num_expert_group"), 1),  # grouped routing: one group of the few experts above
    (("topk_group",), 1),
    # multi-head latent attention's ranks and head parts
    (("q_lora_rank",), 32), (("kv_lora_rank",), 32), (("qk_rope_head_dim",), 16), (("qk_nope_head_dim",), 16),
    (("v_head_dim",), 16),
)
# Types whose defaults the sizes above do not bring to a consistent model: the few keys they need.
OVERRIDES: dict[str, dict] = {
    "falcon": {"new_decoder_architecture": False, "multi_query": True},  # falcon-7b's layout: one KV head
    "persimmon": {"partial_rotary_factor": 0.5},
    "phi": {"partial_rotary_factor": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gpt_neox": {"rotary_pct": 0.25, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25}},
}
SEED = 0


def tiny_config(model_type: str, **overrides):
    """``model_type``'s config class with tiny sizes (``SIZES``, ``OVERRIDES``, then ``overrides``)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    accepted = set(inspect.signature(config_class.__init__).parameters)
    if dataclasses.is_dataclass(config_class):
        accepted |= {f.name for f in dataclasses.fields(config_class)}
    kwargs = {}
    for names, value in SIZES:
        name = next((n for n in names if n in accepted), None)
        if name is not None:
            kwargs[name] = value
    # is_decoder: an encoder's causal-LM head (BertLMHeadModel) decodes through a cache only when its config says so
    kwargs.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, is_decoder=True)
    if "kv_lora_rank" in kwargs:  # latent attention expands its latent to every query head: no grouping
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_key_value_heads", "num_kv_heads")}
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    return config_class(**kwargs)


def make_traced_checkpoint(model_type: str, out_dir: Path, *, dtype: str = "float32", init_std: float = 0.2,
                           **overrides) -> Path:
    """Write config.json + safetensors of a random tiny ``model_type`` causal LM to ``out_dir``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    if hasattr(config, "initializer_range"):
        config.initializer_range = init_std
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        # Larger-than-default weights give decisive logits, so greedy parity is a real test.
        for name, param in model.named_parameters():
            owner = name.split(".")[:-1]
            if any("norm" in part or part.startswith(("ln", "layer_norm")) for part in owner):
                param.uniform_(0.8, 1.2) if name.endswith("weight") else param.normal_(0.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif param.dim() >= 2:
                param.normal_(0.0, init_std)
        # The model must run on its own before an exporter is blamed for it: a size these defaults got
        # inconsistent fails here, as the checkpoint's fault.
        model.eval()(input_ids=torch.arange(3, 9).reshape(1, 6) % config.get_text_config().vocab_size)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
