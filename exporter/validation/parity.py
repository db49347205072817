"""Numbers, not "it loaded": an export's logits and greedy tokens against the reference."""

from __future__ import annotations

import dataclasses
import functools

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
    # departures that flipped near-tie expert choices explain (validation/routing.py: RoutingTie.to_dict), not failures
    routing_ties: list[dict] = dataclasses.field(default_factory=list)
    routing_tie_mismatches: list[int] = dataclasses.field(default_factory=list)  # differing steps among them

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExportRun:
    """The export's side of a parity run: its logits at the last prompt position and after every
    token fed, and the tokens it was fed (the reference's, teacher-forced, or its own choices)."""

    logits: list[np.ndarray]  # [vocab] fp32 each; len(fed) + 1 of them
    fed: list[int]

    @property
    def prefill_logits(self) -> np.ndarray:
        return self.logits[0]

    @functools.cached_property
    def chosen(self) -> list[int]:
        """The export's argmax at each step (step i reads the logits after ``fed[:i]``)."""
        return [int(np.argmax(step)) for step in self.logits[: len(self.fed)]]

    def follows(self, tokens: list[int]) -> bool:
        """Whether every step saw the history ``tokens`` gives it: then this run is the
        teacher-forced run on ``tokens``, input for input (the last token fed is read by no step)."""
        return len(self.fed) == len(tokens) and self.fed[:-1] == list(tokens[:-1])


def export_decode(lm: Decoder, prompt: list[int], steps: int, feed: list[int] | None = None,
                  prefill_chunks: int = 1, device_caches: bool = True) -> ExportRun:
    """Prefill ``prompt`` (optionally in chunks), then ``steps`` greedy steps through the export's
    cache, each feeding ``feed[i]`` (teacher forcing) or, without ``feed``, the export's own choice.
    The last token is fed too, though no step chooses from its logits: it writes the cache's last
    position, which at the shortest max_seq_len validation accepts is the buffer's last slot.
    ``device_caches`` keeps the caches where the session runs between steps, bound as a runtime
    binds them (``Decoder.forward_device``: on CUDA a host-fed GroupQueryAttention ran 10x slower;
    on the CPU a bound static buffer saves copying it both ways every step, 4.8 -> 3.9 s over 24
    steps of a 0.5B attn_static export); otherwise they are host arrays fed to every step."""
    if device_caches:
        state, forward = lm.new_device_state(len(prompt) + steps), lm.forward_device  # every token is fed
    else:
        state, forward = lm.new_state(), lm.forward
    ids = np.array([prompt], dtype=np.int64)
    bounds = np.linspace(0, ids.shape[1], prefill_chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = forward(ids[:, a:b], state)
    logits, fed = [out[0, -1].astype(np.float32)], []
    for i in range(steps):
        fed.append(int(feed[i]) if feed is not None else int(np.argmax(logits[-1])))
        logits.append(forward(np.array([[fed[-1]]], dtype=np.int64), state)[0, -1].astype(np.float32))
    return ExportRun(logits, fed)


def judge(run: ExportRun, ref: ReferenceRun, near_tie_margin: float) -> ParityResult:
    """The export's run against the reference's, step by step on the same history.

    Teacher forcing compares every step on the same history, so one near-tie flip does not
    cascade into a different continuation that would hide (or fake) later mismatches; a run that
    was fed anything else cannot be judged against ``ref``.
    """
    if not run.follows(ref.tokens):
        raise ValueError("the export's run was not fed the reference's tokens: decode it teacher-forced first")
    prefill_err = float(np.max(np.abs(run.prefill_logits - ref.prefill_logits)))
    mismatches, near_ties, tie_mismatches = [], [], []
    for i, (got, expected) in enumerate(zip(run.chosen, ref.tokens)):
        tie = ref.gaps[i] < near_tie_margin
        if tie:
            near_ties.append(i)
        if got != expected:
            (tie_mismatches if tie else mismatches).append(i)
    logit_range = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    return ParityResult(prefill_err, logit_range, len(ref.tokens), mismatches, near_ties, tie_mismatches,
                        list(run.chosen))


def run_parity(
    lm: Decoder, ref: ReferenceRun, near_tie_margin: float, prefill_chunks: int = 1
) -> ParityResult:
    """Prefill (optionally in chunks) then decode teacher-forced on the reference's tokens, and judge."""
    run = export_decode(lm, ref.prompt, len(ref.tokens), ref.tokens, prefill_chunks)
    return judge(run, ref, near_tie_margin)


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
