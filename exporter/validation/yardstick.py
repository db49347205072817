"""transformers itself in a half-precision export's dtype, beside the fp32 reference: the yardstick
that says whether a half-precision export's drift is the dtype's or the export's own.

An fp16 or bf16 export is judged against the fp32 reference. Where it departs, the question a user
has is whether the dtype can hold the model at all: transformers' own model in that dtype, run on
the reference's tokens on the same device as the reference (streamed, ``StreamedReference`` with
``dtype``), answers it. Its drift from fp32 is measured the way the export's is (the largest logit
error, the steps whose argmax flips and the fp32 top-1/top-2 gap there), with the largest hidden
state between its decoder layers and the first layer whose output is not finite:

- the yardstick is *sound* when its logits are finite, its error at every step (the prefill's last
  position and each teacher-forced step) is within the dtype's tolerance of the prefill's logit range
  and it flips no token where the fp32 gap is wider than the dtype's fixed margin; then a
  step whose fp32 gap is within twice the largest change half precision made to that gap at any
  step (``tie_margin``) is a near tie for this model in this dtype, measured rather than assumed;
- otherwise the dtype is unsafe for the model, and a failing export says so and names the dtype
  whose yardstick is sound (``other_dtype``), instead of a bare step number.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from exporter.validation.reference import ReferenceRun, _rope_switch, cached_steps

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
LARGEST = {"fp16": 65504.0, "bf16": 3.3895313892515355e38}
OTHER = {"fp16": "bf16", "bf16": "fp16"}


@dataclasses.dataclass
class Drift:
    """One run's departure from the fp32 reference on the reference's tokens (teacher-forced)."""

    run: str  # "export" or "transformers"
    dtype: str
    prefill_max_abs_error: float
    step_errors: list[float]  # the largest logit error at each step
    gap_errors: list[float]  # |its gap between the reference's top-1 and top-2 tokens - the reference's gap|
    flips: list[int]  # steps where its argmax is not the reference's token
    flip_gaps: list[float]  # the fp32 top-1/top-2 gap at each of those steps
    nonfinite_steps: list[int]  # steps (0 is the prefill's last position) with a non-finite logit
    overflow_layer: int | None = None  # the first decoder layer whose output is not finite
    peak_activation: float | None = None  # the largest finite |hidden state| between decoder layers
    peak_layer: int | None = None
    device: str | None = None

    @property
    def finite(self) -> bool:
        return not self.nonfinite_steps and self.overflow_layer is None

    def tie_margin(self) -> float | None:
        """Twice the largest change this run made to the reference's top-1/top-2 gap: a flip where
        the fp32 gap is narrower is within what the dtype does to this model (None: not finite)."""
        finite = [e for e in self.gap_errors if math.isfinite(e)]
        if not self.finite or not finite:
            return None
        return 2.0 * max(finite)

    def decisive_flips(self, margin: float) -> list[int]:
        return [s for s, gap in zip(self.flips, self.flip_gaps) if gap >= margin]

    def describe(self) -> str:
        """What departed, in a clause: "overflows to non-finite logits from step 0 (first in decoder
        layer 3)", "flips steps [4, 9] (fp32 gaps 0.21, 3.4), logits within 0.06"."""
        if not self.finite:
            where = f" (first in decoder layer {self.overflow_layer})" if self.overflow_layer is not None else ""
            steps = f" from step {self.nonfinite_steps[0]}" if self.nonfinite_steps else ""
            return f"overflows to non-finite values{steps}{where}"
        if self.flips:
            gaps = ", ".join(f"{g:.3g}" for g in self.flip_gaps)
            return f"flips steps {self.flips} (fp32 gaps {gaps}), logits within {max(self.step_errors):.3g}"
        return f"flips no token, logits within {max(self.step_errors, default=self.prefill_max_abs_error):.3g}"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tie_margin"] = self.tie_margin()
        return out


def drift(run: str, dtype: str, logits: list[np.ndarray], ref: ReferenceRun) -> Drift:
    """``logits[i]`` (the logits that choose step i's token, on the reference's history) against ``ref``."""
    if len(logits) != len(ref.tokens) or len(ref.step_logits) != len(ref.tokens) or not ref.tokens:
        raise ValueError(f"{run}: {len(logits)} steps of logits against a reference run of {len(ref.tokens)} tokens "
                         f"({len(ref.step_logits)} logits)")
    errors, gap_errors, flips, flip_gaps, nonfinite = [], [], [], [], []
    for i, (got, expected) in enumerate(zip(logits, ref.step_logits)):
        got = np.asarray(got, np.float64)
        if not np.isfinite(got).all():
            nonfinite.append(i)
            errors.append(math.inf)
            gap_errors.append(math.inf)
            continue
        errors.append(float(np.max(np.abs(got - expected))))
        top = np.argpartition(expected, -2)[-2:]
        first, second = (top[1], top[0]) if expected[top[1]] >= expected[top[0]] else (top[0], top[1])
        gap_errors.append(abs(float(got[first] - got[second]) - ref.gaps[i]))
        if int(np.argmax(got)) != ref.tokens[i]:
            flips.append(i)
            flip_gaps.append(ref.gaps[i])
    prefill = np.asarray(logits[0], np.float64) if logits else np.zeros(0)
    prefill_error = float(np.max(np.abs(prefill - ref.prefill_logits))) if np.isfinite(prefill).all() else math.inf
    return Drift(run, dtype, prefill_error, errors, gap_errors, flips, flip_gaps, nonfinite)


def sound(yardstick: Drift, ref: ReferenceRun, prefill_tolerance: float, fixed_margin: float) -> bool:
    """Whether transformers in this dtype holds the model: finite, its error at the prefill and at every
    teacher-forced step within the dtype's tolerance of the reference's (prefill) logit range, no flip
    where the fp32 gap is wider than the dtype's fixed margin. The steps count as the prefill does: a
    mixture of experts whose routing flips under the dtype's rounding at a later token (a router near
    tie) moves that step's logits as far as a prefill departure (the tiny qwen3_5_moe's text prompt on the
    H100: transformers' own bf16 within 0.15 at the prefill, h100/moe_routing_check_qwen3_5_moe_cuda.json,
    and 3.1 off at a later step on a range of 14.7, the failure message in h100/vlm_cuda_issue48_stop58.json).
    Where it is not sound, the export's near-tie margin is the dtype's fixed one, never the measured one."""
    span = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    limit = prefill_tolerance * span
    return (yardstick.finite and yardstick.prefill_max_abs_error <= limit
            and max(yardstick.step_errors, default=0.0) <= limit and not yardstick.decisive_flips(fixed_margin))


def measure(checkpoint: Path, device: str, dtype: str, ref: ReferenceRun) -> Drift:
    """transformers' model of ``checkpoint`` in ``dtype`` (fp16 / bf16) on ``device``, fed the
    reference's prompt and tokens in one pass (through its cache, a token a pass, where a longrope
    model crosses its switch, as the reference was run), against ``ref``."""
    import torch

    from exporter.validation.streamed import StreamedReference

    model = StreamedReference(Path(checkpoint), device, dtype=TORCH_DTYPES[dtype])
    model.watch = []
    try:
        tokens = list(ref.prompt) + list(ref.tokens[:-1])
        switch = _rope_switch(model.config)
        if switch is not None and len(ref.prompt) <= switch < len(tokens) + 1:
            _, logits = cached_steps(model, ref.prompt, len(ref.tokens), ref.tokens)
        else:
            out = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
            logits = list(out.logits[0, len(ref.prompt) - 1:].float().numpy())
        watched = list(model.watch)
    finally:
        model.close()
    result = drift("transformers", dtype, logits, ref)
    result.device = str(model.device)
    overflow = [layer for layer, _, finite in watched if not finite]
    result.overflow_layer = min(overflow) if overflow else None
    peaks = [(peak, layer) for layer, peak, finite in watched if finite and math.isfinite(peak)]
    if peaks:
        result.peak_activation, result.peak_layer = max(peaks)
    return result


def cached_measure(cache_dir: Path | None, revision: str, checkpoint: Path, ep: str, dtype: str, *,
                   ref: ReferenceRun, shared=None) -> Drift:
    """``measure`` on the device the reference runs on for ``ep``, kept beside the reference runs
    (per checkpoint revision, prompt, tokens, dtype, device kind and versions; and in ``shared``)."""
    from exporter.runtime.device import cuda_device
    from exporter.validation import reference
    from exporter.validation.streamed import reference_device

    device = reference_device(ep, cuda_device())
    path = None
    if cache_dir is not None:
        what = f"yardstick-{dtype}-{device.split(':')[0]}"
        path = Path(cache_dir) / f"{what}-{reference._cache_key(revision, what, list(ref.prompt) + list(ref.tokens), len(ref.tokens))}.npz"
        found = reference._lookup(path, lambda data: _read(data, dtype, ref), shared)
        if found is not None:
            return found
    result = measure(checkpoint, device, dtype, ref)
    reference._keep(path, shared, **_arrays(result))
    return result


_FIELDS = ("prefill_max_abs_error", "step_errors", "gap_errors", "flips", "flip_gaps", "nonfinite_steps")


def _arrays(result: Drift) -> dict[str, np.ndarray]:
    arrays = {name: np.asarray(getattr(result, name), np.float64) for name in _FIELDS}
    arrays["activations"] = np.array([np.nan if result.overflow_layer is None else result.overflow_layer,
                                      np.nan if result.peak_activation is None else result.peak_activation,
                                      np.nan if result.peak_layer is None else result.peak_layer], np.float64)
    arrays["device"] = np.frombuffer(str(result.device).encode(), np.uint8)
    return arrays


def _read(data: dict | None, dtype: str, ref: ReferenceRun) -> Drift | None:
    if data is None or not {*_FIELDS, "activations", "device"} <= set(data):
        return None
    values = {name: data[name].tolist() for name in _FIELDS}
    if len(values["step_errors"]) != len(ref.tokens):
        return None
    overflow, peak, peak_layer = data["activations"].tolist()
    return Drift("transformers", dtype, float(values["prefill_max_abs_error"]), values["step_errors"],
                 values["gap_errors"], [int(s) for s in values["flips"]], values["flip_gaps"],
                 [int(s) for s in values["nonfinite_steps"]],
                 None if math.isnan(overflow) else int(overflow), None if math.isnan(peak) else peak,
                 None if math.isnan(peak_layer) else int(peak_layer), bytes(data["device"]).decode())
