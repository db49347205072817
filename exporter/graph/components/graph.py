"""A thin layer over onnx-ir's Tape: ops, checkpoint initializers and constants for one model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir import tape

from exporter.graph.target import CURRENT, Target
from exporter.packaging.checkpoint import Checkpoint, CheckpointTensor, WeightPart


class GraphBuilder:
    """Collects nodes and initializers; weights are lazy ``CheckpointTensor``s, never read here."""

    def __init__(self, checkpoint: Checkpoint, dtype: ir.DataType, rope_cache: Path | None = None,
                 target: Target = CURRENT, fused_sparse_mixer: bool = False, ep: str = "cpu"):
        self.tape = tape.Tape()
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.rope_cache = rope_cache  # where rope tables are kept between exports (None: computed)
        self.target = target  # which ops the components emit (graph/target.py)
        # phimoe routed by the expert op's own sparse mixer (components/moe.py fused_sparse_mixer)
        self.fused_sparse_mixer = fused_sparse_mixer
        self.ep = ep  # the EP the export is for
        # gated DeltaNet's recurrence op: GatedDeltaNet, or LinearAttention for transformers.js's older
        # onnxruntime-node (components/gated_deltanet.py)
        self.deltanet_op = "GatedDeltaNet"  # gated_deltanet.GATED_DELTANET_OP (which imports this module)
        # sigmoid routing (components/moe.py sigmoid_router): com.microsoft MoEGroupRouter, or the same computation
        # in plain ops where the runtime has no kernel for it (onnxruntime-gpu 1.31.1, onnxruntime-node 1.30)
        self.group_router_op = ep != "cuda"
        self._weights: dict[str, ir.Value] = {}
        self._consts: dict[tuple, ir.Value] = {}

    def op(self, op_type: str, inputs, attributes=None, *, domain: str = "") -> ir.Value:
        return self.tape.op(op_type, inputs, attributes, domain=domain)

    def op_multi(self, op_type: str, inputs, attributes=None, *, num_outputs: int, domain: str = ""):
        return self.tape.op_multi_out(op_type, inputs, attributes, num_outputs=num_outputs, domain=domain)

    def weight(self, name: str, part: WeightPart | None = None, dtype: ir.DataType | None = None) -> ir.Value:
        """A checkpoint tensor (or a row slice of one) as an initializer in the model dtype (or ``dtype``:
        the fp32 a recurrence's decay parameters stay in)."""
        part = part or WeightPart(name)
        if name not in self._weights:
            tensor = CheckpointTensor(self.checkpoint, (part,), dtype or self.dtype, name=name)
            self._weights[name] = self.tape.initializer(tensor, name=name)
        return self._weights[name]

    def packed_weight(self, name: str, parts: list[WeightPart]) -> ir.Value:
        """Row slices of checkpoint tensors concatenated into one initializer ``name`` (projections a
        checkpoint stores interleaved per head, taken apart and regrouped)."""
        if name not in self._weights:
            tensor = CheckpointTensor(self.checkpoint, tuple(parts), self.dtype, name=name)
            self._weights[name] = self.tape.initializer(tensor, name=name)
        return self._weights[name]

    def stacked_weight(self, name: str, parts: list[WeightPart], *, experts: int, interleave: int = 1) -> ir.Value:
        """Experts' tensors stacked into one ``[experts, rows, cols]`` initializer (``interleave`` 2:
        gate and up rows alternating, the fused SwiGLU layout of ORT's MoE ops)."""
        if name not in self._weights:
            tensor = CheckpointTensor(self.checkpoint, tuple(parts), self.dtype, name=name, interleave=interleave,
                                      experts=experts)
            self._weights[name] = self.tape.initializer(tensor, name=name)
        return self._weights[name]

    def has_weight(self, name: str) -> bool:
        return name in self.checkpoint

    def constant(self, array: np.ndarray, name: str) -> ir.Value:
        """A small computed initializer (rope tables, shape vectors); reused when asked again."""
        key = (name, array.dtype.str, array.shape)
        if key not in self._consts:
            self._consts[key] = self.tape.initializer(ir.tensor(array, name=name), name=name)
        return self._consts[key]

    def scalar(self, value: float) -> ir.Value:
        """A scalar in the model dtype (scales, soft-caps), rounded as the reference rounds it."""
        return self.constant(np.array(value, dtype=self.dtype.numpy()), f"const_scalar_{value!r}".replace("-", "m"))

    def scalar_f32(self, value: float) -> ir.Value:
        """A scalar for what a half build computes in fp32: ``scalar`` cast up (a half build holds no fp32
        initializer, so the constant is rounded to the model dtype first), or ``scalar`` itself in fp32."""
        const = self.scalar(value)
        return self.op("Cast", [const], {"to": ir.DataType.FLOAT}) if self.dtype != ir.DataType.FLOAT else const

    def ints(self, *values: int) -> ir.Value:
        name = "const_i64_" + "_".join(str(v).replace("-", "m") for v in values)
        return self.constant(np.array(values, dtype=np.int64), name)

    def scalar_i64(self, value: int) -> ir.Value:
        return self.constant(np.array(value, dtype=np.int64), f"const_scalar_i64_{value}".replace("-", "m"))


def linear(b: GraphBuilder, x: ir.Value, weight: ir.Value, bias: ir.Value | None = None) -> ir.Value:
    """``x @ W.T (+ bias)`` on a checkpoint-layout [out, in] weight; the fold pre-transposes W."""
    y = b.op("MatMul", [x, b.op("Transpose", [weight], {"perm": [1, 0]})])
    return b.op("Add", [y, bias]) if bias is not None else y


def packed(b: GraphBuilder, parts: list[ir.Value]) -> ir.Value:
    """Row-concatenate weights (Q/K/V, gate/up); the fold turns this into one initializer."""
    return parts[0] if len(parts) == 1 else b.op("Concat", parts, {"axis": 0})
