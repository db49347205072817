"""int4 by onnxruntime's HQQ (``quant.method: hqq``): what the export holds, that it runs in onnxruntime
exactly as its own dequantized weights do, that it reconstructs weights better than round to nearest,
and that choosing it changes nothing for a request that does not."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper
import pytest

from exporter.errors import ExportError
from exporter.graph.passes.quantize import QuantScheme, dequantize, quantize_hqq, quantize_rows
from exporter.pipeline import export_model
from exporter.request import ExportRequest, QuantSpec, cache_key
from exporter.runtime.session import Decoder
from exporter.validation.parity import run_parity
from exporter.validation.reference import load_reference, reference_greedy
from tests.conftest import DECODE_STEPS, MAX_SEQ_LEN
from tests.quantized_reference import dequantized_checkpoint

HQQ = {"method": "hqq", "symmetric": False, "accuracy_level": 0}
PROMPT = [1, 5, 9, 14, 3, 27, 8]


def _export(source, out, quant):
    request = ExportRequest(model=str(source), dtype="int4", ep="cpu", variant="attn_dynamic", quant=quant,
                            max_seq_len=MAX_SEQ_LEN)
    return export_model(request, out, validate=False).out_dir


def _matches_its_dequantized_checkpoint(source, out, tmp_path):
    dequantized, schemes = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    ref = reference_greedy(load_reference(dequantized), PROMPT, DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, result
    assert result.tokens == ref.tokens, result.mismatches
    return schemes


def test_an_hqq_int4_export_runs_and_equals_its_own_dequantized_weights(checkpoint, tmp_path):
    """Every MatMulNBits takes HQQ's float zero points (one per block, fp32 here) beside its packed codes
    and scales; at accuracy level 0 the export equals transformers on the checkpoint whose weights are
    replaced by their own HQQ quantize-dequantize, and the manifest says hqq, per weight too."""
    source = checkpoint("llama")
    out = _export(source, tmp_path / "q", HQQ)
    model = onnx.load(str(out / "model.onnx"))
    initializers = {i.name: i for i in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 4 for n in nodes)
    for node in nodes:
        zero_points = numpy_helper.to_array(initializers[node.input[3]])
        assert zero_points.dtype == np.float32 and zero_points.size == numpy_helper.to_array(initializers[node.input[2]]).size
    # HQQ moved the zero points off the integer grid round to nearest would use.
    assert any(not np.allclose(z, np.round(z)) for z in (numpy_helper.to_array(initializers[n.input[3]]) for n in nodes))
    quantization = json.loads((out / "manifest.json").read_text())["quantization"]
    assert quantization["method"] == "hqq"
    assert {d["method"] for d in quantization["weights"].values() if d["quantized"]} == {"hqq"}

    schemes = _matches_its_dequantized_checkpoint(source, out, tmp_path)
    assert {s["method"] for s in schemes.values()} == {"hqq"}


def test_a_tied_hqq_head_at_8_bits_rounds_to_nearest_and_the_embedding_gathers_from_it(checkpoint, tmp_path):
    """GatherBlockQuantized takes uint8 zero points only: a tied 4-bit HQQ head leaves the embedding
    float (and says so); an 8-bit head rounds to nearest, so the embedding gathers from its blocks,
    and the mixed export is still exact to its own dequantized weights."""
    source = checkpoint("llama", tie_word_embeddings=True)
    head = "model.embed_tokens.weight.T"

    four = _export(source, tmp_path / "four", HQQ)
    graph = onnx.load(str(four / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "GatherBlockQuantized" for n in graph.node)
    decision = json.loads((four / "manifest.json").read_text())["quantization"]["weights"][head]
    assert decision["method"] == "hqq" and "float zero points" in decision["embedding"]

    eight = _export(source, tmp_path / "eight", {**HQQ, "lm_head_bits": 8})
    graph = onnx.load(str(eight / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "GatherBlockQuantized" for n in graph.node) == 1
    weights = json.loads((eight / "manifest.json").read_text())["quantization"]["weights"]
    assert weights[head]["bits"] == 8 and weights[head]["method"] == "rtn"
    assert {d["method"] for name, d in weights.items() if d["quantized"] and name != head} == {"hqq"}
    _matches_its_dequantized_checkpoint(source, eight, tmp_path)


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_hqq_reconstructs_real_like_weights_better_than_round_to_nearest(block_size):
    """Heavy-tailed rows with a spread of row scales, as trained projections have: HQQ's relative L2
    error is below round to nearest's, asymmetric (the same grid with integer zero points) and symmetric."""
    rng = np.random.default_rng(0)
    rows = (rng.standard_t(4, size=(768, 512)) * rng.lognormal(-4, 0.5, size=(768, 1))).astype(np.float32)

    def error(packed, scales, zero, scheme):
        back = dequantize(packed, scales, None if scheme.symmetric else zero, scheme, rows.shape[1])
        return float(np.linalg.norm(back - rows) / np.linalg.norm(rows))

    hqq = error(*quantize_hqq(rows, 4, block_size), QuantScheme(4, block_size, False, "hqq"))
    asymmetric = error(*quantize_rows(rows, 4, block_size, False), QuantScheme(4, block_size, False))
    symmetric = error(*quantize_rows(rows, 4, block_size, True), QuantScheme(4, block_size, True))
    assert hqq < asymmetric and hqq < symmetric, (hqq, asymmetric, symmetric)


def test_the_default_method_leaves_every_cache_key_as_it_was():
    """``method: rtn`` is the default and stays out of the request's identity: a request that names it,
    or the API's default options, has the key of one written before the option existed."""
    from services.api.schemas import QuantOptions

    def key(request):
        return cache_key(request, "rev", "1", "1.32")

    default = ExportRequest(model="m", dtype="int4")
    assert "method" not in default.quant.to_dict()
    without_method = {"block_size": 32, "symmetric": True, "lm_head_bits": None, "keep": []}  # a key from before
    assert default.to_dict()["quant"] == without_method
    assert key(default) == key(ExportRequest(model="m", dtype="int4", quant=without_method))
    assert key(default) == key(ExportRequest(model="m", dtype="int4", quant={"method": "rtn"}))
    assert key(default) == key(ExportRequest(model="m", dtype="int4", quant=QuantOptions().model_dump()))
    hqq = ExportRequest(model="m", dtype="int4", quant={"method": "hqq", "symmetric": False})
    assert hqq.to_dict()["quant"]["method"] == "hqq" and key(hqq) != key(default)
    assert QuantSpec.from_dict(hqq.quant.to_dict()) == hqq.quant


@pytest.mark.parametrize("dtype,options,words", [
    ("int4", {"method": "gptq"}, "unknown quant method 'gptq': use rtn .* or hqq"),
    ("int4", {"method": "hqq"}, "hqq fits a zero point per block: set symmetric false"),
    ("int8", {"method": "hqq", "symmetric": False}, "hqq quantizes 4-bit weights: use dtype int4"),
])
def test_a_bad_method_is_refused_with_what_to_use(dtype, options, words):
    with pytest.raises(ExportError, match=words):
        ExportRequest(model="m", dtype=dtype, quant=options)


def test_the_api_and_the_cli_take_the_method():
    from pydantic import ValidationError

    from exporter.cli import _quant_options, build_parser
    from services.api.schemas import QuantOptions

    assert QuantOptions(method="hqq", symmetric=False).model_dump()["method"] == "hqq"
    with pytest.raises(ValidationError):
        QuantOptions(method="gptq")
    args = build_parser().parse_args(["export", "--model", "m", "--out", "o", "--dtype", "int4",
                                      "--quant-method", "hqq", "--quant-asymmetric"])
    assert _quant_options(args) == {"method": "hqq", "symmetric": False}


def test_the_weight_gate_judges_hqq_blocks_against_round_to_nearest_and_names_a_corrupted_one(checkpoint, tmp_path):
    """HQQ's codes cannot be reproduced by quantizing again (they depend on which rows were optimized
    together) and its zero-point shift may clip a block's extremes by more than a step: the gate holds
    each weight's L2 error to round to nearest's on the same rows. A block of zeroed codes breaks that."""
    from exporter.validation.gates.weights import HQQ_L2_VS_RTN, HQQ_STEP_BOUND
    from exporter.validation.validate import validate_export
    from tests.test_quantize import _external

    out = _export(checkpoint("llama"), tmp_path / "q", HQQ)
    report = validate_export(out)
    gate = next(g for g in report.gates if g.gate == "weights" and "by value" in g.check)
    assert gate.passed, gate.message
    hqq = [s for s in gate.details["worst"] if s["l2_vs_rtn"] is not None]
    assert hqq and max(s["l2_vs_rtn"] for s in hqq) <= HQQ_L2_VS_RTN
    assert max(s["step_ratio"] for s in hqq) <= HQQ_STEP_BOUND

    name = "model.layers.1.mlp.down_proj.weight.T.q4b32ah.packed"
    offset, _ = _external(out / "model.onnx", name)
    with open(out / "model.onnx.data", "r+b") as f:  # one column's first block: every code 0
        f.seek(offset)
        f.write(bytes(16))
    failed = [g for g in validate_export(out).failed if g.gate == "weights"]
    assert failed and name in failed[0].message and "x round to nearest's" in failed[0].message


def test_the_weight_gate_refuses_an_hqq_scale_five_times_too_big_on_a_wide_weight(checkpoint, tmp_path):
    """One block among many: the chunk's L2 hardly moves, the element bound in the block's steps does."""
    from exporter.validation.gates.weights import HQQ_STEP_BOUND
    from exporter.validation.validate import validate_export
    from tests.test_quantize import _edit_external

    out = _export(checkpoint("llama"), tmp_path / "q", HQQ)
    name = "model.layers.0.mlp.gate_up_proj.weight.T.q4b32ah.scales"

    def scale_one(scales):
        scales[3] *= 5
        return scales

    _edit_external(out, name, np.float32, scale_one)
    failed = [g for g in validate_export(out).failed if g.gate == "weights"]
    assert failed and "gate_up_proj.weight.T.q4b32ah.packed" in failed[0].message
    [bad] = [s for s in failed[0].details["worst"] if not s["passed"]]
    assert bad["step_ratio"] > HQQ_STEP_BOUND  # the element bound is what catches it


def test_the_catalog_keeps_an_hqq_build_apart_from_round_to_nearest():
    from services.catalog.views import quant_tag

    rtn, hqq = {"symmetric": False}, {"symmetric": False, "method": "hqq"}
    assert quant_tag(rtn) != quant_tag(hqq) and quant_tag(hqq).endswith("-hqq")
    assert quant_tag({"method": "rtn"}) == quant_tag({}) == ""  # the defaults name no tag
