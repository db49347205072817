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


def apply_rotary(b: GraphBuilder, x: ir.Value, rotary: Rotary, num_heads: int) -> ir.Value:
    """Rotate [batch, seq, heads*head_dim] by ``rotary.position_ids`` (the halves paired, or adjacent dims)."""
    attrs = {"interleaved": int(rotary.interleaved), "num_heads": num_heads}
    if rotary.rotary_dim != rotary.head_dim:
        attrs["rotary_embedding_dim"] = rotary.rotary_dim
    if b.target.contrib_ops:
        return b.op("RotaryEmbedding", [x, rotary.position_ids, rotary.cos, rotary.sin], attrs, domain="com.microsoft")
    return b.op("RotaryEmbedding", [x, rotary.cos, rotary.sin, rotary.position_ids], attrs)
