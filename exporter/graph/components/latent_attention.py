"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2: ``ModelConfig.latent``), with the latent absorbed.

transformers computes, per head h, keys [k_nope_h | k_rot] and values v_h expanded from one shared latent c
(kv_b_proj: k_nope_h = W_UK_h c, v_h = W_UV_h c) beside one shared rotary key k_rot, and caches c and k_rot.
The export keeps that cache and never expands it. Absorbed into the query and the output:

    q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c          softmax(...) @ (W_UV_h c) = W_UV_h (softmax(...) @ c)

so every head attends over the same single KV head [c | k_rot] (kv_rank + rope_dim wide) with the query
[W_UK_h^T q_nope_h | q_rot_h], the op's value is that head too, and each head's output latent (its first kv_rank
columns) goes through W_UV_h before o_proj. What that buys, and why it was chosen over expanding the heads:

- the cache is the latent, ``kv_rank + rope_dim`` values a token a layer (576 for DeepSeek-V3) where expanded
  heads hold ``heads x (nope + rope + value)`` (128 x 320 = 40960): 71x less to store and to read every step;
  the runtime's cache contract is unchanged (a KV head of 576: ``num_kv_heads`` 1, ``head_dim`` 576), the value
  cache holding the same rows as the key cache (the op's value is its key; a contract with one cache per latent
  layer would halve it again);
- the same three attention ops run it (opset-24 Attention, GroupQueryAttention) as one grouped-query head;
- the cost: two per-head batched MatMuls a layer (W_UK_h^T, W_UV_h: [heads, nope, kv_rank], [heads, kv_rank,
  value], from kv_b_proj's rows), which stay in float in a quantized export (MatMulNBits takes 2-D weights).

The rotary part: DeepSeek's checkpoints pair adjacent dims (``rope_interleave``); transformers rotates the pairs
and writes them de-interleaved, the RotaryEmbedding op's interleaved mode writes them back in place. Queries and
keys get the same order either way, so their dot products (all attention reads) are the same.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from exporter.graph.components.attention import StepInputs, dynamic_core, gqa_core, gqa_positions, static_core
from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.norm import rms_norm
from exporter.graph.components.rotary import apply_rotary
from exporter.graph.config import ModelConfig
from exporter.errors import ExportError
from exporter.request import Variant

# onnxruntime's CUDA GroupQueryAttention kernels take heads up to this wide (onnxruntime-gpu 1.31.1, measured).
GQA_CUDA_MAX_HEAD = 512


@dataclasses.dataclass
class LatentWeights:
    down: ir.Value  # [q_rank + kv_rank + rope, hidden]: q_a_proj and kv_a_proj_with_mqa packed (or kv_a alone)
    kv_norm: ir.Value  # kv_a_layernorm [kv_rank]
    absorb_k: ir.Value  # [heads, nope, kv_rank]: kv_b_proj's key rows per head
    expand_v: ir.Value  # [heads, value, kv_rank]: kv_b_proj's value rows per head
    o: ir.Value
    q_up: ir.Value  # q_b_proj [heads * (nope + rope), q_rank], or q_proj [.., hidden] without a q latent
    q_norm: ir.Value | None = None  # q_a_layernorm [q_rank]
    down_bias: ir.Value | None = None
    o_bias: ir.Value | None = None


def _per_head(b: GraphBuilder, x: ir.Value, weights: ir.Value) -> ir.Value:
    """[batch, seq, heads, a] @ [heads, a, c] per head -> [batch, seq, heads, c] (one batched MatMul over heads)."""
    heads_first = b.op("Transpose", [x], {"perm": [2, 0, 1, 3]})  # [heads, batch, seq, a]
    y = b.op("MatMul", [heads_first, b.op("Unsqueeze", [weights, b.ints(1)])])  # weights as [heads, 1, a, c]
    return b.op("Transpose", [y], {"perm": [1, 2, 0, 3]})


def latent_attention(b: GraphBuilder, x: ir.Value, w: LatentWeights, cfg: ModelConfig, variant: Variant,
                     step: StepInputs, past_key: ir.Value, past_value: ir.Value):
    """x [batch, seq, hidden] -> (o_proj output, present / updated key cache, value cache)."""
    lat, heads, eps = cfg.latent, cfg.num_heads, cfg.rms_norm_eps
    if variant is Variant.GQA and b.ep == "cuda" and cfg.head_dim > GQA_CUDA_MAX_HEAD:
        raise ExportError(f"{cfg.architecture}'s latent head ({lat.kv_rank} + {lat.rope_dim} = {cfg.head_dim}) is wider than "
                          f"onnxruntime's CUDA GroupQueryAttention takes ({GQA_CUDA_MAX_HEAD}; measured on onnxruntime-gpu "
                          "1.31.1: 'Head size (576) exceeds maximum supported MAX_HEAD_SIZE'): use the attn_dynamic or "
                          "attn_static variant for cuda")
    down = linear(b, x, w.down, w.down_bias)
    if lat.q_rank:
        q_lat, c, k_rot = b.op_multi("Split", [down, b.ints(lat.q_rank, lat.kv_rank, lat.rope_dim)], {"axis": -1},
                                     num_outputs=3)
        q = linear(b, rms_norm(b, q_lat, w.q_norm, eps), w.q_up)
    else:
        c, k_rot = b.op_multi("Split", [down, b.ints(lat.kv_rank, lat.rope_dim)], {"axis": -1}, num_outputs=2)
        q = linear(b, x, w.q_up)
    c = rms_norm(b, c, w.kv_norm, eps)
    q_nope, q_rot = b.op_multi("Split", [b.op("Reshape", [q, b.ints(0, 0, heads, lat.nope_dim + lat.rope_dim)]),
                                         b.ints(lat.nope_dim, lat.rope_dim)], {"axis": -1}, num_outputs=2)
    # The shared tables at this step's positions, over heads of rope_dim (the whole head rotated), paired as stored.
    rotary = dataclasses.replace(step.rotary, head_dim=lat.rope_dim, interleaved=lat.interleaved,
                                 position_ids=step.rotary.position_ids if variant is not Variant.GQA
                                 else gqa_positions(b, x, step))
    q_rot = apply_rotary(b, b.op("Reshape", [q_rot, b.ints(0, 0, heads * lat.rope_dim)]), rotary, heads)
    k_rot = apply_rotary(b, k_rot, rotary, 1)
    query = b.op("Concat", [_per_head(b, q_nope, w.absorb_k),
                            b.op("Reshape", [q_rot, b.ints(0, 0, heads, lat.rope_dim)])], {"axis": -1})
    query = b.op("Reshape", [query, b.ints(0, 0, heads * (lat.kv_rank + lat.rope_dim))])
    key = b.op("Concat", [c, k_rot], {"axis": -1})  # [batch, seq, kv_rank + rope]: the one KV head
    if variant is Variant.GQA:
        y, key_out, value_out = gqa_core(b, query, key, key, cfg, dataclasses.replace(step, rotary=None),
                                         past_key, past_value)
    elif variant is Variant.ATTN_STATIC:
        y, key_out, value_out = static_core(b, query, key, key, cfg, step, past_key, past_value)
    else:
        y, key_out, value_out = dynamic_core(b, query, key, key, cfg, step, past_key, past_value)
    # Each head's output is a weighted sum of [c | k_rot] rows; its latent part expands to the head's value.
    y = b.op("Slice", [b.op("Reshape", [y, b.ints(0, 0, heads, lat.kv_rank + lat.rope_dim)]), b.ints(0),
                       b.ints(lat.kv_rank), b.ints(3)])
    expand = b.op("Transpose", [w.expand_v], {"perm": [0, 2, 1]})  # [heads, kv_rank, value]
    y = b.op("Reshape", [_per_head(b, y, expand), b.ints(0, 0, heads * lat.value_dim)])
    return linear(b, y, w.o, w.o_bias), key_out, value_out
