"""The yardstick's verdicts (exporter/validation/yardstick.py, gates/parity.py) on made-up runs whose departures are
known: transformers in a half precision holds a model only where every teacher-forced step stays within the dtype's
tolerance, not the prefill alone (a mixture of experts' router near tie moves a later step as far), and an unsafe bf16
where fp16 holds the model is told to export fp16."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.validation.gates.parity import NEAR_TIE_MARGIN, PREFILL_TOLERANCE, parity_gates, verdict
from exporter.validation.parity import ExportRun
from exporter.validation.reference import ReferenceRun, top2_gap
from exporter.validation.yardstick import drift, sound

STEPS, VOCAB = 6, 50


@pytest.fixture
def ref() -> ReferenceRun:
    rng = np.random.default_rng(0)
    logits = [rng.normal(0, 3, VOCAB).astype(np.float32) for _ in range(STEPS)]
    for row in logits:  # every step's top-1 a clear winner: no near tie anywhere
        row[int(np.argmax(row))] += 5
    return ReferenceRun([1, 2, 3], logits[0], [int(np.argmax(r)) for r in logits], logits, [top2_gap(r) for r in logits])


def moved(ref: ReferenceRun, step: int, fraction: float) -> list[np.ndarray]:
    """ref's logits with one step's lowest logit moved by ``fraction`` of the prefill range (no token changes)."""
    span = float(np.ptp(ref.prefill_logits))
    rows = [r.copy() for r in ref.step_logits]
    rows[step][int(np.argmin(rows[step]))] -= fraction * span
    return rows


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_step_beyond_the_tolerance_makes_the_yardstick_unsound_though_its_prefill_is_close(ref, dtype):
    tolerance = PREFILL_TOLERANCE[dtype]
    late = drift("transformers", dtype, moved(ref, 3, 1.5 * tolerance), ref)
    assert late.prefill_max_abs_error == 0 and late.flips == []
    assert not sound(late, ref, tolerance, NEAR_TIE_MARGIN[dtype])
    within = drift("transformers", dtype, moved(ref, 3, 0.5 * tolerance), ref)
    assert sound(within, ref, tolerance, NEAR_TIE_MARGIN[dtype])
    early = drift("transformers", dtype, moved(ref, 0, 1.5 * tolerance), ref)  # the prefill, as before
    assert not sound(early, ref, tolerance, NEAR_TIE_MARGIN[dtype])


def test_unsafe_bf16_where_fp16_holds_the_model_is_told_to_export_fp16(ref):
    bf16 = drift("transformers", "bf16", moved(ref, 4, 0.3), ref)
    fp16 = drift("transformers", "fp16", moved(ref, 4, 0.01), ref)
    said = verdict("bf16", bf16, fp16, ref, "cuda")
    assert said.startswith("bf16 is unsafe for this model: transformers itself in bf16 flips no token, logits within")
    assert said.endswith(": export fp16"), said
    also = drift("transformers", "fp16", moved(ref, 4, 0.3), ref)  # neither holds it
    assert verdict("bf16", bf16, also, ref, "cuda").endswith("export fp32")
    assert verdict("fp16", also, bf16, ref, "cuda").endswith("export fp32")


def test_an_unsound_yardstick_gives_no_measured_margin_and_the_export_is_told_the_dtype(ref):
    """The export departs at its prefill; transformers in bf16 departs as far at a later step: the failure says bf16
    cannot hold the model rather than blaming the export, and the near-tie margin stays the dtype's fixed one."""
    export = ExportRun(moved(ref, 0, 0.25), list(ref.tokens))
    yard = drift("transformers", "bf16", [r.copy() for r in moved(ref, 4, 0.25)], ref)
    yard.gap_errors = [e + 1.0 for e in yard.gap_errors]  # it moves the gaps widely: a measured margin would be 2+
    gates, result = parity_gates(export, ref, "bf16", yard, None, prompt="text only", ep="cuda")
    [prefill] = [g for g in gates if g.check.startswith("prefill logits")]
    assert prefill.status == "fail" and "bf16 is unsafe for this model" in prefill.message
    [decode] = [g for g in gates if g.check.startswith("greedy decode")]
    assert decode.details["measured_margin"] is None and decode.details["near_tie_margin"] == NEAR_TIE_MARGIN["bf16"]
    sound_yard = drift("transformers", "bf16", [r.copy() for r in ref.step_logits], ref)
    gates, _ = parity_gates(export, ref, "bf16", sound_yard, None, prompt="text only", ep="cuda")
    [prefill] = [g for g in gates if g.check.startswith("prefill logits")]
    assert "the export's departure is its own" in prefill.message
