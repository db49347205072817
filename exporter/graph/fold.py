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
from exporter.graph.passes.quantize import QuantizeExpertsPass, QuantizeMatMulPass
from exporter import contract
from exporter.request import EP, ExportRequest


@dataclasses.dataclass
class FoldResult:
    model: ir.Model
    initializers_before: int
    initializers_after: int
    passes_changed: dict[str, bool]
    quantization: dict | None = None  # per weight: quantized how, or kept for which role


# MatMulNBits accuracy_level on the CPU EP, by weight width. 4-bit: 0 (compute in the activation
# dtype). Level 4 (int8 activations, the genai builder's CPU default) is faster, but on the CPU EP it
# quantizes the activations of one-token decode steps and not of a prefill: SmolLM2-135M int8 decoded
# 0.95 logits away from its own prefill of the same tokens at level 4, 4e-5 at level 0, so a quality
# gate scored on prefill would not describe what decode computes. 8-bit: 4, because onnxruntime has no
# fast 8-bit kernel with fp32 activations: SmolLM2-135M int8 decoded at ~800 ms/token at level 0
# against ~17 at level 4 (the builder's int8: 14; benchmarks/results/cpu_matrix.json), and its quality
# against the fp32 reference stays what a user gets (agreement 1.0 there). Its decode-vs-prefill check
# is then reported as information (validate.py). CUDA ignores the attribute.
CPU_ACCURACY_LEVEL = {4: 0, 8: 4}


def fold_model(model: ir.Model, request: ExportRequest | None = None, num_layers: int = 0) -> FoldResult:
    """Pack, pre-transpose, drop the unused; for int4 / int8 requests, then quantize the MatMuls."""
    before = len(model.graph.initializers)
    changed = {}
    passes = [FoldConcatInitializersPass(), FoldTransposeInitializersPass()]
    quantize = experts = None
    if request is not None and request.dtype.quantized:
        spec = request.quant
        experts = QuantizeExpertsPass(request.dtype.bits, spec.block_size, spec.symmetric, num_layers=num_layers,
                                      keep=spec.keep, accuracy_level=0)
        passes.append(experts)
        quantize = QuantizeMatMulPass(
            request.dtype.bits, spec.block_size, spec.symmetric, num_layers=num_layers, logits=contract.LOGITS,
            lm_head_bits=spec.lm_head_bits, keep=spec.keep,
            accuracy_level=CPU_ACCURACY_LEVEL if request.ep is EP.CPU else 0)
        passes.append(quantize)
    for fold in (*passes, RemoveUnusedNodesPass()):
        changed[type(fold).__name__] = fold(model).modified
    return FoldResult(model, before, len(model.graph.initializers), changed,
                      {**experts.decisions, **quantize.decisions} if quantize else None)
