"""The transformers reference: its load path and its draft-checked greedy run against the plain ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporter.validation.parity import ExportRun, judge
from exporter.validation.reference import load_reference, reference_greedy
from tests.conftest import ARCHITECTURES

STEPS = 24


def _prompt(n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(n).integers(3, 250, size=n)]


class _Counted:
    """The model with its forward passes counted (each pass reads every weight once)."""

    def __init__(self, model):
        self.model, self.passes = model, 0
        self.forward = model.forward

    def __call__(self, **kwargs):
        self.passes += 1
        return self.model(**kwargs)


def _assert_same_run(got, want):
    assert got.tokens == want.tokens
    assert got.prompt == want.prompt and len(got.step_logits) == len(want.step_logits) == STEPS
    span = float(want.prefill_logits.max() - want.prefill_logits.min())
    # One pass over the whole sequence and one pass per token compute the same sums in another
    # order: equal to fp32 rounding, far inside every parity tolerance (1e-4 of the span for fp32).
    np.testing.assert_allclose(got.prefill_logits, want.prefill_logits, rtol=0, atol=1e-5 * span)
    for a, b in zip(got.step_logits, want.step_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * span)
    np.testing.assert_allclose(got.gaps, want.gaps, rtol=0, atol=1e-5 * span)


# gemma2 mixes sliding-window and global layers, phi3 has fused projections: a one-pass check must
# see the same logits there as token-by-token decoding.
@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_a_draft_checked_in_one_pass_gives_the_reference_s_own_greedy_run(checkpoint, arch):
    model = load_reference(checkpoint(arch))
    prompt = _prompt()
    plain = reference_greedy(model, prompt, STEPS)

    counted = _Counted(model)
    checked = reference_greedy(counted, prompt, STEPS, draft=plain.tokens)
    _assert_same_run(checked, plain)
    assert counted.passes == 1  # the whole draft in one forward pass

    # A draft that departs at step 5 (an export that went wrong there): the reference keeps its own
    # tokens, decoding on from step 6 one token at a time.
    wrong = list(plain.tokens)
    wrong[5] = (wrong[5] + 1) % 250
    counted = _Counted(model)
    _assert_same_run(reference_greedy(counted, prompt, STEPS, draft=wrong), plain)
    assert counted.passes == 1 + 1 + (STEPS - 7)  # the check, the history to step 6, then one per step

    for draft in ([(t + 7) % 250 for t in plain.tokens], plain.tokens[:3]):  # all wrong; too short
        _assert_same_run(reference_greedy(model, prompt, STEPS, draft=draft), plain)


# hidden 96: sqrt(96) is not a bf16 number, so a scale computed in the load dtype would show.
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_reference_loads_in_the_checkpoint_dtype_and_casts_to_exactly_the_direct_load(checkpoint, arch):
    """Loading bf16 weights and casting the model to fp32 gives the parameters and buffers (rotary
    inv_freq, Gemma's embedding scale) that loading straight into fp32 gives, bit for bit."""
    from transformers import AutoModelForCausalLM

    heads = {"num_attention_heads": 6} if arch == "phi3" else {}  # phi3: head_dim = hidden / heads stays 16
    source = checkpoint(arch, dtype="bfloat16", hidden_size=96, **heads)
    direct = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    loaded = load_reference(source)
    want = dict(direct.state_dict()) | dict(direct.named_buffers())
    got = dict(loaded.state_dict()) | dict(loaded.named_buffers())
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    prompt = torch.tensor([_prompt()])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=prompt).logits, direct(input_ids=prompt).logits)


def test_parity_refuses_to_judge_a_run_that_saw_another_history(checkpoint):
    ref = reference_greedy(load_reference(checkpoint("llama")), _prompt(), 4)
    logits = [*ref.step_logits, ref.step_logits[-1]]  # the reference's own choices, step by step
    followed = ExportRun(logits, list(ref.tokens))
    assert judge(followed, ref, 0.0).mismatches == []
    strayed = ExportRun(logits, [ref.tokens[0], ref.tokens[1] + 1, *ref.tokens[2:]])
    unfed = ExportRun(logits, [])
    for run in (strayed, unfed):
        with pytest.raises(ValueError, match="teacher-forced"):
            judge(run, ref, 0.0)
