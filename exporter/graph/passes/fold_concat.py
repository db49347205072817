"""Fold Concat(axis=0) of checkpoint initializers into one packed initializer (QKV, gate/up)."""

from __future__ import annotations

import onnx_ir as ir

from exporter.packaging.checkpoint import CheckpointTensor
from exporter.graph.passes.dtype import initializer_dtype, make_initializer


class FoldConcatInitializersPass(ir.passes.InPlacePass):
    """Replace ``Concat(w1, w2, ..., axis=0)`` of untransposed checkpoint tensors by one recipe.

    No data is read: the new initializer is a ``CheckpointTensor`` whose parts are the inputs'
    parts, so the weights are still streamed once, at save time.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folded = 0
        for node in list(graph):
            if node.op_type != "Concat" or node.domain != "" or node.attributes.get_int("axis", 0) != 0:
                continue
            sources = [v.const_value for v in node.inputs]
            if not all(isinstance(t, CheckpointTensor) and not t.transposed for t in sources):
                continue
            dtypes = {initializer_dtype(v) for v in node.inputs}
            if len(dtypes) != 1:
                raise ValueError(f"cannot pack {[v.name for v in node.inputs]}: mixed dtypes {dtypes}")
            name = _packed_name([v.name for v in node.inputs])
            tensor = sources[0].with_recipe(parts=tuple(p for t in sources for p in t.parts), name=name)
            assert tensor.dtype == dtypes.pop()
            packed = make_initializer(graph, tensor, name)
            node.outputs[0].replace_all_uses_with(packed)
            graph.remove(node, safe=True)
            folded += 1
        return ir.passes.PassResult(model, modified=bool(folded))


def _packed_name(names: list[str]) -> str:
    """model.layers.0.self_attn.{q,k,v}_proj.weight -> model.layers.0.self_attn.q_k_v_proj.weight"""
    heads, tails = zip(*(n.rsplit(".", 2)[0:2] for n in names))
    suffix = names[0].rsplit(".", 1)[1]
    if len(set(heads)) == 1:
        return f"{heads[0]}.{'_'.join(t.removesuffix('_proj') for t in tails)}_proj.{suffix}"
    return "packed." + "+".join(names)
