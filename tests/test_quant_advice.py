"""Which int4 passes: recipes measured on the model by simulation (exporter/validation/quant_advice.py).

The simulation is held to the real thing: a candidate's simulated figures must be the figures of its
own export, scored by the quality gate's code on the same text against the same reference; the advice
must be the first candidate, smallest first, within the margin of the thresholds; following it (the
advised request, exported for real) must pass those thresholds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.packaging.resolve import resolve_source
from exporter.pipeline import export_model
from exporter.request import DType, ExportRequest
from exporter.runtime.session import Decoder
from exporter.validation import quant_advice
from exporter.validation.gates.quality import export_logits, reference_logits, score, text_tokens, windows
from exporter.validation.reference import open_reference


@pytest.fixture(scope="module")
def measured(checkpoint):
    """A tiny llama, the gate's windows of its text (byte tokens: no tokenizer) and its fp32 reference."""
    source = resolve_source(str(checkpoint("llama", vocab_size=300)))
    tokens, tokenizer, prefix = text_tokens(Path(source.path), 300)
    chunks = windows(tokens[:192], 64, prefix)
    model = open_reference(Path(source.path), "cpu")
    try:
        reference = reference_logits(model, chunks)
    finally:
        model.close()
    return source, chunks, reference, tokenizer


def _exported(request, source, out, chunks, reference, tokenizer):
    export_model(request, out, validate=False)
    lm = Decoder(out, "cpu")
    return score(chunks, reference, export_logits(lm, chunks), tokenizer)


@pytest.mark.parametrize("quant", [None, {"symmetric": False, "lm_head_bits": 8, "int8_layers": [1]},
                                   {"block_size": 16, "accuracy_level": 0}])
def test_a_simulated_recipe_scores_what_its_export_scores(measured, tmp_path, quant):
    """Weights round-tripped as the export stores them, and on the CPU its int8 activations (accuracy
    level 4, the default), inside transformers' model: the export's own figures, to rounding."""
    source, chunks, reference, tokenizer = measured
    request = ExportRequest(model=str(source.path), dtype="int4", ep="cpu", variant="attn_dynamic", quant=quant)
    simulated = quant_advice.simulate(request, source, DType.FP32, chunks, reference, tokenizer)
    real = _exported(request, source, tmp_path / "export", chunks, reference, tokenizer)
    assert simulated.kl_mean == pytest.approx(real.kl_mean, rel=0.05, abs=1e-4)
    assert simulated.ppl_delta == pytest.approx(real.ppl_delta, rel=0.05, abs=2e-3)
    assert abs(simulated.agreement_all - real.agreement_all) <= 0.02


def test_the_advice_is_the_smallest_recipe_within_the_margin_and_following_it_passes(measured, tmp_path):
    """Limits no int4 recipe of this model meets (random weights quantize badly) and int8 meets with
    the margin to spare: every int4 candidate is measured first, smallest first, then int8 is the advice,
    and int8 exported for real meets the limits."""
    source, chunks, reference, tokenizer = measured
    request = ExportRequest(model=str(source.path), dtype="int4", ep="cpu", variant="attn_dynamic")
    options = quant_advice.candidates(request)
    assert options[-1].dtype == "int8" and all(c.dtype == "int4" for c in options[:-1])
    int8 = quant_advice.simulate(quant_advice.with_candidate(request, options[-1]), source, DType.FP32, chunks,
                                 reference, tokenizer)
    limits = {"kl_max": int8.kl_mean / quant_advice.ERROR_MARGIN * 1.01, "ppl_delta_max": 10.0, "agreement_min": 0.0}
    advice = quant_advice.advise(request, source, DType.FP32, chunks, reference, tokenizer, limits)
    assert [t["recipe"] for t in advice["tried"]] == [c.label for c in options]
    assert all(t["kl"] > limits["kl_max"] for t in advice["tried"][:-1])  # each int4 recipe measured, none enough
    assert advice["advice"]["dtype"] == "int8" and sorted(advice["sensitive_layers"]) == [0, 1]
    sentence = quant_advice.describe(advice)
    assert "no int4 recipe measured on this model passes" in sentence and "request dtype int8 (CLI --dtype int8)" in sentence
    real = _exported(quant_advice.with_candidate(request, options[-1]), source, tmp_path / "followed", chunks,
                     reference, tokenizer)
    assert real.kl_mean <= limits["kl_max"]
    # Limits nothing meets: the sentence says so and names the closest.
    none = quant_advice.advise(request, source, DType.FP32, chunks, reference, tokenizer,
                               {"kl_max": 0.0, "ppl_delta_max": 0.0, "agreement_min": 1.0})
    assert none["advice"] is None and "no recipe measured on this model passes" in quant_advice.describe(none)
