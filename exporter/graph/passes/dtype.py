"""The one place that decides a new initializer's dtype: from its data, never from a default.

A fold once stamped packed fp16 QKV weights as float32 because the source value's declared type
had been dropped and the pass fell back to FLOAT; the model then failed to load, or loaded with
near-zero weights. Every initializer-producing pass asks this helper instead.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

logger = logging.getLogger(__name__)


def initializer_dtype(value: ir.Value) -> ir.DataType:
    """The dtype of ``value``'s data; a disagreeing declared type is stale metadata and loses."""
    if value.const_value is None:
        raise ValueError(f"{value.name} has no data: only initializers can be folded")
    data_dtype = value.const_value.dtype
    if value.dtype is not None and value.dtype != data_dtype:
        logger.warning("%s is declared %s but holds %s data; using the data's", value.name, value.dtype, data_dtype)
    return data_dtype


def make_initializer(graph: ir.Graph, tensor: ir.TensorProtocol, name: str) -> ir.Value:
    """Register ``tensor`` as initializer ``name`` with its type taken from the data."""
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), const_value=tensor)
    value.type = ir.TensorType(tensor.dtype)
    graph.register_initializer(value)
    return value
