"""Rotary position embedding: baked cos/sin tables and the opset-23 RotaryEmbedding op (or, for the
compat target, com.microsoft's RotaryEmbedding: the same rotation, position_ids second)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from exporter.graph.components.graph import GraphBuilder
from exporter.graph.rope import RopeTables


@dataclasses.dataclass
class Rotary:
    """The model-wide rotary inputs every layer shares: tables plus this step's indices."""

    cos: ir.Value
    sin: ir.Value
    rotary_dim: int
    head_dim: int
    position_ids: ir.Value | None = None  # table rows for this step (Attention variants)
    interleaved: bool = False  # adjacent dims paired (ernie4_5, cohere2), not the two halves
    # cos / sin already gathered per token, [batch, seq, rotary_dim / 2] (M-RoPE: mrope_rotary): no position_ids,
    # and GroupQueryAttention cannot rotate with them (its rotary indexes the tables by its own positions).
    per_token: bool = False


def rope_constants(b: GraphBuilder, tables: RopeTables, layer_type: str | None = None) -> tuple[ir.Value, ir.Value]:
    dtype = b.dtype.numpy()
    prefix = f"rope.{layer_type}." if layer_type else "rope."
    # fp32 exports take the tables as they are (a copy each would double them: 2^20 positions of a
    # 256-wide head are 1 GiB).
    return (
        b.constant(tables.cos.astype(dtype, copy=False), prefix + "cos_cache"),
        b.constant(tables.sin.astype(dtype, copy=False), prefix + "sin_cache"),
    )


def longrope_row_offset(b: GraphBuilder, total_len: ir.Value, tables: RopeTables) -> ir.Value:
    """``table_len`` when the sequence has outgrown the short factors, else 0 (int64 scalar).

    Arithmetic instead of an If node keeps the graph free of control flow (CUDA graph capture).
    """
    longer = b.op("Greater", [total_len, b.scalar_i64(tables.switch_at)])
    return b.op("Mul", [b.op("Cast", [longer], {"to": ir.DataType.INT64}), b.scalar_i64(tables.table_len)])


def mrope_section(rope) -> tuple[int, ...] | None:
    """The (temporal, height, width) split of the rotary half of a multimodal rope (Qwen2.5-VL's M-RoPE), None for
    a rope of one position stream."""
    section = rope.parameters.get("mrope_section") if rope is not None else None
    return tuple(int(s) for s in section) if section else None


# Language models whose M-RoPE interleaves the three streams' columns (transformers' Qwen3.5 / Qwen3-VL text rotary,
# recomposition_frequencies: column j of the half from height where j % 3 == 1 and j < 3 * section[1], from width where
# j % 3 == 2 and j < 3 * section[2], else temporal) rather than laying them out in three runs (Qwen2.5-VL's). By the
# architecture built, or the transformers text config's model_type where it is read as another family's (qwen3_vl_text
# as qwen3: exporter/graph/language_model.py); transformers' rotary interleaves whatever mrope_interleaved says.
MROPE_INTERLEAVED = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_vl_text", "qwen3_vl_moe_text")


def mrope_streams(section: tuple[int, ...], interleaved: bool) -> list[int]:
    """Which position stream (0 temporal, 1 height, 2 width) each column of the rotary half takes."""
    if not interleaved:
        return [stream for stream, width in enumerate(section) for _ in range(width)]
    streams = [0] * sum(section)
    for stream in (1, 2):  # transformers' slice(stream, 3 * section[stream], 3), which stops at the half's end
        for j in range(stream, min(3 * section[stream], len(streams)), 3):
            streams[j] = stream
    return streams


def mrope_rotary(b: GraphBuilder, cos: ir.Value, sin: ir.Value, position_ids: ir.Value, section: tuple[int, ...],
                 rotary_dim: int, head_dim: int, interleaved: bool = False) -> Rotary:
    """M-RoPE: the tables' rows gathered once per step for each of ``position_ids``' three streams ([3, batch, seq]:
    temporal, height, width), then each column of the half taken from its stream's rows (mrope_streams: three runs of
    section[0], section[1], section[2] columns as transformers' Qwen2.5-VL rotary recomposes its frequencies, or
    ``interleaved`` as Qwen3.5's); every layer's RotaryEmbedding takes the result per token. (onnxruntime's
    com.microsoft MRotaryEmbedding does the sectioned one per layer, gathering again in every call: 2.3x slower on the
    CPU at a 512-token prefill of Qwen2.5-VL-7B's 28 layers, docs/graph-contracts.md.)"""
    half = sum(section)
    # column j of the result = column (stream(j) * half + j) of the three streams' rows side by side
    columns = b.ints(*[stream * half + j for j, stream in enumerate(mrope_streams(section, interleaved))])
    tables = []
    for table in (cos, sin):
        rows = b.op("Gather", [table, position_ids], {"axis": 0})  # [3, batch, seq, rotary_dim / 2]
        side_by_side = b.op("Reshape", [b.op("Transpose", [rows], {"perm": [1, 2, 0, 3]}), b.ints(0, 0, -1)])
        tables.append(b.op("Gather", [side_by_side, columns], {"axis": -1}))
    return Rotary(tables[0], tables[1], rotary_dim, head_dim, per_token=True)


def apply_rotary(b: GraphBuilder, x: ir.Value, rotary: Rotary, num_heads: int) -> ir.Value:
    """Rotate [batch, seq, heads*head_dim] by ``rotary.position_ids`` (the halves paired, or adjacent dims)."""
    attrs = {"interleaved": int(rotary.interleaved), "num_heads": num_heads}
    if rotary.rotary_dim != rotary.head_dim:
        attrs["rotary_embedding_dim"] = rotary.rotary_dim
    if rotary.per_token:  # cos / sin [batch, seq, rotary_dim / 2]: RotaryEmbedding-23 without position_ids
        return b.op("RotaryEmbedding", [x, rotary.cos, rotary.sin], attrs)
    if b.target.contrib_ops:
        return b.op("RotaryEmbedding", [x, rotary.position_ids, rotary.cos, rotary.sin], attrs, domain="com.microsoft")
    return b.op("RotaryEmbedding", [x, rotary.cos, rotary.sin, rotary.position_ids], attrs)
