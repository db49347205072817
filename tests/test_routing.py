"""Router near ties (exporter/validation/routing.py) on the tiny qwen3_5_moe image-text checkpoint: a departure made
by flipping one near-tie expert choice of transformers' fp32 model is found and named by the replay; a departure no
single flip makes is not; the parity gates pass an explained departure and say why; and an fp16 image-text export of
the checkpoint, validated on this CPU, passes with any decisive departure named as a router near tie."""

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


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the checkpoint, transformers' fp32 model, the text-only validation prompt's inputs, its length)."""
    from exporter.validation.image_text import image_prompt, load_image_text_reference
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    checkpoint = make_tiny_vlm_checkpoint(CASE, tmp_path_factory.mktemp("moe") / CASE)
    model = load_image_text_reference(checkpoint)
    config = model.config
    prompt = image_prompt(0, 0, config.image_token_id, config.get_text_config().vocab_size, seed=0)
    return checkpoint, model, {"input_ids": torch.tensor([prompt])}, len(prompt)


def smallest_margin(model, inputs) -> tuple[float, int, int, int, bool]:
    """(margin, layer, token, the (k+1)-th expert, renormalizes) of the prompt's nearest routing tie."""
    _, seen = routing.router_logits(model, inputs)
    rows = []
    for layer, (logits, renormalize) in enumerate(seen):
        k = routing.routers(model)[layer].top_k
        order = np.argsort(-logits, axis=-1, kind="stable")
        ranked = np.take_along_axis(logits, order, axis=-1)
        rows += [(float(ranked[t, k - 1] - ranked[t, k]), layer, t, int(order[t, k]), renormalize)
                 for t in range(len(logits))]
    return min(rows)


def test_a_flipped_near_tie_choice_is_found_by_its_replay(moe):
    _, model, inputs, length = moe
    margin, layer, token, expert, renormalize = smallest_margin(model, inputs)
    plain, _ = routing.router_logits(model, inputs)
    flipped = routing.replay(model, inputs, [(layer, token, expert)], [renormalize] * 2)
    moved = float(np.abs(flipped[-1] - plain[-1]).max())
    assert margin < 0.5 and moved > 1.0  # one choice moves the last logits far (the tiny checkpoint's 0.052: 3.6)
    span = float(np.ptp(plain[-1]))
    [tie] = routing.explain(model, inputs, length - 1, {0: flipped[-1]}, 0.5, 0.2 * span).values()
    [flip] = tie.flips
    assert (tie.step, flip.layer, flip.token, flip.margin) == (0, layer, token, round(margin, 4))
    assert tie.replay_error == 0.0 and tie.departure == pytest.approx(moved)
    assert expert in flip.flipped and expert not in flip.experts
    assert tie.describe().startswith(f"router near ties (layer {layer}'s experts at token {token}")
    # a margin wider than the bar is not a near tie: nothing to replay, nothing explained
    assert routing.explain(model, inputs, length - 1, {0: flipped[-1]}, margin / 2, 0.2 * span) == {}


def test_a_departure_no_single_flip_makes_is_not_explained(moe):
    _, model, inputs, length = moe
    plain, _ = routing.router_logits(model, inputs)
    wrong = plain[-1].copy()
    wrong[int(np.argmin(wrong))] += float(np.ptp(wrong)) + 1  # another token, by a margin no flip gives
    assert routing.explain(model, inputs, length - 1, {0: wrong}, 0.5, 0.2 * float(np.ptp(plain[-1]))) == {}


def test_the_parity_gates_pass_an_explained_departure_and_name_it(moe):
    _, model, inputs, length = moe
    margin, layer, token, expert, renormalize = smallest_margin(model, inputs)
    plain, _ = routing.router_logits(model, inputs)
    flipped = routing.replay(model, inputs, [(layer, token, expert)], [renormalize] * 2)
    ref = ReferenceRun(inputs["input_ids"][0].tolist(), plain[-1], [int(np.argmax(plain[-1]))], [plain[-1]],
                       [top2_gap(plain[-1])])
    run = ExportRun([flipped[-1], flipped[-1]], ref.tokens)
    span = float(np.ptp(plain[-1]))
    ties = routing.explain(model, inputs, length - 1, {0: flipped[-1]}, 0.5, 0.2 * span)
    failed, _ = parity_gates(run, ref, "bf16", prompt="text only")
    passed, result = parity_gates(run, ref, "bf16", prompt="text only", routing_ties=ties)
    [before] = [g for g in failed if g.check.startswith("prefill")]
    [after] = [g for g in passed if g.check.startswith("prefill")]
    assert not before.passed and "router near ties" not in before.message  # 3.6 on a range of 14.7: beyond 20%
    assert after.passed and "router near ties (layer" in after.message
    assert result.routing_ties == [ties[0].to_dict()]


def test_an_fp16_image_text_export_passes_with_its_routing_departures_named(moe, tmp_path):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    checkpoint = moe[0]
    request = ExportRequest(model=str(checkpoint), dtype="fp16", ep="cpu", variant="gqa", max_seq_len=192)
    result = export_model(request, tmp_path / "export", validate=True)
    report = json.loads((result.out_dir / "parity_report.json").read_text())
    assert report["status"] == "passed", report["failed_gates"]
    for run in report["components"]["end_to_end"]:
        assert not run["mismatches"]
        for tie in run["routing_ties"]:  # each named departure: a near-tie margin, the replay close to the export
            assert all(flip["margin"] < 0.1 for flip in tie["flips"])
            assert tie["replay_error"] <= min(tie["tolerance"], tie["departure"] / 2)
    print("routing ties:", [(r["prompt"], r["routing_ties"]) for r in report["components"]["end_to_end"]])


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
        (plain, seen), (streamed_plain, streamed_seen) = (routing.router_logits(m, inputs) for m in (whole, streamed))
        assert np.array_equal(plain, streamed_plain)
        assert all(np.array_equal(a, b) and x == y for (a, x), (b, y) in zip(seen, streamed_seen))
        renormalize = [kind for _, kind in seen]
        span = float(np.ptp(plain[-1]))
        planted = None
        for margin, layer, token, expert in sorted(
                (float(r[t, k - 1] - r[t, k]), layer, t, int(o[t, k]))
                for layer, ((logits, _), k) in enumerate(zip(seen, [g.top_k for g in routing.routers(whole)]))
                for o in [np.argsort(-logits, axis=-1, kind="stable")] for r in [np.take_along_axis(logits, o, -1)]
                for t in range(len(logits))):
            flipped = routing.replay(whole, inputs, [(layer, token, expert)], renormalize)
            if margin < 0.1 and np.abs(flipped[-1] - plain[-1]).max() > 0.1 * span:
                planted = (layer, token)
                break
        assert planted is not None, "no near-tie flip of the tiny qwen3_moe moves the last logits beyond 10% of the range"
        assert np.array_equal(routing.replay(streamed, inputs, [(layer, token, expert)], renormalize), flipped)
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
    assert tie.step == 0 and planted in [(f.layer, f.token) for f in tie.flips] and tie.replay_error < 1e-5
    # the same run judged as fp32 (no half-precision departure to explain): nothing replayed
    assert _routing_ties("fp32", run, ref, SimpleNamespace(path=source), "cpu", [], {}) == {}
