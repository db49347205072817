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


def _packed_head_checkpoint(float_checkpoint: Path, out: Path, group_size: int) -> Path:
    """``float_checkpoint`` with its LM head GPTQ-packed (GPTQModel's ``lm_head: true``): random 4-bit
    codes, zero points 8, small fp16 scales. What is measured is memory, not numbers."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True)
    tensors = load_file(str(float_checkpoint / "model.safetensors"))
    vocab, hidden = tensors.pop("lm_head.weight").shape
    rng = np.random.default_rng(0)
    tensors["lm_head.qweight"] = rng.integers(0, 2**32, (hidden // 8, vocab), dtype=np.uint64).astype(np.uint32).view(np.int32)
    tensors["lm_head.qzeros"] = np.full((hidden // group_size, vocab // 8), 0x77777777, np.uint32).view(np.int32)
    tensors["lm_head.scales"] = rng.uniform(1e-3, 2e-3, (hidden // group_size, vocab)).astype(np.float16)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((float_checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True,
                                     "checkpoint_format": "gptq", "desc_act": False, "lm_head": True}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_packed_lm_head_is_decoded_a_block_at_a_time_within_the_estimate(checkpoint, tmp_path):
    """The streamed reference reads a GPTQ-packed LM head a block of vocabulary rows at a time and
    decodes that block alone: its peak is the block's fp32 values and codes (``decode_bytes``, what
    the estimate counts), not the whole head decoded with uint32 and fp32 intermediates (an 8B's
    0.25 GiB block took 4.45 GiB). Eight blocks to the head, as an 8B's head has."""
    import tracemalloc

    import torch

    from exporter.geometries import write_geometry_config
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.packaging.prequantized import decode_bytes
    from exporter.resources import estimate_resources
    from exporter.validation.streamed import VOCAB_BLOCK_BYTES, StreamedReference

    vocab, hidden, group = 16384, 256, 32
    source = _packed_head_checkpoint(checkpoint("llama", vocab_size=vocab, hidden_size=hidden), tmp_path / "ckpt", group)
    block = vocab * hidden * 4 // 8
    streamed = StreamedReference(source, vocab_block_bytes=block)
    tracemalloc.start()  # numpy's allocations: the decoding (torch's own are not traced, nor mapped files)
    try:
        with torch.no_grad():
            streamed(input_ids=torch.tensor([[1, 5, 7, 9]]), use_cache=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        streamed.close()
    assert peak <= decode_bytes(block // 4, group) <= 1.5 * block, (peak, block)

    # The estimate of an 8B with such a head (on a GPU worker whose reference runs on the host, the
    # reference's phase is the peak): its head blocks and their decoding cover the measured peak
    # scaled to the reference's own block size.
    eight_b = write_geometry_config("llama-3.1-8b", tmp_path / "8b")
    config = json.loads((eight_b / "config.json").read_text())
    config["quantization_config"] = json.loads((source / "config.json").read_text())["quantization_config"]
    (eight_b / "config.json").write_text(json.dumps(config))
    host = estimate_resources(load_model_config(eight_b, ARCHITECTURES),
                              ExportRequest(model="m", dtype="int4", ep="cuda")).terms["host"]
    covered = host["reference LM head blocks"] + host["decoding packed weights"]
    assert covered >= peak / block * VOCAB_BLOCK_BYTES, (covered, peak / block)


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_blocks_of_a_packed_linear_are_its_values_decoded_whole(name):
    """``rows`` (the export's and the reference's blocks) and ``columns`` (a transposed initializer's)
    decode a block alone, group boundaries or not, to the same bits as the whole linear."""
    checkpoint = Checkpoint(DATA / name)
    for linear in checkpoint.linears:
        whole = checkpoint.array(linear)
        n, k = whole.shape
        for a, b in ((0, n), (3, 17), (n - 5, n)):
            np.testing.assert_array_equal(checkpoint.rows(linear, a, b), whole[a:b])
        for a, b in ((0, k), (5, 17), (32, 64), (7, k - 1)):
            np.testing.assert_array_equal(checkpoint.columns(linear, a, b), whole[:, a:b])
