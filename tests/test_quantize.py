"""Weight-only int4 / int8 exports: onnxruntime's own quantizer bit for bit, streamed; every variant
runs and is gated (dequantized weights within the quantization's own bound, quality against the
unquantized reference); the per-tensor policy; bad options refused; the catalog round trip."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import onnx
from onnx import numpy_helper
import pytest

from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest, QuantSpec
from exporter.validation.validate import validate_export
from exporter.runtime.session import Decoder
from exporter.validation.parity import run_parity
from exporter.validation.reference import load_reference, reference_greedy
from tests.conftest import DECODE_STEPS, MAX_SEQ_LEN
from tests.quantized_reference import dequantized_checkpoint

VARIANTS = ["attn_dynamic", "gqa", "attn_static"]


def _export(source, out, dtype="int4", variant="attn_dynamic", quant=None, ep="cpu"):
    request = ExportRequest(model=str(source), dtype=dtype, ep=ep, variant=variant, quant=quant,
                            static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
    return export_model(request, out, validate=False).out_dir


def _initializers(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def _nbits_nodes(path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_streamed_quantization_is_onnxruntimes_own_bit_for_bit(checkpoint, tmp_path, monkeypatch, bits, symmetric):
    """ORT's MatMulNBitsQuantizer on our unquantized export == our streamed quantization, byte for
    byte, with blocks small enough that every weight is quantized in several column chunks."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    import exporter.packaging.checkpoint as ckpt

    source = checkpoint("llama")
    plain = _export(source, tmp_path / "fp32", dtype="fp32")
    monkeypatch.setattr(ckpt, "BLOCK_BYTES", 2048)  # 8 rows of 64 fp32 per chunk
    ours = _export(source, tmp_path / "q", dtype=f"int{bits}", quant={"symmetric": symmetric, "lm_head_bits": bits})

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, accuracy_level=4,
                                          quant_format=QuantFormat.QOperator, bits=bits)
    tool = MatMulNBitsQuantizer(onnx.load(str(plain / "model.onnx")), algo_config=config)
    tool.process()
    theirs = {i.name: onnx.numpy_helper.to_array(i) for i in tool.model.model.graph.initializer}
    mine = _initializers(ours / "model.onnx")
    packed = [name for name in mine if name.endswith(".packed")]
    assert len(packed) == 9  # 2 layers x (qkv, o, gate_up, down) + lm_head
    for name in packed:
        weight, stem = name.split(f".q{bits}b32")[0], name[: -len(".packed")]
        assert np.array_equal(mine[name].reshape(-1), theirs[f"{weight}_Q{bits}"].reshape(-1)), name
        assert np.array_equal(mine[f"{stem}.scales"].reshape(-1), theirs[f"{weight}_scales"].reshape(-1)), name
        if not symmetric:
            assert np.array_equal(mine[f"{stem}.zero_points"].reshape(-1), theirs[f"{weight}_zero_points"].reshape(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_runs_quantized_and_passes_structure_weights_and_runtime(checkpoint, tmp_path, variant):
    source = checkpoint("qwen2")  # q/k/v bias: MatMulNBits then Add
    figures = {}
    for dtype, level in (("int4", None), ("int8", None), ("int4", 0)):
        out = _export(source, tmp_path / f"{dtype}-{level}", dtype=dtype, variant=variant,
                      quant=None if level is None else {"accuracy_level": level})
        census = {n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node}
        assert "MatMul" not in census and len(_nbits_nodes(out / "model.onnx")) == 9  # packed qkv, gate_up: one each
        report = validate_export(out)
        by_gate = {g.gate: [] for g in report.gates}
        for g in report.gates:
            by_gate[g.gate].append(g)
        for gate in ("structure", "weights", "runtime"):
            assert all(g.status in ("pass", "info") for g in by_gate[gate]), [g.to_dict() for g in by_gate[gate]]
        assert "parity" not in by_gate and len(by_gate["quality"]) == 5  # the measurement check, then the four
        decode = by_gate["quality"][-1]
        assert "decode steps through the cache" in decode.check, decode.to_dict()
        levels = {a.i for n in _nbits_nodes(out / "model.onnx") for a in n.attribute if a.name == "accuracy_level"}
        if level == 0:  # fp32 activations: decode must equal the export's own prefill
            assert levels == {0} and decode.status == "pass", decode.to_dict()
            continue
        # the CPU default: int8 activations (its fast kernels, fold.CPU_ACCURACY_LEVEL), reported, not judged
        assert levels == {4} and decode.status == "info" and decode.measured < 0.1 * decode.details["logit_range"]
        assert report.quality["positions"] > 100 and report.quality["tokenizer"] == "bytes"
        report.write(out)
        assert "Quality against the unquantized reference" in (out / "parity_report.md").read_text()
        figures[dtype] = report.quality
    # 8 bits are closer to the reference than 4, on every figure (random weights: same checkpoint)
    assert figures["int8"]["kl_mean"] < figures["int4"]["kl_mean"] / 4
    assert abs(figures["int8"]["ppl_delta"]) < abs(figures["int4"]["ppl_delta"]) or figures["int4"]["ppl_delta"] < 0


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_tied_embedding_gathers_from_the_quantized_lm_head_exactly(checkpoint, tmp_path, symmetric):
    """A tied table is stored once, as the LM head's blocks: GatherBlockQuantized reads the same codes
    and scales (and zero points) as MatMulNBits, so at accuracy level 0 the export equals transformers
    on the dequantized checkpoint (its tied embedding dequantized too) to 1e-4 of the logit range and
    decodes its tokens; ``keep: embedding`` leaves the float table."""
    source = checkpoint("llama", tie_word_embeddings=True)
    quant = {"accuracy_level": 0, "symmetric": symmetric}
    out = _export(source, tmp_path / "q", quant=quant)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    gathers = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gathers) == 1 and not any(n.op_type == "Gather" and "embed" in n.input[0] for n in graph.node)
    views = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Reshape"}
    assert views[gathers[0].input[0]] == "model.embed_tokens.weight.T.q4b32" + ("s" if symmetric else "a") + ".packed"
    assert not [i.name for i in graph.initializer if i.name == "model.embed_tokens.weight.T"]  # no float copy
    decision = json.loads((out / "manifest.json").read_text())["quantization"]["weights"]["model.embed_tokens.weight.T"]
    assert "lm_head" in decision["roles"] and "GatherBlockQuantized" in decision["embedding"]

    dequantized, _ = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    ref = reference_greedy(load_reference(dequantized), [1, 5, 9, 14, 3, 27, 8], DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, result
    assert result.tokens == ref.tokens, result.mismatches

    kept = _export(source, tmp_path / "kept", quant={**quant, "keep": ["embedding"]})
    graph = onnx.load(str(kept / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "GatherBlockQuantized" for n in graph.node)
    assert any(i.name == "model.embed_tokens.weight.T" for i in graph.initializer)
    assert (kept / "model.onnx.data").stat().st_size > (out / "model.onnx.data").stat().st_size

    # cuda: unchanged (a float table, accuracy level 0, which CUDA ignores); built here, never run
    cuda = _export(source, tmp_path / "cuda", variant="gqa", ep="cuda")
    graph = onnx.load(str(cuda / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "GatherBlockQuantized" for n in graph.node)
    assert {a.i for n in _nbits_nodes(cuda / "model.onnx") for a in n.attribute if a.name == "accuracy_level"} == {0}


def _external(path, name) -> tuple[int, int]:
    init = next(i for i in onnx.load(str(path), load_external_data=False).graph.initializer if i.name == name)
    info = {e.key: e.value for e in init.external_data}
    return int(info["offset"]), int(info["length"])


def _edit_external(export_dir, name, dtype, edit) -> None:
    """Rewrite initializer ``name`` in model.onnx.data in place as ``edit(values)`` returns it."""
    offset, length = _external(export_dir / "model.onnx", name)
    with open(export_dir / "model.onnx.data", "r+b") as f:
        f.seek(offset)
        values = edit(np.frombuffer(f.read(length), dtype).copy())
        f.seek(offset)
        f.write(values.astype(dtype).tobytes())


def test_the_weight_gate_names_a_corrupted_quantized_block(checkpoint, tmp_path):
    out = _export(checkpoint("llama"), tmp_path / "q")
    broken = shutil.copytree(out, tmp_path / "broken")
    name = "model.layers.1.mlp.down_proj.weight.T.q4b32s.packed"
    offset, _ = _external(broken / "model.onnx", name)
    with open(broken / "model.onnx.data", "r+b") as f:  # one column's first block: all codes 0 (= -8 steps)
        f.seek(offset)
        f.write(bytes(16))
    report = validate_export(broken)
    failed = [g for g in report.failed if g.gate == "weights"]
    assert failed and name in failed[0].message and "not the quantization of its source" in failed[0].message


@pytest.mark.parametrize("factor", [1.05, float("nan")])
def test_the_weight_gate_refuses_scales_a_little_off_or_not_finite(checkpoint, tmp_path, factor):
    """A block whose scale is 5% off still bounds its own dequantized error; only quantizing the
    source again shows it. A NaN scale must never read as "no error"."""
    out = _export(checkpoint("llama"), tmp_path / "q")
    name = "model.layers.0.mlp.gate_up_proj.weight.T.q4b32s.scales"
    def scale_one(scales):
        scales[3] *= factor
        return scales

    _edit_external(out, name, np.float32, scale_one)
    report = validate_export(out)
    failed = [g for g in report.failed if g.gate == "weights"]
    assert failed and "model.layers.0.mlp.gate_up_proj.weight.T.q4b32s.packed" in failed[0].message
    report.write(out)
    json.loads((out / "parity_report.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


def test_the_weight_gate_names_wrong_scales(checkpoint, tmp_path):
    out = _export(checkpoint("llama"), tmp_path / "q", dtype="int8")
    name = "model.layers.0.self_attn.o_proj.weight.T.q8b32s.scales"
    _edit_external(out, name, np.float32, lambda scales: scales * 1.5)
    failed = [g for g in validate_export(out).failed if g.gate == "weights"]
    assert failed and "model.layers.0.self_attn.o_proj.weight.T.q8b32s.packed" in failed[0].message


def test_policy_keeps_or_widens_tensors_by_role_and_the_manifest_says_so(checkpoint, tmp_path):
    source = checkpoint("llama")
    wide = _export(source, tmp_path / "wide", quant={"lm_head_bits": 8})
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in _nbits_nodes(wide / "model.onnx")]
    assert bits == [4] * 8 + [8]
    kept = _export(source, tmp_path / "kept", quant={"keep": ["lm_head", "first_layer"]})
    model = onnx.load(str(kept / "model.onnx"), load_external_data=False)
    matmul_weights = sorted(n.input[1] for n in model.graph.node if n.op_type == "MatMul")
    assert matmul_weights == sorted(["lm_head.weight.T", "model.layers.0.self_attn.q_k_v_proj.weight.T",
                                     "model.layers.0.self_attn.o_proj.weight.T", "model.layers.0.mlp.gate_up_proj.weight.T",
                                     "model.layers.0.mlp.down_proj.weight.T"])
    quant = json.loads((kept / "manifest.json").read_text())["quantization"]
    assert quant["keep"] == ["first_layer", "lm_head"] and quant["activations"] == "fp32"
    assert quant["weights"]["lm_head.weight.T"] == {"quantized": False, "kept_for": ["lm_head"], "roles": ["lm_head"]}
    assert quant["weights"]["model.layers.1.mlp.down_proj.weight.T"]["quantized"] is True
    assert not [g.to_dict() for g in validate_export(kept).failed if g.gate != "quality"]


def test_int8_layers_give_those_layers_8_bits_and_the_manifest_says_why(checkpoint, tmp_path):
    """Mixed precision: the named decoder layers' projections get 8 bits (the LM head and the rest keep
    int4), the manifest marks each such weight ``bits_for: int8_layers``, the weight gate reads them
    back, and the size estimate follows; a layer the model does not have is refused by name."""
    from exporter.graph.config import load_model_config
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.resources import export_bytes

    source = checkpoint("llama")
    out = _export(source, tmp_path / "mixed", quant={"int8_layers": [1]})
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    bits = {n.input[1].split(".q")[0]: next(a.i for a in n.attribute if a.name == "bits")
            for n in model.graph.node if n.op_type == "MatMulNBits"}
    assert {w: b for w, b in bits.items() if b == 8} == {w: 8 for w in bits if w.startswith("model.layers.1.")} != {}
    assert bits["lm_head.weight.T"] == 4
    weights = json.loads((out / "manifest.json").read_text())["quantization"]["weights"]
    assert {w for w, d in weights.items() if d.get("bits_for") == "int8_layers"} == {
        w for w in weights if w.startswith("model.layers.1.")}
    assert not [g.to_dict() for g in validate_export(out).failed if g.gate != "quality"]
    written = (out / "model.onnx.data").stat().st_size
    request = ExportRequest(model=str(source), dtype="int4", variant="attn_dynamic", quant={"int8_layers": [1]},
                            max_seq_len=MAX_SEQ_LEN)
    predicted = export_bytes(load_model_config(source, ARCHITECTURES), request)
    assert abs(predicted - written) <= 0.02 * written + 4096
    with pytest.raises(ExportError, match=r"int8_layers names layers \[7\], but the model has 2"):
        _export(source, tmp_path / "beyond", quant={"int8_layers": [7]})


def test_a_cuda_quantized_export_computes_in_fp16(checkpoint, tmp_path):
    out = _export(checkpoint("llama"), tmp_path / "cuda", ep="cuda", variant="gqa")
    inits = {i.name: i.data_type for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert inits["model.layers.0.mlp.down_proj.weight.T.q4b32s.scales"] == onnx.TensorProto.FLOAT16
    assert inits["model.norm.weight"] == onnx.TensorProto.FLOAT16
    assert ExportRequest(model="m", dtype="int4", ep="cuda").resolved_variant().value == "gqa"


def _bf16_trained(source, out):
    """``source`` stored in bf16 with config.json saying so, as a bf16-trained hub checkpoint is."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    for f in out.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return out


def _loud(source, out, scale):
    """``source`` with its embedding rows ``scale`` times larger: activations far beyond a trained
    model's, as a real Gemma 3's residual stream goes past fp16's largest value."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v * scale if "embed_tokens" in k else v for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return out


def test_a_cuda_quantized_export_computes_in_the_activations_measured_on_its_checkpoint(checkpoint, tmp_path):
    """The activation dtype of a quantized cuda export is measured, not read off config.json: a
    bf16-trained checkpoint whose activations fit fp16 computes in fp16; one whose activations come
    within a factor 2 of fp16's largest value computes in bf16, its scales in bf16 and the weight gate
    holding every quantized slice to its source; the manifest says why; a chosen dtype is kept."""
    from exporter.validation.gates.weights import weight_integrity
    from exporter.packaging.checkpoint import Checkpoint

    quiet = _export(_bf16_trained(checkpoint("gemma3_text"), tmp_path / "bf16-ckpt"), tmp_path / "quiet", ep="cuda",
                    variant="gqa")
    chosen = json.loads((quiet / "manifest.json").read_text())["quantization"]
    assert chosen["activations"] == "fp16" and chosen["activations_chosen"]["by"] == "measurement"
    assert chosen["activations_chosen"]["peak"] * 2 <= 65504 and "below fp16's largest value" in chosen["activations_chosen"]["why"]

    source = _loud(checkpoint("gemma3_text"), tmp_path / "loud-ckpt", 8000.0)
    out = _export(source, tmp_path / "cuda", ep="cuda", variant="gqa")
    inits = {i.name: i for i in onnx.load(str(out / "model.onnx")).graph.initializer}
    scales = numpy_helper.to_array(inits["model.layers.0.mlp.down_proj.weight.T.q4b32s.scales"])
    assert scales.dtype.name == "bfloat16" and np.all(np.abs(scales.astype(np.float32)) > 0)
    assert inits["model.norm.weight"].data_type == onnx.TensorProto.BFLOAT16
    manifest = json.loads((out / "manifest.json").read_text())
    why = manifest["quantization"]["activations_chosen"]
    assert manifest["quantization"]["activations"] == "bf16" and why["by"] == "measurement"
    assert why["peak"] * 2 > 65504 and "so bf16" in why["why"] and why["where"], why
    [slices, tensors], _ = weight_integrity(out / "model.onnx", manifest, Checkpoint(source), "int4", "bf16")
    assert slices.passed and tensors.passed, slices.message
    # quantized by the exporter's numpy quantizer (onnxruntime's takes no bf16), so held to their
    # source by value within the quantization's bound rather than to that same code's answer
    assert slices.details["compared_by_statistics"] >= len(_nbits_nodes(out / "model.onnx"))
    forced = _export(source, tmp_path / "fp16", ep="cuda", variant="gqa", quant={"activations": "fp16"})
    forced_why = json.loads((forced / "manifest.json").read_text())["quantization"]
    assert forced_why["activations"] == "fp16" and forced_why["activations_chosen"]["by"] == "request"
    with pytest.raises(ExportError, match="no bf16 kernels"):  # transformers.js cannot take what this model needs
        export_model(ExportRequest(model=str(source), dtype="int4", ep="cuda", variant="attn_dynamic", layout="hf"),
                     tmp_path / "hf", validate=False)
    with pytest.raises(ExportError, match="apply to cuda only"):
        ExportRequest(model="m", dtype="int4", ep="cpu", quant={"activations": "bf16"})


@pytest.mark.parametrize("options,words", [
    ({"block_size": 24}, "power of 2"),
    ({"block_size": 8}, "at least 16"),
    ({"lm_head_bits": 2}, "4 or 8"),
    ({"keep": ["embeddings"]}, "lm_head, first_layer, last_layer, embedding"),
    ({"bits": 4}, "unknown quant option bits"),
    ({"activations": "fp32"}, "fp16 or bf16"),
    ({"accuracy_level": 5}, "0, 1, 2, 3, 4"),
    ({"accuracy_level": True}, "accuracy_level must be one of"),
    ({"int8_layers": "0,1"}, "list of decoder layer indexes"),
    ({"int8_layers": [-1]}, "list of decoder layer indexes"),
])
def test_bad_quant_options_are_refused_with_what_to_use(options, words):
    with pytest.raises(ExportError, match=words):
        ExportRequest(model="m", dtype="int4", quant=options)


def test_quant_options_on_a_float_dtype_are_refused():
    with pytest.raises(ExportError, match="int4 / int8 only"):
        ExportRequest(model="m", dtype="fp16", quant={"block_size": 64})
    assert ExportRequest(model="m", dtype="int8").quant == QuantSpec()
    with pytest.raises(ExportError, match="int8_layers gives some layers of an int4 export 8 bits: use dtype int4"):
        ExportRequest(model="m", dtype="int8", quant={"int8_layers": [0]})


def _catalog(tmp_path, checkpoint):
    """Settings of a fresh SQLite catalog whose MODELS_DIR holds tiny-llama."""
    from services.catalog.database import upgrade_schema
    from services.settings import Settings

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'c.db'}", models_dir=models)
    upgrade_schema(settings.catalog_url)
    return settings


def test_the_catalog_keeps_the_quant_options_and_the_api_takes_them(tmp_path, checkpoint):
    from services.api.schemas import ExportCreate
    from services.catalog.database import session_scope
    from services.catalog.exports import request_of
    from services.jobs import submit_export

    body = {"model": "tiny-llama", "dtype": "int4", "ep": "cpu", "quant": {"block_size": 64, "symmetric": False}}
    request = ExportCreate.model_validate(body).to_request()
    assert request.quant == QuantSpec(block_size=64, symmetric=False)
    with pytest.raises(ValueError, match="int4 / int8 only"):
        ExportCreate.model_validate({**body, "dtype": "fp16"})
    settings = _catalog(tmp_path, checkpoint)
    with session_scope(settings.catalog_url) as session:
        export, created = submit_export(session, settings, request)
        other, created_other = submit_export(session, settings, ExportCreate.model_validate(
            {**body, "quant": {"block_size": 32}}).to_request())
        assert created and created_other and other.cache_key != export.cache_key
        back = request_of(export)  # what the worker and the re-export scheduler rebuild from the row
        assert (back.dtype, back.quant) == (request.dtype, request.quant) and export.quant["block_size"] == 64


def test_builds_with_different_quant_options_are_separate_in_the_catalog_and_for_reexports(tmp_path, checkpoint):
    from services.catalog.database import session_scope
    from services.catalog.exports import transition
    from services.catalog.models import ExportStatus
    from services.catalog.views import latest_ready
    from services.jobs import submit_export
    from services.scheduler import _is_latest_of_its_slot

    settings = _catalog(tmp_path, checkpoint)
    with session_scope(settings.catalog_url) as session:
        rows = []
        for quant in ({}, {"block_size": 64, "lm_head_bits": 8}, {"int8_layers": [0]}):
            export, _ = submit_export(session, settings, ExportRequest(model="tiny-llama", dtype="int4", quant=quant))
            transition(session, export, ExportStatus.RUNNING)
            transition(session, export, ExportStatus.READY)
            rows.append(export)
        session.flush()
        slots = latest_ready(session)["tiny-llama"]
        assert sorted(slots) == ["attn_dynamic-int4-b32s-int8l0-cpu", "attn_dynamic-int4-b64s-lm8-cpu",
                                 "attn_dynamic-int4-cpu"]
        assert all(_is_latest_of_its_slot(session, row) for row in rows)  # each is the newest of its own build


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_the_weight_gate_quantizes_independently_as_onnxruntime_does_bit_for_bit(dtype, bits, symmetric):
    """The gate's own numpy quantizer (its exact test of a MatMulNBits weight) against onnxruntime's
    quantizer on rows with ties, zero blocks, a K that is not a multiple of the block, and outliers."""
    from exporter.graph.passes.quantize import QuantScheme, quantize_block
    from exporter.validation.gates.weights import quantize_rows

    rng = np.random.default_rng(bits + symmetric)
    rows = (rng.standard_normal((512, 1000)) * 0.02).astype(dtype)
    rows[0, :32] = 0  # a block of zeros: scale 0
    rows[1, :32] = np.linspace(-1, 1, 32)  # values landing on half steps
    rows[2, 5] = 3.0  # an outlier sets its block's scale
    scheme = QuantScheme(bits, 32, symmetric)
    want = quantize_block(np.ascontiguousarray(rows.T), scheme)
    got = quantize_rows(rows, bits, 32, symmetric)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1].view(np.uint8), want[1].reshape(got[1].shape).view(np.uint8))
    if not symmetric:
        assert np.array_equal(got[2], want[2].reshape(got[2].shape))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_parallel_quantizer_gives_the_serial_ones_bytes_on_a_real_weight(dtype, monkeypatch):
    """A trained weight (Qwen2.5-Coder-0.5B's first gate/up projection, packed as the export packs
    it) quantized block by block on several threads at once gives the bytes one thread gives, and
    those onnxruntime's quantizer gives for the whole weight in one call: the blocks are only a
    way to bound memory and spread the work."""
    import threading

    import onnx_ir as ir

    import exporter.graph.passes.quantize as quantize
    from exporter.packaging.checkpoint import Checkpoint, CheckpointTensor, WeightPart
    from tests.real_model import real_checkpoint

    checkpoint = Checkpoint(real_checkpoint("qwen2.5-coder-0.5b-instruct"))
    parts = tuple(WeightPart(f"model.layers.0.mlp.{p}_proj.weight") for p in ("gate", "up"))
    weight = CheckpointTensor(checkpoint, parts, {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16}[dtype],
                              transposed=True, name="gate_up.T")
    scheme = quantize.QuantScheme(4, 32, False)
    threads = set()
    block = quantize.quantize_block

    def seen(weight_kn, scheme):
        threads.add(threading.current_thread().name)
        return block(weight_kn, scheme)

    monkeypatch.setattr(quantize, "quantize_block", seen)

    def joined(workers: int) -> list[np.ndarray]:
        pieces = list(quantize._Quantization(weight, scheme).blocks(workers=workers))
        return [np.concatenate([p[i] for p in pieces]) for i in (1, 2, 3)]

    serial = joined(1)
    assert threads == {threading.current_thread().name}
    threads.clear()
    parallel = joined(4)
    assert len(threads) > 1 and threading.current_thread().name not in threads  # the workers quantized
    whole = block(weight.numpy(), scheme)  # [K, N] in one call
    for one, many, once in zip(serial, parallel, whole):
        assert one.dtype == many.dtype and np.array_equal(one.view(np.uint8), many.view(np.uint8))
        assert np.array_equal(one.view(np.uint8), once.reshape(one.shape).view(np.uint8))


@pytest.mark.parametrize("dtype,activations", [("fp16", "fp16"), ("int4", "fp32"), ("int4", "bf16")])
def test_the_weight_gate_checks_a_long_slice_on_several_threads_and_still_finds_one_wrong_element(
        checkpoint, tmp_path, monkeypatch, dtype, activations):
    """The weight gate splits a slice into spans of rows, checked on every thread it has (an LM head
    is not left to one thread at the end), and a wrong element in the last span still fails it.
    bf16 quantized weights have no exact answer (the exporter's own numpy quantizer made them): their
    statistics go span by span too, and sum to the figures one pass over the slice gives."""
    import threading

    from exporter.packaging.checkpoint import Checkpoint
    from exporter.validation.gates import weights

    bf16 = activations == "bf16"
    out = _export(checkpoint("llama"), tmp_path / activations, dtype=dtype, ep="cuda" if bf16 else "cpu",
                  quant={"activations": "bf16"} if bf16 else None)
    manifest = json.loads((out / "manifest.json").read_text())
    head = next(name for name, entry in manifest["initializers"].items()
                if [p["tensor"] for p in entry.get("parts", [])] == ["lm_head.weight"])
    monkeypatch.setattr(weights, "BLOCK_BYTES", 64 * 8 * 8)  # quantized: 8 rows of K = 64 a block
    monkeypatch.setattr(weights, "EXACT_BLOCK_ELEMS", 64 * 8)  # float: 8 rows a block
    monkeypatch.setattr(weights, "SPAN_BLOCKS", 2, raising=False)
    monkeypatch.setattr(weights, "compare_threads", lambda: 3)
    seen, heads, both = [], set(), threading.Event()
    checks = (("_compare_quantized", 5),) if bf16 else (("_exact_part", 4), ("_exact_quantized", 5))
    for check, part in checks:  # where each takes the checkpoint part
        def spy(*args, _check=getattr(weights, check), _part=part, **kwargs):
            thread = threading.current_thread().name
            seen.append((args[_part]["tensor"], thread))
            if args[_part]["tensor"] == "lm_head.weight":
                # A span of the head holds its thread until another thread has a span of it too (at
                # most 5 s): spans this small would otherwise all go to whichever thread is first, and
                # on a loaded machine that says nothing of whether they could go to several.
                heads.add(thread)
                if len(heads) > 1:
                    both.set()
                both.wait(5)
            return _check(*args, **kwargs)

        monkeypatch.setattr(weights, check, spy)

    def gate():
        return weights.weight_integrity(out / "model.onnx", manifest, Checkpoint(checkpoint("llama")), dtype,
                                        activations)

    (result, _), stats = gate()
    assert result.passed
    head_checks = [thread for tensor, thread in seen if tensor == "lm_head.weight"]
    assert len(head_checks) > 2 and len(set(head_checks)) > 1  # spans of the one slice, on several threads
    if bf16:  # the spans' figures summed in turn: one pass over each slice on one thread gives the same
        monkeypatch.setattr(weights, "SPAN_BLOCKS", 10 ** 6)
        monkeypatch.setattr(weights, "compare_threads", lambda: 1)
        assert [s.to_dict() for s in gate()[1]] == [s.to_dict() for s in stats]
        monkeypatch.setattr(weights, "SPAN_BLOCKS", 2)
        monkeypatch.setattr(weights, "compare_threads", lambda: 3)
    stored = np.float16 if dtype == "fp16" else np.uint8

    def last_wrong(values):
        values[-1] = values[-1] + 1 if dtype == "fp16" else values[-1] ^ 0xFF
        return values

    _edit_external(out, head, stored, last_wrong)
    result = gate()[0][0]
    assert not result.passed and head in result.message
