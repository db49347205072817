"""int4 mixed precision chosen by measurement (exporter/quant_plan.py): each layer's sensitivity is
measured, the most sensitive get 8 bits within the budget, and the result is what it says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from exporter.errors import ExportError
from exporter.quant_plan import plan_int8_layers
from exporter.request import ExportRequest


def test_the_most_sensitive_layer_gets_8_bits_within_a_budget_for_one(checkpoint, tmp_path):
    source = checkpoint("llama")
    request = ExportRequest(model=str(source), dtype="int4")
    # Room for every layer at 8 bits first: the sensitivities, and what one layer costs.
    full = plan_int8_layers(request, tmp_path / "full", budget_bytes=10**9)
    sensitivity = {int(i): kl for i, kl in full["sensitivity_kl"].items()}
    assert len(sensitivity) == 2 and full["chosen"]["int8_layers"] == [0, 1]
    assert full["chosen"]["kl"] < full["baseline"]["kl"]
    worst = max(sensitivity, key=sensitivity.get)
    assert full["order"][0] == worst
    # A budget that holds one layer's upgrade (half the way to both) gives it to the most sensitive.
    base, both = full["baseline"]["bytes"], full["chosen"]["bytes"]
    one = plan_int8_layers(request, tmp_path / "one", budget_bytes=base + (both - base) // 2 + 1024)
    assert one["chosen"]["int8_layers"] == [worst] and one["chosen"]["bytes"] <= one["budget_bytes"]
    # With that layer at 8 bits, only the other is int4: the KL is that layer's own sensitivity.
    other = next(i for i in sensitivity if i != worst)
    assert one["chosen"]["kl"] == pytest.approx(sensitivity[other], rel=1e-6)
    assert one["quant"]["int8_layers"] == [worst]
    # A KL target the all-int4 export already meets adds nothing.
    easy = plan_int8_layers(request, tmp_path / "easy", kl_target=full["baseline"]["kl"] * 2)
    assert easy["chosen"]["int8_layers"] == [] and easy["target_met"] is True


def test_quant_plan_refuses_what_it_cannot_plan_and_the_cli_prints_the_spec(checkpoint, tmp_path):
    source = checkpoint("llama")
    with pytest.raises(ExportError, match="use dtype int4"):
        plan_int8_layers(ExportRequest(model=str(source), dtype="int8"), tmp_path / "a", budget_bytes=10**9)
    with pytest.raises(ExportError, match="needs a size budget"):
        plan_int8_layers(ExportRequest(model=str(source), dtype="int4"), tmp_path / "b")
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    image_text = make_tiny_vlm_checkpoint("qwen2_5_vl", tmp_path / "vlm")
    with pytest.raises(ExportError, match="quant-plan scores a text decoder.*image-text checkpoint"):
        plan_int8_layers(ExportRequest(model=str(image_text), dtype="int4"), tmp_path / "c", budget_bytes=10**9)
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "exporter.cli", "quant-plan", "--model", str(source), "--budget-mb",
                           "100", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(out.read_text())
    assert f"quant: {json.dumps(plan['quant'])}" in proc.stdout and plan["quant"]["int8_layers"] == [0, 1]
    bad = subprocess.run([sys.executable, "-m", "exporter.cli", "quant-plan", "--model", str(source), "--budget-mb",
                          "-1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--budget-mb must be positive" in bad.stderr
