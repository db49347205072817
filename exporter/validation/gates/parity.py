"""Numeric parity gates: the export (and a peer export) against transformers on the same weights."""

from __future__ import annotations

import numpy as np

from exporter.validation.gates import GateResult
from exporter.validation.parity import ExportRun, ParityResult, export_decode, judge
from exporter.validation.reference import ReferenceRun
from exporter.runtime.session import Decoder

# Last-position prefill logits: max abs error over the reference's logit range.
PREFILL_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 2e-1}
# A step whose reference top-1/top-2 gap is below this is a near tie: a different token there is
# rounding, not a bug (counted and listed, not failed).
NEAR_TIE_MARGIN = {"fp32": 0.01, "fp16": 0.1, "bf16": 0.5}


def parity_gates(run: ExportRun, ref: ReferenceRun, dtype: str) -> tuple[list[GateResult], ParityResult]:
    """The export's teacher-forced run (``export_decode`` fed the reference's tokens) judged."""
    result = judge(run, ref, NEAR_TIE_MARGIN[dtype])
    limit = PREFILL_TOLERANCE[dtype] * result.logit_range
    return [
        GateResult(
            "parity", "prefill logits max abs error vs transformers", result.prefill_max_abs_error <= limit,
            result.prefill_max_abs_error, limit,
            "" if result.prefill_max_abs_error <= limit else
            f"last-position logits differ by {result.prefill_max_abs_error:.4g} (range {result.logit_range:.4g})",
            details={"relative_tolerance": PREFILL_TOLERANCE[dtype], "logit_range": result.logit_range},
        ),
        GateResult(
            "parity", f"greedy decode, {result.steps} steps (teacher-forced)", not result.mismatches,
            f"{result.steps - len(result.mismatches) - len(result.tie_mismatches)}/{result.steps} tokens equal",
            f"no mismatch outside near ties (gap < {NEAR_TIE_MARGIN[dtype]})",
            "" if not result.mismatches else f"different token at decisive steps {result.mismatches}",
            details={"near_ties": result.near_ties, "near_tie_flips": result.tie_mismatches,
                     "reference_tokens": ref.tokens, "export_tokens": result.tokens},
        ),
    ], result


def peer_gate(lm: Decoder, peer: Decoder, ref: ReferenceRun, dtype: str) -> GateResult:
    """Two exports of one checkpoint (e.g. attn_static vs attn_dynamic) agree step by step."""
    logits_a, logits_b = (export_decode(d, ref.prompt, len(ref.tokens), ref.tokens).logits for d in (lm, peer))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits_a, logits_b))
    limit = PREFILL_TOLERANCE[dtype] * float(ref.prefill_logits.max() - ref.prefill_logits.min())
    gaps = [float("inf"), *ref.gaps]  # step 0 is the prefill
    flips = [i for i, (a, b) in enumerate(zip(logits_a, logits_b))
             if int(a.argmax()) != int(b.argmax()) and gaps[min(i, len(gaps) - 1)] >= NEAR_TIE_MARGIN[dtype]]
    passed = diff <= limit and not flips
    return GateResult(
        "parity", f"{lm.variant.value} vs {peer.variant.value} of the same checkpoint", passed, diff, limit,
        "" if passed else f"max logit difference {diff:.4g}, argmax differs at steps {flips}",
    )

