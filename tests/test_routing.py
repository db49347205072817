"""Router near ties (exporter/validation/routing.py) on tiny mixtures of experts, with departures planted by taking
near-tie expert choices of transformers' fp32 model the other way: one flip at the prefill is found and named; two
flips at later teacher-forced steps are found, the second on top of the first; departures no flips make (another
token, or the same token by a distance no flip gives) are not explained; flips that contradict the export at a step
they reach explain nothing; the parity gates pass an explained departure and say why; the text path replays on the
streamed reference; and an fp16 image-text export of the tiny qwen3_5_moe, validated on this CPU, passes with any
decisive departure named a router near tie."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporter.validation import routing
from exporter.validation.gates.parity import parity_gates
from exporter.validation.parity import ExportRun
from exporter.validation.reference import ReferenceRun, top2_gap

torch = pytest.importorskip("torch")

CASE = "qwen3_5_moe_genai"
CONTINUATION = 12  # teacher-forced tokens after the prompt


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the checkpoint, transformers' fp32 model, the text-only validation prompt and a continuation as inputs, the
    prompt's length)."""
    from exporter.validation.image_text import image_prompt, load_image_text_reference
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    checkpoint = make_tiny_vlm_checkpoint(CASE, tmp_path_factory.mktemp("moe") / CASE)
    model = load_image_text_reference(checkpoint)
    config = model.config
    vocab = config.get_text_config().vocab_size
    prompt = image_prompt(0, 0, config.image_token_id, vocab, seed=0)
    drawn = [int(t) for t in np.random.default_rng(5).integers(3, vocab, CONTINUATION) if t != config.image_token_id]
    return checkpoint, model, {"input_ids": torch.tensor([prompt + drawn])}, len(prompt)


def reference_of(plain: np.ndarray, inputs: dict, first: int) -> ReferenceRun:
    """The reference run whose teacher-forced tokens ``inputs`` holds after position ``first``, its logits ``plain``."""
    ids = inputs["input_ids"][0].tolist()
    steps = [plain[p] for p in range(first, len(ids))]
    tokens = ids[first + 1:] + [int(np.argmax(plain[-1]))]
    return ReferenceRun(ids[:first + 1], steps[0], tokens, steps, [top2_gap(s) for s in steps])


def test_a_flip_at_the_prefill_is_found_and_named(moe):
    _, model, inputs, length = moe
    first = length - 1
    plain, seen, renormalize = routing.router_logits(model, {"input_ids": inputs["input_ids"][:, :length]})
    prompt_inputs = {"input_ids": inputs["input_ids"][:, :length]}
    [flip, *_] = routing.near_ties(model, seen, first, 0.5)
    flipped, _ = routing.replay(model, prompt_inputs, [flip], renormalize)
    moved = float(np.abs(flipped[-1] - plain[-1]).max())
    assert flip.margin < 0.1 and moved > 1.0  # one choice moves the last logits far (the tiny checkpoint's 0.052: 3.6)
    ref = reference_of(plain, prompt_inputs, first)
    [tie] = routing.explain(model, prompt_inputs, first, [flipped[-1]], ref, [0], 0.5, 0.2 * np.ptp(plain[-1])).values()
    assert tie.step == 0 and tie.flips == [flip] and tie.replay_error == 0.0
    assert tie.departure == pytest.approx(moved)
    assert tie.describe().startswith(f"router near ties (decoder layer {flip.layer}'s experts at token {flip.token}")
    # a bar below its margin: not a near tie, nothing replayed
    assert routing.explain(model, prompt_inputs, first, [flipped[-1]], ref, [0], flip.margin / 2, 100.0) == {}


def planted_pair(model, inputs, first):
    """Two near-tie flips and a step each departs at: the first at a prompt token, moving the prefill (step 0); the
    second a near tie of the run with the first, at a continuation token, moving a later step where the first alone
    does not explain the two (its error there at least half the distance from fp32). (plain logits, the flips, that
    step, both flips' logits, the largest margin of the two.)"""
    plain, seen, renormalize = routing.router_logits(model, inputs)
    last = inputs["input_ids"].shape[1] - 1
    for one in [f for f in routing.near_ties(model, seen, last, 0.5) if f.token <= first][:6]:
        once, once_seen = routing.replay(model, inputs, [one], renormalize)
        if np.abs(once[first] - plain[first]).max() < 0.3:
            continue
        for two in [f for f in routing.near_ties(model, once_seen, last, 0.5, [one]) if f.token > first][:10]:
            both, _ = routing.replay(model, inputs, [one, two], renormalize)
            for p in range(two.token, last + 1):
                away = float(np.abs(both[p] - plain[p]).max())
                if away > 0.3 and float(np.abs(once[p] - both[p]).max()) >= away / 2:
                    return plain, one, two, p - first, both, max(one.margin, two.margin)
    pytest.fail("no pair of near-tie flips of the tiny qwen3_5_moe moves two steps")


def test_two_flips_at_later_steps_are_found_the_second_on_top_of_the_first(moe):
    _, model, inputs, length = moe
    first = length - 1
    plain, one, two, later, both, margin = planted_pair(model, inputs, first)
    ref = reference_of(plain, inputs, first)
    export = [both[first + s] for s in range(len(ref.tokens))]
    tolerance = 0.2 * float(np.ptp(plain[first]))  # bf16's
    ties = routing.explain(model, inputs, first, export, ref, [0, later], margin + 1e-3, tolerance)
    assert sorted(ties) == [0, later]
    assert ties[0].flips == [one] and ties[0].replay_error == 0.0
    # the later step on top of the first flip: by the planted second one, or by another near tie of that run at a
    # token it reaches that brings fp32 as near (the replay shows choices that reproduce the export, not which)
    assert len(ties[later].flips) == 2 and one in ties[later].flips
    [second] = [f for f in ties[later].flips if f != one]
    assert first < second.token <= first + later and second.margin <= margin
    assert ties[later].replay_error < ties[later].departure / 2 and ties[later].replay_error <= tolerance
    print(f"planted {two}, found {second}")


def test_flips_that_leave_the_export_worse_off_where_they_reach_explain_nothing(moe):
    """The same planted pair, but the export at one step the first flip reaches (not a departure it is named for)
    equal to plain fp32's logits there: that flip moves the step away from the export beyond the tolerance, where fp32
    is on it, so it is not kept and the prefill is not explained (the later step may be, by a flip that leaves that
    step alone); with the export there as the flips give it, both are."""
    _, model, inputs, length = moe
    first = length - 1
    plain, one, _, later, both, margin = planted_pair(model, inputs, first)
    ref = reference_of(plain, inputs, first)
    export = [both[first + s].copy() for s in range(len(ref.tokens))]
    moved = {s: float(np.abs(both[first + s] - plain[first + s]).max()) for s in range(1, len(export)) if s != later}
    step = max(moved, key=moved.get)
    tolerance = moved[step] / 2
    export[step] = plain[first + step]
    ties = routing.explain(model, inputs, first, export, ref, [0, later], margin + 1e-3, tolerance)
    assert 0 not in ties and all(one not in tie.flips for tie in ties.values())
    export[step] = both[first + step]
    ties = routing.explain(model, inputs, first, export, ref, [0, later], margin + 1e-3, tolerance)
    assert sorted(ties) == [0, later]


@pytest.mark.parametrize("token", ["another", "same"])
def test_a_departure_no_flips_make_is_not_explained(moe, token):
    _, model, inputs, length = moe
    prompt_inputs = {"input_ids": inputs["input_ids"][:, :length]}
    plain, _, _ = routing.router_logits(model, prompt_inputs)
    wrong = plain[-1].copy()
    span = float(np.ptp(wrong))
    if token == "another":
        wrong[int(np.argmin(wrong))] += span + 1  # another token, by a margin no flip gives
    else:
        wrong += np.random.default_rng(0).normal(0, 0.25 * span, wrong.shape).astype(np.float32)
        wrong[int(np.argmax(plain[-1]))] = wrong.max() + 1  # the same token, logits far from fp32's everywhere
    ref = reference_of(plain, prompt_inputs, length - 1)
    assert routing.explain(model, prompt_inputs, length - 1, [wrong], ref, [0], 0.5, 10 * span) == {}


def test_the_parity_gates_pass_an_explained_departure_and_name_it(moe):
    _, model, inputs, length = moe
    prompt_inputs = {"input_ids": inputs["input_ids"][:, :length]}
    plain, seen, renormalize = routing.router_logits(model, prompt_inputs)
    [flip, *_] = routing.near_ties(model, seen, length - 1, 0.5)
    flipped, _ = routing.replay(model, prompt_inputs, [flip], renormalize)
    ref = ReferenceRun(prompt_inputs["input_ids"][0].tolist(), plain[-1], [int(np.argmax(plain[-1]))], [plain[-1]],
                       [top2_gap(plain[-1])])
    run = ExportRun([flipped[-1], flipped[-1]], ref.tokens)
    ties = routing.explain_run(model, prompt_inputs, run, ref, "bf16")
    failed, _ = parity_gates(run, ref, "bf16", prompt="text only")
    passed, result = parity_gates(run, ref, "bf16", prompt="text only", routing_ties=ties)
    [before] = [g for g in failed if g.check.startswith("prefill")]
    [after] = [g for g in passed if g.check.startswith("prefill")]
    assert not before.passed and "router near ties" not in before.message  # 3.6 on a range of 14.7: beyond 20%
    assert after.passed and "router near ties (decoder layer" in after.message
    assert result.routing_ties == [ties[0].to_dict()]


def test_the_text_path_replays_on_the_streamed_reference(checkpoint):
    """A text export's departure (validate._routing_ties): the streamed reference (one layer's weights at a time) gives
    the whole model's router logits and replays, and a planted flip beyond fp16's tolerance is found on it."""
    from types import SimpleNamespace

    import transformers

    from exporter.validation.streamed import StreamedReference
    from exporter.validation.validate import _routing_ties

    source = checkpoint("qwen3_moe")
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    streamed = StreamedReference(source, "cpu")
    inputs = {"input_ids": torch.tensor([[int(t) for t in np.random.default_rng(40).integers(3, 200, 40)]])}
    try:
        (plain, seen, renormalize), (s_plain, s_seen, s_renormalize) = (
            routing.router_logits(m, inputs) for m in (whole, streamed))
        np.testing.assert_allclose(s_plain, plain, atol=1e-5)
        assert renormalize == s_renormalize and all(np.allclose(a, b, atol=1e-5) for a, b in zip(seen, s_seen))
        span = float(np.ptp(plain[-1]))
        planted = None
        for flip in routing.near_ties(whole, seen, 39, 0.1):
            flipped, _ = routing.replay(whole, inputs, [flip], renormalize)
            if np.abs(flipped[-1] - plain[-1]).max() > 0.1 * span:
                planted = flip
                break
        assert planted is not None, "no near-tie flip of the tiny qwen3_moe moves the last logits beyond 10% of the range"
        np.testing.assert_allclose(routing.replay(streamed, inputs, [planted], renormalize)[0], flipped, atol=1e-5)
    finally:
        streamed.close()
    ref = ReferenceRun(inputs["input_ids"][0].tolist(), plain[-1], [int(np.argmax(plain[-1]))], [plain[-1]],
                       [top2_gap(plain[-1])])
    run = ExportRun([flipped[-1], flipped[-1]], ref.tokens)
    opened, timings = [], {}
    ties = _routing_ties("fp16", run, ref, SimpleNamespace(path=source), "cpu", opened, timings)
    for model in opened:
        model.close()
    assert isinstance(opened[0], StreamedReference) and timings["routing_replay"] > 0
    [tie] = ties.values()
    assert tie.step == 0 and planted in tie.flips and tie.replay_error < 1e-4
    # the same run judged as fp32 (no half-precision departure to explain): nothing replayed
    assert _routing_ties("fp32", run, ref, SimpleNamespace(path=source), "cpu", [], {}) == {}


def test_an_fp16_image_text_export_passes_with_its_routing_departures_named(moe, tmp_path):
    """On this CPU the two-image prompt departs at step 16 (a router margin of 0.054 at that step's token); on
    another CPU it may not depart at all: the export passes either way, and each named departure is a near tie."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    checkpoint = moe[0]
    request = ExportRequest(model=str(checkpoint), dtype="fp16", ep="cpu", variant="gqa", max_seq_len=192)
    result = export_model(request, tmp_path / "export", validate=True)
    report = json.loads((result.out_dir / "parity_report.json").read_text())
    assert report["status"] == "passed", report["failed_gates"]
    for run in report["components"]["end_to_end"]:
        assert not run["mismatches"]
        for tie in run["routing_ties"]:  # each named departure: near-tie margins, the replay close to the export
            assert all(flip["margin"] < 0.1 for flip in tie["flips"])
            assert tie["replay_error"] <= tie["tolerance"] and tie["replay_error"] < tie["departure"] / 2
    print("routing ties:", [(r["prompt"], r["routing_ties"]) for r in report["components"]["end_to_end"]])
    markdown = (result.out_dir / "parity_report.md").read_text()
    assert ("Router near ties" in markdown) == any(r["routing_ties"] for r in report["components"]["end_to_end"])


@pytest.mark.parametrize("arch, replayable", [("mixtral", [True, True]), ("qwen2_moe", [False]),
                                              ("ernie4_5_moe", None), ("deepseek_v3", None)])
def test_only_routers_whose_weights_are_their_softmax_top_k_are_replayed(checkpoint, arch, replayable):
    """softmax -> top k (renormalized or not) is replayed; ernie4_5_moe's biased choice and deepseek_v3's grouped
    sigmoid routing are not (router_logits gives None, and a departure is left as it is)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint(arch)), dtype=torch.float32).eval()
    inputs = {"input_ids": torch.tensor([list(range(3, 20))])}
    assert routing.routers(model)  # each has top-k routers at mlp.gate
    found = routing.router_logits(model, inputs)
    assert (found[2] if found is not None else None) == replayable
    if replayable is None:
        assert routing.explain(model, inputs, 16, [np.zeros(8)], None, [0], 0.5, 1.0) == {}
