"""Stage 3: fold initializers after the weights exist as lazy recipes.

Packs Q/K/V and gate/up, pre-transposes every projection weight, and drops what nothing uses
(the pre-pack sources). Each pass reports whether it changed anything.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from exporter.graph.passes.fold_concat import FoldConcatInitializersPass
from exporter.graph.passes.fold_transpose import FoldTransposeInitializersPass


@dataclasses.dataclass
class FoldResult:
    model: ir.Model
    initializers_before: int
    initializers_after: int
    passes_changed: dict[str, bool]


def fold_model(model: ir.Model) -> FoldResult:
    before = len(model.graph.initializers)
    changed = {}
    for fold in (FoldConcatInitializersPass(), FoldTransposeInitializersPass(), RemoveUnusedNodesPass()):
        changed[type(fold).__name__] = fold(model).modified
    return FoldResult(model, before, len(model.graph.initializers), changed)
