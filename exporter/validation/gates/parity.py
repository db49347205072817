"""Numeric parity gates: the export (and a peer export) against transformers on the same weights."""

from __future__ import annotations

import numpy as np

from exporter.validation.gates import GateResult
from exporter.validation.parity import ExportRun, ParityResult, export_decode, judge
from exporter.validation.overflow import Finding
from exporter.validation.reference import ReferenceRun
from exporter.validation.yardstick import Drift, drift, sound
from exporter.runtime.session import Decoder

# Last-position prefill logits: max abs error over the reference's logit range.
PREFILL_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 2e-1}
# A step whose reference top-1/top-2 gap is below this is a near tie: a different token there is
# rounding, not a bug (counted and listed, not failed).
NEAR_TIE_MARGIN = {"fp32": 0.01, "fp16": 0.1, "bf16": 0.5}


def parity_gates(run: ExportRun, ref: ReferenceRun, dtype: str, yardstick: Drift | None = None,
                 other: Drift | None = None, overflow: Finding | None = None,
                 prompt: str = "", ep: str = "cuda", routing_ties: dict | None = None) -> tuple[list[GateResult], ParityResult]:
    """The export's teacher-forced run (``export_decode`` fed the reference's tokens) judged.

    A half-precision export comes with its ``yardstick`` (transformers in the export's dtype on the
    same tokens, ``yardstick.measure``) and, where that is not sound, ``other`` (transformers in
    the other half precision). The export is judged against fp32 all the same; the yardstick sets
    the near-tie margin where it is sound (twice the largest change half precision made to the
    top-1/top-2 gap) and says in every failure whether the dtype or the export departed.
    ``overflow`` is where the export's values stopped being finite (``overflow.locate``), when they
    did. ``prompt`` names the prompt in the checks' names ("" for the random-token prompt).
    ``routing_ties`` (step -> routing.RoutingTie): departures a mixture of experts' flipped near-tie expert choice
    explains, shown by replaying transformers' fp32 with it flipped: as a top-1/top-2 near tie, not failures (the
    prefill is step 0).
    """
    span = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    fixed = NEAR_TIE_MARGIN[dtype]
    yard_sound = yardstick is not None and sound(yardstick, ref, PREFILL_TOLERANCE[dtype], fixed)
    measured_margin = yardstick.tie_margin() if yard_sound else None
    margin = near_tie_margin(dtype, yardstick, ref)
    result = judge(run, ref, margin)
    ties = routing_ties or {}
    result.routing_ties = [ties[step].to_dict() for step in sorted(ties)]
    result.routing_tie_mismatches = [step for step in result.mismatches if step in ties]
    result.mismatches = [step for step in result.mismatches if step not in ties]
    export = drift("export", dtype, run.logits[: len(ref.tokens)], ref)
    limit = PREFILL_TOLERANCE[dtype] * result.logit_range
    why = verdict(dtype, yardstick, other, ref, ep) if yardstick is not None else ""
    suffix = f", {prompt}" if prompt else ""
    within = result.prefill_max_abs_error <= limit
    prefill_ok = within or 0 in ties
    if result.mismatches:
        decode_message = (f"different token at decisive steps {result.mismatches} (fp32 gaps "
                          + ", ".join(f"{ref.gaps[i]:.3g}" for i in result.mismatches) + ")"
                          + (f"; {why}" if why and export.finite and prefill_ok else ""))
    else:  # differing steps that near-tie expert choices explain: said, as they are not failures
        decode_message = "; ".join(f"step {step}: {ties[step].describe()}" for step in result.routing_tie_mismatches)
    gates = []
    if not export.finite:
        gates.append(GateResult(
            "parity", f"export outputs finite{suffix}", False, f"non-finite at steps {export.nonfinite_steps}",
            "every logit finite", overflow_message(dtype, export, overflow, why, ep),
            details={"overflow": overflow.to_dict() if overflow else None}))
    gates += [
        GateResult(
            "parity", f"prefill logits max abs error vs transformers{suffix}", prefill_ok,
            result.prefill_max_abs_error, limit,
            "" if within else
            f"last-position logits differ by {result.prefill_max_abs_error:.4g} (range {result.logit_range:.4g})"
            + (f": {ties[0].describe()}" if 0 in ties else f"; {why}" if why and export.finite else ""),
            details={"relative_tolerance": PREFILL_TOLERANCE[dtype], "logit_range": span,
                     **({"transformers_in_dtype": yardstick.prefill_max_abs_error} if yardstick else {})},
        ),
        GateResult(
            "parity", f"greedy decode, {result.steps} steps (teacher-forced){suffix}", not result.mismatches,
            f"{sum(got == want for got, want in zip(result.tokens, ref.tokens))}/{result.steps} tokens equal",
            f"no mismatch outside near ties (gap < {margin:.3g}"
            + (", measured" if measured_margin is not None and measured_margin > fixed else "") + ")",
            decode_message, details={"near_ties": result.near_ties, "near_tie_flips": result.tie_mismatches,
                     "routing_ties": result.routing_ties,
                     "near_tie_margin": margin, "measured_margin": measured_margin,
                     "margin_source": "measured" if measured_margin is not None and measured_margin > fixed else "fixed",
                     "reference_tokens": ref.tokens, "export_tokens": result.tokens},
        ),
    ]
    if yardstick is not None:
        departed = not export.finite or not prefill_ok or bool(result.mismatches)
        gates.append(GateResult(
            "parity", f"transformers in {dtype} beside the export{suffix}", True,
            f"transformers {yardstick.describe()}; export {export.describe()}",
            "the export is judged against fp32",
            why if departed or not yard_sound else "", informational=True,
            details={"export": export.to_dict(), "transformers": yardstick.to_dict(),
                     **({"transformers_" + other.dtype: other.to_dict()} if other else {})}))
    return gates, result


def near_tie_margin(dtype: str, yardstick: Drift | None, ref: ReferenceRun) -> float:
    """The top-1/top-2 gap below which a step is a near tie for an export in ``dtype``: the dtype's fixed margin,
    widened to the measured one (``Drift.tie_margin``) where transformers in that dtype (``yardstick``) is sound and
    moves gaps further; never narrowed (onnxruntime's kernels round differently from torch's)."""
    fixed = NEAR_TIE_MARGIN[dtype]
    if yardstick is None or not sound(yardstick, ref, PREFILL_TOLERANCE[dtype], fixed):
        return fixed
    measured = yardstick.tie_margin()
    return max(measured, fixed) if measured is not None else fixed


def _instead(dtype: str, ep: str) -> str:
    """What to export for ``ep`` instead of ``dtype`` (bf16 has fp32's range, but onnxruntime's CPU EP
    has no bf16 MatMul)."""
    if dtype == "bf16":
        return "export fp32"
    if ep == "cpu":
        return "export fp32 for cpu (bf16, which has fp32's range, runs on cuda only)"
    return "export bf16"


def verdict(dtype: str, yardstick: Drift, other: Drift | None, ref: ReferenceRun, ep: str = "cuda") -> str:
    """Whether the dtype holds this model, as transformers in it shows, and what to export instead."""
    if sound(yardstick, ref, PREFILL_TOLERANCE[dtype], NEAR_TIE_MARGIN[dtype]):
        return (f"transformers in {dtype} on the same tokens {yardstick.describe()}: the export's departure is "
                f"its own (an exporter or runtime fault), not {dtype}'s range")
    said = f"{dtype} is unsafe for this model: transformers itself in {dtype} {yardstick.describe()}"
    if other is None:
        return f"{said}; {_instead(dtype, ep)}"
    if sound(other, ref, PREFILL_TOLERANCE[other.dtype], NEAR_TIE_MARGIN[other.dtype]):
        # bf16 unsafe where fp16 holds the model: its precision, not its range (fp16's has three more bits)
        instead = "export fp16" if dtype == "bf16" else _instead(dtype, ep)
        return f"{said}; transformers in {other.dtype} {other.describe()}: {instead}"
    return said + f"; transformers in {other.dtype} too {other.describe()}: export fp32"


def overflow_message(dtype: str, export: Drift, finding: Finding | None, why: str, ep: str = "cuda") -> str:
    """"fp16 overflows in decoder layer 3 (first non-finite value: SkipSimplifiedLayerNormalization
    node_12); export bf16" and what the yardstick said."""
    steps = f"non-finite logits from step {export.nonfinite_steps[0]}"
    if finding is None or finding.overflow_at is None:
        head = f"{dtype} export gives {steps}"
    else:
        head = (f"{dtype} overflows in {finding.overflow_at} (first non-finite value: {finding.op} {finding.node}; "
                f"{steps})")
    return f"{head}; {why or _instead(dtype, ep)}"


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



# The traced batch check: two prompts of different lengths in one left-padded batch.
BATCH_PROMPT_LENGTHS = (16, 9)


def batch_gate(lm: Decoder, vocab_size: int, dtype: str, steps: int, informational: bool = False) -> GateResult:
    """A left-padded batch of two prompts of different lengths, prefilled together and decoded together
    (``run_batch_parity``), against each prompt run alone through the same export, greedily, each row fed
    the tokens its own run chose.

    For a graph traced by transformers.exporters: exportfarm's own attn_dynamic graphs build their
    padding mask themselves (tests/test_parity.py checks them row by row), while a traced graph masks
    padding however transformers' code and onnxruntime's fusions made it, which the single-prompt parity
    run never exercises. ``informational``: int8 activations, which quantize each step apart."""
    from exporter.validation.parity import run_batch_parity
    from exporter.validation.reference import top2_gap

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, vocab_size, size=n)] for n in BATCH_PROMPT_LENGTHS]
    check = (f"left-padded batch of {len(prompts)} ({' and '.join(map(str, BATCH_PROMPT_LENGTHS))} tokens), "
             f"{steps} steps, vs each prompt alone")
    alone = []
    try:
        for prompt in prompts:
            run = export_decode(lm, prompt, steps, device_caches=False)  # its own greedy choices: chosen == fed
            alone.append(ReferenceRun(prompt, run.prefill_logits, run.chosen, run.logits[:steps],
                                      [top2_gap(logits) for logits in run.logits[:steps]]))
        rows = run_batch_parity(lm, alone, NEAR_TIE_MARGIN[dtype])
    except Exception as err:  # onnxruntime refusing the shapes (a size the trace fixed): the check's finding
        return GateResult("parity", check, False, "error", "the batch runs",
                          f"onnxruntime could not run a batch of {len(prompts)} through the export "
                          f"({' '.join(str(err).split())[:300]}): serve it one prompt at a time (batch 1)",
                          informational=informational)
    longest = max(BATCH_PROMPT_LENGTHS)
    problems, worst = [], 0.0
    for r, (prompt, result) in enumerate(zip(prompts, rows)):
        limit = PREFILL_TOLERANCE[dtype] * result.logit_range
        ratio = result.prefill_max_abs_error / result.logit_range if result.logit_range else 0.0
        worst = max(worst, ratio if np.isfinite(ratio) else float("inf"))  # max() skips a NaN
        if not np.isfinite(result.prefill_max_abs_error) or result.prefill_max_abs_error > limit or result.mismatches:
            differ = ("are not finite" if not np.isfinite(result.prefill_max_abs_error)
                      else f"differ by {result.prefill_max_abs_error:.4g} (limit {limit:.4g})")
            problems.append(f"row {r} ({len(prompt)} tokens after {longest - len(prompt)} of left padding): last "
                            f"prompt logits {differ}"
                            + (f", another token at decisive steps {result.mismatches}" if result.mismatches else ""))
    passed = not problems
    message = "" if passed else ("; ".join(problems) + ": the traced graph gives a left-padded row other logits than "
                                 "its prompt alone (the model's code, as transformers.exporters traced it, does not "
                                 "place or mask left padding as it runs a lone prompt); serve it one prompt at a time "
                                 "(batch 1), or export a model type with a hand-built architecture")
    return GateResult(
        "parity", check, passed, f"{worst:.3g} of the logit range",
        f"<= {PREFILL_TOLERANCE[dtype]} of the logit range, no other token outside near ties", message,
        details={"rows": [r.to_dict() for r in rows]}, informational=informational)
