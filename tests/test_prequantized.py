"""GPTQ and AWQ checkpoints made by GPTQModel itself (tests/data/prequantized, made by its
make_fixtures.py) export to MatMulNBits with their own codes: logits equal to the checkpoint's own
dequantized forward in transformers (GPTQModel's ``dequantize_weight`` with fp32 scales), the weight
gate holds every block to the checkpoint's dequantization, and what MatMulNBits cannot hold is
refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporter.errors import ExportError
from exporter.packaging.checkpoint import Checkpoint
from exporter.pipeline import export_model
from exporter.request import ExportRequest, QuantSpec
from exporter.runtime.session import Decoder
from exporter.validation.gates.weights import weight_integrity

DATA = Path(__file__).parent / "data" / "prequantized"
IDS = [[1, 17, 42, 99, 7, 130, 64, 3, 200, 88, 12, 150], [1, 5, 6, 7, 8, 9]]  # make_fixtures.IDS
# The issue's bound for fp32: the largest logit difference over the logits' range.
FP32_BOUND = 1e-4
IMPORTED = {"gptq-4bit-sym": "int4", "gptq-4bit-asym": "int4", "gptq-8bit-sym": "int8", "awq-4bit": "int4"}


def _logits(export_dir: Path, ids: list[int]) -> np.ndarray:
    decoder = Decoder(export_dir / "model.onnx")
    return decoder.forward(np.array([ids], np.int64), decoder.new_state())[0].astype(np.float32)


def _export(name: str, out: Path, dtype: str, validate: bool = False, **quant):
    request = ExportRequest(model=str(DATA / name), dtype=dtype, ep="cpu", variant="attn_dynamic",
                            quant=QuantSpec(accuracy_level=0, **quant) if dtype in ("int4", "int8") else None)
    return export_model(request, out, validate=validate)


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (want.max() - want.min()))


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_import_matches_the_checkpoints_own_dequantized_forward(name, tmp_path):
    """int4 / int8 keeping the checkpoint's codes, in fp32 activations (accuracy level 0): every
    position's logits within 1e-4 of the range of GPTQModel's fp32 dequantization in transformers
    (its own module, as loaded, dequantizes in the scales' dtype: on SmolLM2 that fp16 rounding alone
    is 1.5e-3 of the range, benchmarks/results/prequantized_import_*.json)."""
    result = _export(name, tmp_path / "int4", IMPORTED[name])
    reference = np.load(DATA / name / "logits.npz")
    manifest = json.loads((result.out_dir / "manifest.json").read_text())
    decisions = manifest["quantization"]["weights"]
    assert manifest["quantization"]["imported"]["method"] == name.split("-")[0]
    imported = [d for d in decisions.values() if d.get("imported")]
    assert len(imported) == 2 * 4, "q/k/v, o, gate/up and down of two layers: every packed linear imported"
    assert all(d["method"] == name.split("-")[0] for d in imported)
    assert decisions["lm_head.weight.T"]["kept_for"] == ["lm_head"]  # float in the checkpoint, float here
    for i, ids in enumerate(IDS):
        got = _logits(result.out_dir, ids)
        assert _relative_error(got, reference[f"dequantized_{i}"]) <= FP32_BOUND
    # The same checkpoint dequantized to an fp32 export gives the same numbers.
    float_export = _export(name, tmp_path / "fp32", "fp32")
    np.testing.assert_allclose(_logits(float_export.out_dir, IDS[0]), reference["dequantized_0"],
                               atol=FP32_BOUND * float(np.ptp(reference["dequantized_0"])))


def test_the_codes_are_repacked_not_quantized_again(tmp_path):
    """MatMulNBits' packed bytes hold exactly the checkpoint's 4-bit codes (GPTQ, asymmetric: zero
    points carried over too): decoded from the file, every weight equals the checkpoint's own
    scale * (q - z)."""
    result = _export("gptq-4bit-asym", tmp_path / "out", "int4")
    manifest = json.loads((result.out_dir / "manifest.json").read_text())
    checkpoint = Checkpoint(DATA / "gptq-4bit-asym")
    gates, stats = weight_integrity(result.out_dir / "model.onnx", manifest, checkpoint, "int4", "fp32")
    assert all(g.passed for g in gates), [g for g in gates if not g.passed]
    assert stats and all(s.exact for s in stats)
    model = onnx.load(str(result.out_dir / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 4 for n in nodes), "asymmetric: zero points given to every node"


def test_the_weight_gate_catches_a_changed_block(tmp_path):
    """One packed byte changed in model.onnx.data: the gate fails that weight."""
    result = _export("awq-4bit", tmp_path / "out", "int4")
    manifest = json.loads((result.out_dir / "manifest.json").read_text())
    name = next(n for n in manifest["initializers"] if n.endswith(".packed") and "mlp.down_proj" in n)
    model = onnx.load(str(result.out_dir / "model.onnx"), load_external_data=False)
    info = next(i for i in model.graph.initializer if i.name == name)
    offset = int(next(e.value for e in info.external_data if e.key == "offset"))
    data = result.out_dir / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[offset + 5] ^= 0x11
    data.write_bytes(bytes(raw))
    gates, stats = weight_integrity(result.out_dir / "model.onnx", manifest, Checkpoint(DATA / "awq-4bit"), "int4", "fp32")
    failed = [s for s in stats if not s.passed]
    assert [s.initializer for s in failed] == [name]
    assert not all(g.passed for g in gates)


def test_validated_export_of_a_gptq_checkpoint(tmp_path):
    """The whole pipeline on the GPTQ checkpoint: the reference is its dequantized model, and every
    gate passes (the weights bit-exact to the checkpoint's dequantization)."""
    result = _export("gptq-4bit-sym", tmp_path / "out", "int4", validate=True)
    assert result.manifest.data["status"] == "ready", [g for g in result.report.gates if not g.passed]
    weights = next(g for g in result.report.gates if g.check.startswith("every checkpoint slice"))
    assert weights.passed and "bit-exact" in str(weights.measured)


def test_act_order_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ExportError, match="act-order"):
        _export("gptq-4bit-act-order", tmp_path / "out", "int4")


@pytest.mark.parametrize("change, match", [
    ({"group_size": -1}, "group_size -1"),
    ({"bits": 3}, "bits 3"),
    ({"checkpoint_format": "marlin"}, "marlin"),
])
def test_layouts_matmulnbits_cannot_hold_are_refused(tmp_path, change, match):
    source = tmp_path / "ckpt"
    shutil.copytree(DATA / "gptq-4bit-sym", source)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"].update(change)
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=match):
        _export(str(source), tmp_path / "out", "int4")


@pytest.mark.parametrize("dtype, quant, match", [
    ("int8", {}, "int4 to keep its codes"),
    ("int4", {"int8_layers": (0,)}, "int8_layers"),
])
def test_requests_that_would_requantize_are_refused(tmp_path, dtype, quant, match):
    with pytest.raises(ExportError, match=match):
        _export("gptq-4bit-sym", tmp_path / "out", dtype, **quant)


def test_a_quantized_lm_head_on_request(tmp_path):
    """lm_head_bits quantizes the float LM head (round to nearest) beside the imported linears."""
    result = _export("gptq-4bit-sym", tmp_path / "out", "int4", lm_head_bits=8)
    decisions = json.loads((result.out_dir / "manifest.json").read_text())["quantization"]["weights"]
    head = decisions["lm_head.weight.T"]
    assert head["quantized"] and head["bits"] == 8 and "imported" not in head
