"""Self-attention in the three variants (docs/graph-contracts.md).

- attn_dynamic: opset-24 Attention with past_key/past_value -> present, an explicit boolean mask.
- attn_static: TensorScatter writes this step's K/V into fixed caches at ``write_indices``; Attention
  reads the whole cache with ``is_causal=1`` and ``nonpad_kv_seqlen`` = tokens cached *after* the
  scatter. No mask input, no control flow, so the decode step is CUDA-graph capturable.
- gqa: com.microsoft GroupQueryAttention on packed QKV, rotary inside the op.
- attn_dynamic for the compat target (graph/target.py): the same inputs and caches, the caches
  concatenated in the graph, K/V repeated to the query heads and com.microsoft MultiHeadAttention with
  the mask as an additive attention_bias (MatMul / Softmax where scores are soft-capped).

Sliding-window layers (mistral, gemma2/3): attn_dynamic narrows its explicit mask to the window;
attn_static gives Attention an in-graph window mask built from ``position_ids`` instead of
``is_causal`` + ``nonpad_kv_seqlen`` (the mask bounds the keys to those cached, so it needs no
count); gqa sets GroupQueryAttention's ``local_window_size``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.norm import rms_norm
from exporter.graph.components.rotary import Rotary, apply_rotary
from exporter.graph.config import ModelConfig
from exporter.request import Variant


@dataclasses.dataclass
class AttentionWeights:
    qkv: ir.Value  # packed [q + k + v, hidden] in checkpoint layout
    o: ir.Value
    qkv_bias: ir.Value | None = None
    o_bias: ir.Value | None = None
    q_norm: ir.Value | None = None  # RMSNorm weights on queries / keys (qwen3, gemma3: per head)
    k_norm: ir.Value | None = None
    qk_norm_per_head: bool = True  # False: over the whole projection (olmo2)
    sinks: ir.Value | None = None  # gpt-oss: a learned logit per head in every softmax's denominator (gqa only)
    # qwen3_next / qwen3_5: qkv packs [q | k | v | gate] (the gate's rows taken from q_proj, where they
    # alternate with the query's head by head), and the output is attn * sigmoid(gate) before o.
    output_gate: bool = False
    qkv_scale: ir.Value | None = None  # [q + k + v] per output channel, after the projection (falcon_h1's key_multiplier)
    # gemma4: the values are the keys as projected (qkv packs [q | k]: attention_k_eq_v); values through an RMSNorm per
    # head (its weight: ones).
    value_is_key: bool = False
    v_norm: ir.Value | None = None


@dataclasses.dataclass
class SharedKV:
    """A layer's keys and values as the later layers sharing them read them (gemma4's num_kv_shared_layers): its
    caches after this step (attn_dynamic's present, [batch, kv_heads, total, head_dim]; attn_static's updated caches)
    and, for GroupQueryAttention, which takes no finished cache but appends a step's keys to a past itself, that
    past and this step's keys and values as the op took them (not rotated)."""

    key: ir.Value
    value: ir.Value
    past_key: ir.Value | None = None
    past_value: ir.Value | None = None
    new_key: ir.Value | None = None
    new_value: ir.Value | None = None


@dataclasses.dataclass
class StepInputs:
    """Per-step values the layers read, built once by the task from the graph inputs (one copy per
    kind of layer: its rotary, its window)."""

    rotary: Rotary | None  # None: no rotary in this layer (smollm3's NoPE layers)
    attn_mask: ir.Value | None = None  # attn_dynamic: bool [batch, 1, seq, total]
    write_indices: ir.Value | None = None  # attn_static
    nonpad_kv_seqlen: ir.Value | None = None  # attn_static
    seqlens_k: ir.Value | None = None  # gqa: int32 [batch], total length - 1
    total_seq_len: ir.Value | None = None  # gqa: int32 scalar
    window: int | None = None  # sliding window of this layer (tokens, itself included)
    window_mask: ir.Value | None = None  # attn_static sliding layers: bool [batch, 1, seq, cache]
    token_mask: ir.Value | None = None  # hybrids' recurrent layers: [batch, seq, 1], 0 at padding (left-padded rows)
    gqa_positions: ir.Value | None = None  # gqa layers rotating outside the op: positions as it assigns them (built once)
    position_ids: ir.Value | None = None  # the attn variants' position_ids input (what scales a NoPE layer's queries)


def _head_norm(b: GraphBuilder, x: ir.Value, num_heads: int, head_dim: int, norm: ir.Value | None, eps: float,
               per_head: bool = True):
    """RMSNorm of [batch, seq, heads*head_dim], shape kept: per head (qwen3, gemma3's q_norm /
    k_norm) or over the whole projection (olmo2)."""
    if norm is None:
        return x
    if not per_head:
        return rms_norm(b, x, norm, eps)
    per_head = rms_norm(b, b.op("Reshape", [x, b.ints(0, 0, num_heads, head_dim)]), norm, eps)
    return b.op("Reshape", [per_head, b.ints(0, 0, num_heads * head_dim)])


def _projected(b: GraphBuilder, x: ir.Value, w: AttentionWeights) -> ir.Value:
    qkv = linear(b, x, w.qkv, w.qkv_bias)
    return b.op("Mul", [qkv, w.qkv_scale]) if w.qkv_scale is not None else qkv


def _split_qkv(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig):
    """q, k, v and the output gate (None without one) of one packed projection."""
    qkv = _projected(b, x, w)
    if w.value_is_key:
        q, k = b.op_multi("Split", [qkv, b.ints(cfg.q_size, cfg.kv_size)], {"axis": -1}, num_outputs=2)
        return q, k, k, None
    if w.output_gate:
        return b.op_multi("Split", [qkv, b.ints(cfg.q_size, cfg.kv_size, cfg.kv_size, cfg.q_size)], {"axis": -1},
                          num_outputs=4)
    return *b.op_multi("Split", [qkv, b.ints(cfg.q_size, cfg.kv_size, cfg.kv_size)], {"axis": -1}, num_outputs=3), None


def _output(b: GraphBuilder, y: ir.Value, w: AttentionWeights, gate: ir.Value | None) -> ir.Value:
    """o_proj of the attention output, gated by sigmoid(gate) where the model has an output gate."""
    if gate is not None:
        y = b.op("Mul", [y, b.op("Sigmoid", [gate])])
    return linear(b, y, w.o, w.o_bias)


def _qkv(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig, rotary: Rotary,
         positions: ir.Value | None = None):
    """Q, K, V as [batch, seq, heads*head_dim] (BSNH), rotated: no transposes anywhere.

    The Attention kernels work in BSNH natively (Flash needs it); a BNSH graph would pay a
    transpose per tensor per layer, which is most of a decode step's kernel count.
    """
    q, k, v, gate = _split_qkv(b, x, w, cfg)
    v = _value_norm(b, v, w, cfg)
    if not cfg.qk_norm_after_rotary:
        q, k = _qk_norms(b, q, k, w, cfg)
    q, k, v = (_clipped(b, t, cfg) for t in (q, k, v))
    if rotary is not None:
        q, k = apply_rotary(b, q, rotary, cfg.num_heads), apply_rotary(b, k, rotary, cfg.num_kv_heads)
    if cfg.qk_norm_after_rotary:
        q, k = _qk_norms(b, q, k, w, cfg)
    if cfg.position_query_scale is not None:
        q = position_scaled_query(b, q, cfg, rotary.position_ids)
    if rotary is None and cfg.temperature_tuning is not None:
        q = temperature_tuned_query(b, q, cfg, positions)
    return q, k, v, gate


def _qk_norms(b: GraphBuilder, q: ir.Value, k: ir.Value, w: AttentionWeights, cfg: ModelConfig):
    return (_head_norm(b, q, cfg.num_heads, cfg.head_dim, w.q_norm, cfg.rms_norm_eps, w.qk_norm_per_head),
            _head_norm(b, k, cfg.num_kv_heads, cfg.head_dim, w.k_norm, cfg.rms_norm_eps, w.qk_norm_per_head))


def _value_norm(b: GraphBuilder, v: ir.Value, w: AttentionWeights, cfg: ModelConfig) -> ir.Value:
    return _head_norm(b, v, cfg.num_kv_heads, cfg.head_dim, w.v_norm, cfg.rms_norm_eps)


def _query(b: GraphBuilder, x: ir.Value, w: AttentionWeights, cfg: ModelConfig, rotary: Rotary | None) -> ir.Value:
    """A KV-sharing layer's queries (its qkv holds q_proj alone): projected, normed per head, rotated unless the
    attention op rotates them."""
    q = _head_norm(b, linear(b, x, w.qkv, w.qkv_bias), cfg.num_heads, cfg.head_dim, w.q_norm, cfg.rms_norm_eps,
                   w.qk_norm_per_head)
    return apply_rotary(b, q, rotary, cfg.num_heads) if rotary is not None else q


def position_scaled_query(b: GraphBuilder, q: ir.Value, cfg: ModelConfig, positions: ir.Value) -> ir.Value:
    """ministral3's (Llama 4's) long-context query scale, 1 + beta * log(1 + floor(position / original_max)), per
    token; a scale commutes with the rotary, so it applies before or after it alike."""
    beta, original = cfg.position_query_scale
    return _query_scaled_by_position(b, q, positions, 0.0, float(original), float(beta))


def temperature_tuned_query(b: GraphBuilder, q: ir.Value, cfg: ModelConfig, positions: ir.Value) -> ir.Value:
    """llama4_text's NoPE layers: queries scaled by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)). At
    the token's own position (transformers counts cache slots, padding included: the same for a prompt alone,
    which is what a left-padded row must reproduce)."""
    attn_scale, floor_scale = cfg.temperature_tuning
    return _query_scaled_by_position(b, q, positions, 1.0, float(floor_scale), float(attn_scale))


def _query_scaled_by_position(b: GraphBuilder, q: ir.Value, positions: ir.Value, offset: float, period: float,
                              beta: float) -> ir.Value:
    """q [batch, seq, ...] times 1 + beta * log(1 + floor((position + offset) / period)) per token, the scale
    computed in fp32 from the int64 positions."""
    f32 = ir.DataType.FLOAT
    shifted = b.op("Cast", [positions], {"to": f32})
    if offset:
        shifted = b.op("Add", [shifted, b.scalar_f32(offset)])
    steps = b.op("Floor", [b.op("Div", [shifted, b.scalar_f32(period)])])
    scale = b.op("Add", [b.op("Mul", [b.op("Log", [b.op("Add", [steps, b.scalar_f32(1.0)])]), b.scalar_f32(beta)]),
                         b.scalar_f32(1.0)])
    if b.dtype != f32:
        scale = b.op("Cast", [scale], {"to": b.dtype})
    return b.op("Mul", [q, b.op("Unsqueeze", [scale, b.ints(-1)])])


def gqa_positions(b: GraphBuilder, x: ir.Value, step: StepInputs) -> ir.Value:
    """This step's positions [batch, seq] as GroupQueryAttention assigns them (it takes no position_ids), for what
    rotates or scales by position outside the op: the first prompt (total length = seq) from 0, a continuation
    after the row's cached tokens (seqlens_k + 1 - seq)."""
    if step.gqa_positions is not None:
        return step.gqa_positions
    i64 = ir.DataType.INT64
    seq = b.op("Gather", [b.op("Shape", [x]), b.scalar_i64(1)])
    total = b.op("Cast", [step.total_seq_len], {"to": i64})
    cached = b.op("Sub", [b.op("Add", [b.op("Cast", [step.seqlens_k], {"to": i64}), b.scalar_i64(1)]), seq])
    start = b.op("Where", [b.op("Equal", [total, seq]), b.scalar_i64(0), cached])
    ramp = b.op("Range", [b.scalar_i64(0), seq, b.scalar_i64(1)])
    step.gqa_positions = b.op("Add", [b.op("Unsqueeze", [start, b.ints(1)]), b.op("Unsqueeze", [ramp, b.ints(0)])])
    return step.gqa_positions


def _clipped(b: GraphBuilder, x: ir.Value, cfg: ModelConfig) -> ir.Value:
    """olmoe's clip_qkv: q, k, v clamped to +-clip_qkv after their norms (and before rotary)."""
    clip = getattr(cfg, "clip_qkv", None)
    if clip is None:
        return x
    if b.dtype == ir.DataType.BFLOAT16:  # onnxruntime's CUDA Clip has no bf16 kernel: clamp in fp32
        f32 = ir.DataType.FLOAT
        low, high = b.scalar_f32(-clip), b.scalar_f32(clip)
        return b.op("Cast", [b.op("Clip", [b.op("Cast", [x], {"to": f32}), low, high])], {"to": b.dtype})
    return b.op("Clip", [x, b.scalar(-clip), b.scalar(clip)])


def _scores_attrs(cfg) -> dict:
    """Score scale (default head_dim ** -0.5) and tanh soft-capping, as both attention ops name them."""
    attrs = {}
    if getattr(cfg, "attention_scale", None) is not None:
        attrs["scale"] = float(cfg.attention_scale)
    if getattr(cfg, "attention_softcap", None):
        attrs["softcap"] = float(cfg.attention_softcap)
    return attrs


def _heads_attrs(cfg: ModelConfig, **extra) -> dict:
    return {"q_num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, **_scores_attrs(cfg), **extra}


# The attention cores: everything after the projections and rotary. The exports and the runtime
# probe (validation/gates/runtime_probe.py) both build their attention with these, so the probe
# runs exactly the op pattern, attributes and layouts an export ships.


def dynamic_core(b, q, k, v, cfg, step: StepInputs, past_key, past_value):
    """Opset-24 Attention over past + new (BSNH q/k/v), the explicit boolean mask; -> (y, present k, v)."""
    return b.op_multi("Attention", [q, k, v, step.attn_mask, past_key, past_value], _heads_attrs(cfg, is_causal=0),
                      num_outputs=3)


def compat_core(b, q, k, v, cfg, step: StepInputs, past_key, past_value):
    """attn_dynamic in ops older onnxruntime has: present = past + this step's K/V (BNSH, the caches
    attn_dynamic always had), repeated to the query heads, then com.microsoft MultiHeadAttention with
    ``step.attn_mask`` as its additive attention_bias, expanded to [batch, heads, seq, total] (onnxruntime
    1.21's CPU kernel reads a head-broadcast bias wrong after the first row); -> (y, present k, v).

    MultiHeadAttention takes neither fewer K/V heads than query heads nor soft-capping: grouped-query
    models repeat K/V here (as transformers' repeat_kv does), and soft-capped scores (gemma2) go
    through MatMul / Softmax instead."""
    present_key = b.op("Concat", [past_key, _heads_first(b, k, cfg.num_kv_heads, cfg.head_dim)], {"axis": 2})
    present_value = b.op("Concat", [past_value, _heads_first(b, v, cfg.num_kv_heads, cfg.head_dim)], {"axis": 2})
    return compat_attend(b, q, present_key, present_value, cfg, step), present_key, present_value


def _heads_first(b, x, n: int, d: int):
    """[batch, seq, n*d] -> [batch, n, seq, d]."""
    return b.op("Transpose", [b.op("Reshape", [x, b.ints(0, 0, n, d)])], {"perm": [0, 2, 1, 3]})


def compat_attend(b, q, present_key, present_value, cfg, step: StepInputs):
    """compat_core's attention over whole present caches (BNSH): K/V repeated to the query heads, MultiHeadAttention
    (or MatMul / Softmax for soft-capped scores)."""
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    key, value = present_key, present_value
    if heads != kv_heads:  # [batch, kv, total, d] -> [batch, kv, group, total, d] -> [batch, heads, total, d]
        group = b.ints(1, 1, heads // kv_heads, 1, 1)
        key, value = (b.op("Reshape", [b.op("Expand", [b.op("Unsqueeze", [t, b.ints(2)]), group]),
                                       b.ints(0, heads, -1, d)]) for t in (key, value))
    scale = cfg.attention_scale if cfg.attention_scale is not None else d ** -0.5
    if not cfg.attention_softcap:
        return b.op("MultiHeadAttention", [q, key, value, None, None, step.attn_mask],
                    {"num_heads": heads, "scale": float(scale)}, domain="com.microsoft")
    scores = b.op("Mul", [b.op("MatMul", [_heads_first(b, q, heads, d), b.op("Transpose", [key], {"perm": [0, 1, 3, 2]})]),
                          b.scalar(scale)])
    f32, bias = ir.DataType.FLOAT, step.attn_mask
    if b.dtype != f32:  # soft-cap and softmax in fp32, as transformers' eager attention does
        scores, bias = (b.op("Cast", [t], {"to": f32}) for t in (scores, bias))
    cap = cfg.attention_softcap
    cap = b.scalar_f32(cap)
    scores = b.op("Add", [b.op("Mul", [b.op("Tanh", [b.op("Div", [scores, cap])]), cap]), bias])
    probs = b.op("Softmax", [scores], {"axis": -1})
    if b.dtype != f32:
        probs = b.op("Cast", [probs], {"to": b.dtype})
    y = b.op("Transpose", [b.op("MatMul", [probs, value])], {"perm": [0, 2, 1, 3]})
    return b.op("Reshape", [y, b.ints(0, 0, heads * d)])


def static_core(b, q, k, v, cfg, step: StepInputs, key_cache, value_cache):
    """TensorScatter this step's rows into [batch, max_seq_len, kv_heads*head_dim] caches at
    write_indices, then Attention over the whole cache with is_causal=1 and nonpad_kv_seqlen (the
    count after the scatter), no mask; -> (y, updated k, updated v)."""
    updated_key = b.op("TensorScatter", [key_cache, k, step.write_indices], {"axis": 1})
    updated_value = b.op("TensorScatter", [value_cache, v, step.write_indices], {"axis": 1})
    return static_attend(b, q, updated_key, updated_value, cfg, step), updated_key, updated_value


def static_attend(b, q, key_cache, value_cache, cfg, step: StepInputs) -> ir.Value:
    """Attention over whole static caches already holding this step's rows."""
    if step.window_mask is not None:  # a sliding layer: the window mask says which slots each query sees
        return b.op("Attention", [q, key_cache, value_cache, step.window_mask], _heads_attrs(cfg, is_causal=0))
    return b.op("Attention", [q, key_cache, value_cache, None, None, None, step.nonpad_kv_seqlen],
                _heads_attrs(cfg, is_causal=1))


def gqa_core(b, query, key, value, cfg, step: StepInputs, past_key, past_value, sinks=None):
    """com.microsoft GroupQueryAttention, rotary inside the op (packed QKV when key is None);
    ``sinks``: its head_sink input (gpt-oss)."""
    attrs = {"num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, **_scores_attrs(cfg)}
    inputs = [query, key, value, past_key, past_value, step.seqlens_k, step.total_seq_len]
    if step.rotary is not None:
        attrs.update(do_rotary=1, rotary_interleaved=int(step.rotary.interleaved))
        inputs += [step.rotary.cos, step.rotary.sin]
    if sinks is not None:
        inputs += [None] * (11 - len(inputs)) + [sinks]
    if step.window:
        attrs["local_window_size"] = int(step.window)
    return b.op_multi("GroupQueryAttention", inputs, attrs, domain="com.microsoft", num_outputs=3)


def attention_dynamic(b, x, w, cfg, step: StepInputs, past_key, past_value):
    q, k, v, gate = _qkv(b, x, w, cfg, step.rotary, step.position_ids)
    y, present_key, present_value = dynamic_core(b, q, k, v, cfg, step, past_key, past_value)
    return _output(b, y, w, gate), present_key, present_value


def attention_compat(b, x, w, cfg, step: StepInputs, past_key, past_value):
    q, k, v, gate = _qkv(b, x, w, cfg, step.rotary, step.position_ids)
    y, present_key, present_value = compat_core(b, q, k, v, cfg, step, past_key, past_value)
    return _output(b, y, w, gate), present_key, present_value


def attention_static(b, x, w, cfg, step: StepInputs, key_cache, value_cache):
    q, k, v, gate = _qkv(b, x, w, cfg, step.rotary, step.position_ids)
    y, updated_key, updated_value = static_core(b, q, k, v, cfg, step, key_cache, value_cache)
    return _output(b, y, w, gate), updated_key, updated_value


def attention_gqa(b, x, w, cfg, step: StepInputs, past_key, past_value):
    query, key, value, gate, step = _gqa_inputs(b, x, w, cfg, step)
    y, present_key, present_value = gqa_core(b, query, key, value, cfg, step, past_key, past_value, w.sinks)
    return _output(b, y, w, gate), present_key, present_value


def _gqa_inputs(b, x, w, cfg, step: StepInputs):
    """GroupQueryAttention's query, key and value (packed QKV with key and value None), the output gate, and the step
    inputs for the op (without its rotary where the heads are rotated here)."""
    gate, nope = None, step.rotary is None
    per_token = step.rotary is not None and step.rotary.per_token  # M-RoPE: rotated here, never by the op
    if (w.q_norm is None and not w.output_gate and cfg.position_query_scale is None and not per_token
            and (not nope or cfg.temperature_tuning is None) and w.v_norm is None and not w.value_is_key):
        query, key, value = _clipped(b, _projected(b, x, w), cfg), None, None
    else:
        # q/k norm sits between projection and rotary, and rotary is inside the op: feed Q, K, V apart.
        q, k, value, gate = _split_qkv(b, x, w, cfg)
        value = _value_norm(b, value, w, cfg)
        if per_token and not cfg.qk_norm_after_rotary:
            # the op's rotary indexes its tables by 1-D positions of its own: rotate the normed heads by the
            # per-token cos / sin of the position_ids input here, and the op rotates nothing.
            q, k = _qk_norms(b, q, k, w, cfg)
            q, k = apply_rotary(b, q, step.rotary, cfg.num_heads), apply_rotary(b, k, step.rotary, cfg.num_kv_heads)
            w = dataclasses.replace(w, q_norm=None, k_norm=None)  # normed already
            step = dataclasses.replace(step, rotary=None)
        if cfg.qk_norm_after_rotary and step.rotary is not None:
            # hunyuan normalizes rotated heads: rotate here, at the positions the op would use, not in the op.
            rotary = step.rotary if per_token else dataclasses.replace(step.rotary, position_ids=gqa_positions(b, x, step))
            q, k = apply_rotary(b, q, rotary, cfg.num_heads), apply_rotary(b, k, rotary, cfg.num_kv_heads)
            step = dataclasses.replace(step, rotary=None)
        query, key = _qk_norms(b, q, k, w, cfg)
        query, key, value = (_clipped(b, t, cfg) for t in (query, key, value))
        if cfg.position_query_scale is not None:
            query = position_scaled_query(b, query, cfg, gqa_positions(b, x, step))
        if nope and cfg.temperature_tuning is not None:
            query = temperature_tuned_query(b, query, cfg, gqa_positions(b, x, step))
    return query, key, value, gate, step


def attention_sharing_kv(b, x, w, cfg, variant: Variant, step: StepInputs, cache: tuple, shared: SharedKV | None
                         ) -> tuple[ir.Value, SharedKV]:
    """Attention in a model whose later layers attend over earlier layers' keys and values (gemma4): with ``shared``
    None the layer projects its own (``cache``: its past) and returns them as the layers sharing them read them;
    else it projects queries only and attends over ``shared``, with no cache of its own."""
    if shared is None and variant is Variant.GQA:
        query, key, value, gate, op_step = _gqa_inputs(b, x, w, cfg, step)
        y, present_key, present_value = gqa_core(b, query, key, value, cfg, op_step, *cache, w.sinks)
        return _output(b, y, w, gate), SharedKV(present_key, present_value, *cache, key, value)
    if shared is None:
        attend = (attention_compat if b.target.contrib_ops else attention_static if variant is Variant.ATTN_STATIC
                  else attention_dynamic)
        out, key, value = attend(b, x, w, cfg, step, *cache)
        return out, SharedKV(key, value)
    if b.target.contrib_ops:  # attn_dynamic for older onnxruntime: MultiHeadAttention over the shared present
        y = compat_attend(b, _query(b, x, w, cfg, step.rotary), shared.key, shared.value, cfg, step)
    elif variant is Variant.GQA:  # the op appends the shared step's keys to the shared past again, and rotates both
        y, _, _ = gqa_core(b, _query(b, x, w, cfg, None), shared.new_key, shared.new_value, cfg, step,
                           shared.past_key, shared.past_value)
    elif variant is Variant.ATTN_STATIC:
        y = static_attend(b, _query(b, x, w, cfg, step.rotary), shared.key, shared.value, cfg, step)
    else:  # Attention takes a present cache as key and value with the query in the same 4-D layout
        heads, d = cfg.num_heads, cfg.head_dim
        q = b.op("Transpose", [b.op("Reshape", [_query(b, x, w, cfg, step.rotary), b.ints(0, 0, heads, d)])],
                 {"perm": [0, 2, 1, 3]})
        y = b.op("Attention", [q, shared.key, shared.value, step.attn_mask], {**_scores_attrs(cfg), "is_causal": 0})
        y = b.op("Reshape", [b.op("Transpose", [y], {"perm": [0, 2, 1, 3]}), b.ints(0, 0, heads * d)])
    return _output(b, y, w, None), shared
