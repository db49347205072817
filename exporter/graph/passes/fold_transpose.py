"""Fold Transpose(perm=[1, 0]) of a checkpoint initializer into a pre-transposed initializer."""

from __future__ import annotations

import onnx_ir as ir

from exporter.packaging.checkpoint import CheckpointTensor
from exporter.graph.passes.dtype import initializer_dtype, make_initializer


class FoldTransposeInitializersPass(ir.passes.InPlacePass):
    """``MatMul(x, Transpose(W))`` -> ``MatMul(x, W_T)`` with W_T a lazy transposed recipe."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folded = 0
        for node in list(graph):
            if node.op_type != "Transpose" or node.domain != "":
                continue
            source = node.inputs[0].const_value
            perm = node.attributes.get_ints("perm", None)
            if not isinstance(source, CheckpointTensor) or len(source.shape) != 2 or list(perm or [1, 0]) != [1, 0]:
                continue
            name = f"{node.inputs[0].name}.T"
            if name in graph.initializers:
                transposed = graph.initializers[name]
            else:
                tensor = source.with_recipe(transposed=not source.transposed, name=name)
                assert tensor.dtype == initializer_dtype(node.inputs[0])
                transposed = make_initializer(graph, tensor, name)
            node.outputs[0].replace_all_uses_with(transposed)
            graph.remove(node, safe=True)
            folded += 1
        return ir.passes.PassResult(model, modified=bool(folded))
