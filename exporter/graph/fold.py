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
from exporter.graph.passes.quantize import GatherTiedEmbeddingPass, QuantizeExpertsPass, QuantizeMatMulPass
from exporter import contract
from exporter.request import EP, ExportRequest


@dataclasses.dataclass
class FoldResult:
    model: ir.Model
    initializers_before: int
    initializers_after: int
    passes_changed: dict[str, bool]
    quantization: dict | None = None  # per weight: quantized how, or kept for which role


# MatMulNBits accuracy_level on the CPU EP by weight width, where the request names none: 4 (int8
# activations, the genai builder's CPU default) for both. Chosen by measurement (issue 30,
# benchmarks/results/cpu_matrix.json, SmolLM2-135M on 2 cores through genai's generator): 4-bit at level
# 0 decoded at 2.8x the builder's int4 (21.3 vs 7.5 ms/token), at level 4 at its speed; onnxruntime has no
# fast 8-bit kernel with fp32 activations (~800 vs ~11 ms/token). Level 4 quantizes a one-token step's
# activations apart from a prefill's (0.95 logits apart on that model), so the decode-vs-prefill check is
# information there (validate.py) and the quality checks against the fp32 reference judge; level 0
# (`quant.accuracy_level`) computes in fp32, exact to the dequantized weights. CUDA ignores the attribute.
# Expert ops (QMoE) keep level 0 unless the request names one: their level-4 path was not measured.
CPU_ACCURACY_LEVEL = {4: 4, 8: 4}


def fold_model(model: ir.Model, request: ExportRequest | None = None, num_layers: int = 0) -> FoldResult:
    """Pack, pre-transpose, drop the unused; for int4 / int8 requests, then quantize the MatMuls."""
    before = len(model.graph.initializers)
    changed = {}
    passes = [FoldConcatInitializersPass(), FoldTransposeInitializersPass()]
    quantize = experts = None
    if request is not None and request.dtype.quantized:
        spec = request.quant
        level = spec.accuracy_level
        if level is None:
            level = CPU_ACCURACY_LEVEL if request.ep is EP.CPU else 0
        experts = QuantizeExpertsPass(request.dtype.bits, spec.block_size, spec.symmetric, num_layers=num_layers,
                                      keep=spec.keep, accuracy_level=spec.accuracy_level or 0)
        passes.append(experts)
        quantize = QuantizeMatMulPass(
            request.dtype.bits, spec.block_size, spec.symmetric, num_layers=num_layers, logits=contract.LOGITS,
            lm_head_bits=spec.lm_head_bits, keep=spec.keep, accuracy_level=level, method=spec.method,
            int8_layers=spec.int8_layers)
        passes.append(quantize)
        if request.ep is EP.CPU and "embedding" not in spec.keep:
            passes.append(GatherTiedEmbeddingPass(quantize))
    for fold in (*passes, RemoveUnusedNodesPass()):
        changed[type(fold).__name__] = fold(model).modified
    return FoldResult(model, before, len(model.graph.initializers), changed,
                      {**experts.decisions, **quantize.decisions} if quantize else None)
