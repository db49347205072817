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

from exporter.components.graph import GraphBuilder, linear
from exporter.components.norm import rms_norm
from exporter.components.rotary import Rotary, apply_rotary
from exporter.config import ModelConfig


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


def _heads(b: GraphBuilder, x: ir.Value, num_heads: int, head_dim: int, norm: ir.Value | None, eps: float):
    """[batch, seq, heads*head_dim] -> [batch, heads, seq, head_dim], with the optional q/k norm."""
    x = b.op("Reshape", [x, b.ints(0, 0, num_heads, head_dim)])
    if norm is not None:
        x = rms_norm(b, x, norm, eps)
    return b.op("Transpose", [x], {"perm": [0, 2, 1, 3]})


def _merge_heads(b: GraphBuilder, y: ir.Value, cfg: ModelConfig) -> ir.Value:
    y = b.op("Transpose", [y], {"perm": [0, 2, 1, 3]})
    return b.op("Reshape", [y, b.ints(0, 0, cfg.q_size)])


def _split_qkv(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig):
    qkv = linear(b, x, w.qkv, w.qkv_bias)
    return b.op_multi("Split", [qkv, b.ints(cfg.q_size, cfg.kv_size, cfg.kv_size)], {"axis": -1}, num_outputs=3)


def _qkv_4d(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig, rotary: Rotary):
    q, k, v = _split_qkv(b, x, w, cfg)
    q = apply_rotary(b, _heads(b, q, cfg.num_heads, cfg.head_dim, w.q_norm, cfg.rms_norm_eps), rotary)
    k = apply_rotary(b, _heads(b, k, cfg.num_kv_heads, cfg.head_dim, w.k_norm, cfg.rms_norm_eps), rotary)
    v = _heads(b, v, cfg.num_kv_heads, cfg.head_dim, None, cfg.rms_norm_eps)
    return q, k, v


def attention_dynamic(b, x, w, cfg, step: StepInputs, past_key, past_value):
    q, k, v = _qkv_4d(b, x, w, cfg, step.rotary)
    y, present_key, present_value = b.op_multi(
        "Attention", [q, k, v, step.attn_mask, past_key, past_value], {"is_causal": 0}, num_outputs=3
    )
    return linear(b, _merge_heads(b, y, cfg), w.o, w.o_bias), present_key, present_value


def attention_static(b, x, w, cfg, step: StepInputs, key_cache, value_cache):
    q, k, v = _qkv_4d(b, x, w, cfg, step.rotary)
    updated_key = b.op("TensorScatter", [key_cache, k, step.write_indices], {"axis": 2})
    updated_value = b.op("TensorScatter", [value_cache, v, step.write_indices], {"axis": 2})
    y = b.op(
        "Attention", [q, updated_key, updated_value, None, None, None, step.nonpad_kv_seqlen], {"is_causal": 1}
    )
    return linear(b, _merge_heads(b, y, cfg), w.o, w.o_bias), updated_key, updated_value


def attention_gqa(b, x, w, cfg, step: StepInputs, past_key, past_value):
    if w.q_norm is None:
        query, key, value = linear(b, x, w.qkv, w.qkv_bias), None, None
    else:
        # q/k norm sits between projection and rotary, and rotary is inside the op: feed Q, K, V apart.
        q, k, value = _split_qkv(b, x, w, cfg)
        query = rms_norm(b, b.op("Reshape", [q, b.ints(0, 0, cfg.num_heads, cfg.head_dim)]), w.q_norm, cfg.rms_norm_eps)
        key = rms_norm(b, b.op("Reshape", [k, b.ints(0, 0, cfg.num_kv_heads, cfg.head_dim)]), w.k_norm, cfg.rms_norm_eps)
        query = b.op("Reshape", [query, b.ints(0, 0, cfg.q_size)])
        key = b.op("Reshape", [key, b.ints(0, 0, cfg.kv_size)])
    y, present_key, present_value = b.op_multi(
        "GroupQueryAttention",
        [query, key, value, past_key, past_value, step.seqlens_k, step.total_seq_len, step.rotary.cos, step.rotary.sin],
        {"num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, "do_rotary": 1, "rotary_interleaved": 0},
        domain="com.microsoft",
        num_outputs=3,
    )
    return linear(b, y, w.o, w.o_bias), present_key, present_value
