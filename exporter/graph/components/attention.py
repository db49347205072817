"""Self-attention in the three variants (docs/graph-contracts.md).

- attn_dynamic: opset-24 Attention with past_key/past_value -> present, an explicit boolean mask.
- attn_static: TensorScatter writes this step's K/V into fixed caches at ``write_indices``; Attention
  reads the whole cache with ``is_causal=1`` and ``nonpad_kv_seqlen`` = tokens cached *after* the
  scatter. No mask input, no control flow, so the decode step is CUDA-graph capturable.
- gqa: com.microsoft GroupQueryAttention on packed QKV, rotary inside the op.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.norm import rms_norm
from exporter.graph.components.rotary import Rotary, apply_rotary
from exporter.graph.config import ModelConfig


@dataclasses.dataclass
class AttentionWeights:
    qkv: ir.Value  # packed [q + k + v, hidden] in checkpoint layout
    o: ir.Value
    qkv_bias: ir.Value | None = None
    o_bias: ir.Value | None = None
    q_norm: ir.Value | None = None  # per-head RMSNorm weights (qwen3)
    k_norm: ir.Value | None = None


@dataclasses.dataclass
class StepInputs:
    """Per-step values shared by every layer, built once by the task from the graph inputs."""

    rotary: Rotary
    attn_mask: ir.Value | None = None  # attn_dynamic: bool [batch, 1, seq, total]
    write_indices: ir.Value | None = None  # attn_static
    nonpad_kv_seqlen: ir.Value | None = None  # attn_static
    seqlens_k: ir.Value | None = None  # gqa: int32 [batch], total length - 1
    total_seq_len: ir.Value | None = None  # gqa: int32 scalar


def _head_norm(b: GraphBuilder, x: ir.Value, num_heads: int, head_dim: int, norm: ir.Value | None, eps: float):
    """Per-head RMSNorm (qwen3's q_norm / k_norm) on [batch, seq, heads*head_dim], shape kept."""
    if norm is None:
        return x
    per_head = rms_norm(b, b.op("Reshape", [x, b.ints(0, 0, num_heads, head_dim)]), norm, eps)
    return b.op("Reshape", [per_head, b.ints(0, 0, num_heads * head_dim)])


def _split_qkv(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig):
    qkv = linear(b, x, w.qkv, w.qkv_bias)
    return b.op_multi("Split", [qkv, b.ints(cfg.q_size, cfg.kv_size, cfg.kv_size)], {"axis": -1}, num_outputs=3)


def _qkv(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig, rotary: Rotary):
    """Q, K, V as [batch, seq, heads*head_dim] (BSNH), rotated: no transposes anywhere.

    The Attention kernels work in BSNH natively (Flash needs it); a BNSH graph would pay a
    transpose per tensor per layer, which is most of a decode step's kernel count.
    """
    q, k, v = _split_qkv(b, x, w, cfg)
    q = apply_rotary(b, _head_norm(b, q, cfg.num_heads, cfg.head_dim, w.q_norm, cfg.rms_norm_eps), rotary, cfg.num_heads)
    k = apply_rotary(b, _head_norm(b, k, cfg.num_kv_heads, cfg.head_dim, w.k_norm, cfg.rms_norm_eps), rotary, cfg.num_kv_heads)
    return q, k, v


def _heads_attrs(cfg: ModelConfig, **extra) -> dict:
    return {"q_num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, **extra}


# The attention cores: everything after the projections and rotary. The exports and the runtime
# probe (validation/gates/runtime_probe.py) both build their attention with these, so the probe
# runs exactly the op pattern, attributes and layouts an export ships.


def dynamic_core(b, q, k, v, cfg, step: StepInputs, past_key, past_value):
    """Opset-24 Attention over past + new (BSNH q/k/v), the explicit boolean mask; -> (y, present k, v)."""
    return b.op_multi("Attention", [q, k, v, step.attn_mask, past_key, past_value], _heads_attrs(cfg, is_causal=0),
                      num_outputs=3)


def static_core(b, q, k, v, cfg, step: StepInputs, key_cache, value_cache):
    """TensorScatter this step's rows into [batch, max_seq_len, kv_heads*head_dim] caches at
    write_indices, then Attention over the whole cache with is_causal=1 and nonpad_kv_seqlen (the
    count after the scatter), no mask; -> (y, updated k, updated v)."""
    updated_key = b.op("TensorScatter", [key_cache, k, step.write_indices], {"axis": 1})
    updated_value = b.op("TensorScatter", [value_cache, v, step.write_indices], {"axis": 1})
    y = b.op("Attention", [q, updated_key, updated_value, None, None, None, step.nonpad_kv_seqlen],
             _heads_attrs(cfg, is_causal=1))
    return y, updated_key, updated_value


def gqa_core(b, query, key, value, cfg, step: StepInputs, past_key, past_value):
    """com.microsoft GroupQueryAttention, rotary inside the op (packed QKV when key is None)."""
    return b.op_multi(
        "GroupQueryAttention",
        [query, key, value, past_key, past_value, step.seqlens_k, step.total_seq_len, step.rotary.cos, step.rotary.sin],
        {"num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, "do_rotary": 1, "rotary_interleaved": 0},
        domain="com.microsoft", num_outputs=3,
    )


def attention_dynamic(b, x, w, cfg, step: StepInputs, past_key, past_value):
    q, k, v = _qkv(b, x, w, cfg, step.rotary)
    y, present_key, present_value = dynamic_core(b, q, k, v, cfg, step, past_key, past_value)
    return linear(b, y, w.o, w.o_bias), present_key, present_value


def attention_static(b, x, w, cfg, step: StepInputs, key_cache, value_cache):
    q, k, v = _qkv(b, x, w, cfg, step.rotary)
    y, updated_key, updated_value = static_core(b, q, k, v, cfg, step, key_cache, value_cache)
    return linear(b, y, w.o, w.o_bias), updated_key, updated_value


def attention_gqa(b, x, w, cfg, step: StepInputs, past_key, past_value):
    if w.q_norm is None:
        query, key, value = linear(b, x, w.qkv, w.qkv_bias), None, None
    else:
        # q/k norm sits between projection and rotary, and rotary is inside the op: feed Q, K, V apart.
        q, k, value = _split_qkv(b, x, w, cfg)
        query = _head_norm(b, q, cfg.num_heads, cfg.head_dim, w.q_norm, cfg.rms_norm_eps)
        key = _head_norm(b, k, cfg.num_kv_heads, cfg.head_dim, w.k_norm, cfg.rms_norm_eps)
    y, present_key, present_value = gqa_core(b, query, key, value, cfg, step, past_key, past_value)
    return linear(b, y, w.o, w.o_bias), present_key, present_value
