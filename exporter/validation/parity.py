"""Numbers, not "it loaded": an export's logits and greedy tokens against the reference."""

from __future__ import annotations

import dataclasses

import numpy as np

from exporter.validation.reference import ReferenceRun
from exporter.runtime.session import Decoder


@dataclasses.dataclass
class ParityResult:
    prefill_max_abs_error: float
    logit_range: float
    steps: int
    mismatches: list[int]  # steps where the export's argmax differs and the reference is decisive
    near_ties: list[int]  # steps where the reference's top-1/top-2 gap is below the margin
    tie_mismatches: list[int]  # differing steps that are near ties (not counted as failures)
    tokens: list[int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_parity(
    lm: Decoder, ref: ReferenceRun, near_tie_margin: float, prefill_chunks: int = 1
) -> ParityResult:
    """Prefill (optionally in chunks) then decode teacher-forced on the reference's tokens.

    Teacher forcing compares every step on the same history, so one near-tie flip does not
    cascade into a different continuation that would hide (or fake) later mismatches.
    """
    state = lm.new_state()
    prompt = np.array([ref.prompt], dtype=np.int64)
    bounds = np.linspace(0, prompt.shape[1], prefill_chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        logits = lm.forward(prompt[:, a:b], state)
    last = logits[0, -1].astype(np.float32)
    prefill_err = float(np.max(np.abs(last - ref.prefill_logits)))
    tokens, mismatches, near_ties, tie_mismatches = [], [], [], []
    for i, expected in enumerate(ref.tokens):
        got = int(np.argmax(last))
        tokens.append(got)
        tie = ref.gaps[i] < near_tie_margin
        if tie:
            near_ties.append(i)
        if got != expected:
            (tie_mismatches if tie else mismatches).append(i)
        last = lm.forward(np.array([[expected]], dtype=np.int64), state)[0, -1].astype(np.float32)
    logit_range = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    return ParityResult(prefill_err, logit_range, len(ref.tokens), mismatches, near_ties, tie_mismatches, tokens)


def run_batch_parity(lm: Decoder, refs: list[ReferenceRun], near_tie_margin: float) -> list[ParityResult]:
    """Several prompts of different lengths in one batch, then teacher-forced decode of every row
    at once; each row is judged against its own reference run, as if it had run alone."""
    state = lm.new_state(batch=len(refs))
    last = lm.prefill([ref.prompt for ref in refs], state).astype(np.float32)
    steps = min(len(ref.tokens) for ref in refs)
    prefill_errors = [float(np.max(np.abs(last[r] - ref.prefill_logits))) for r, ref in enumerate(refs)]
    rows = [([], [], [], []) for _ in refs]  # tokens, mismatches, near ties, tie mismatches
    for i in range(steps):
        for r, ref in enumerate(refs):
            tokens, mismatches, near_ties, tie_mismatches = rows[r]
            got = int(np.argmax(last[r]))
            tokens.append(got)
            tie = ref.gaps[i] < near_tie_margin
            if tie:
                near_ties.append(i)
            if got != ref.tokens[i]:
                (tie_mismatches if tie else mismatches).append(i)
        last = lm.step([ref.tokens[i] for ref in refs], state).astype(np.float32)
    return [ParityResult(prefill_errors[r], float(ref.prefill_logits.max() - ref.prefill_logits.min()), steps,
                         rows[r][1], rows[r][2], rows[r][3], rows[r][0]) for r, ref in enumerate(refs)]
