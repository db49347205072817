"""Quantized image-text exports (issue 48) are judged on text as a text export is: the quality gate (teacher-forced
agreement, mean KL, perplexity against the unquantized fp32 model on the same windows of real English) runs the export
as its runtime runs a text prompt (ids -> embedding graph -> decoder on inputs_embeds, Qwen's text-only M-RoPE
positions) against transformers' image-text model on the same ids; the image prompts' teacher-forced steps report the
same figures beside it. On cuda their activations are measured as a text export's are, on the image-text model's
language model: fp16 where they fit; where they do not, the bf16 image-text export, a Qwen3.5 hybrid's as every other
family's."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

from exporter import contract
from exporter.errors import ExportError, ValidationFailed
from exporter.packaging.resolve import resolve_source
from exporter.pipeline import _activations, export_model
from exporter.request import ExportRequest
from exporter.runtime.image_text import open_image_text
from exporter.validation import reference
from exporter.validation.activation_range import quality_windows
from exporter.validation.gates import GateResult
from exporter.validation.gates.quality import export_logits, reference_logits, score
from exporter.validation.image_text import load_image_text_reference
from exporter.validation.validate import IMAGE_TEXT_NO_ADVICE, _advise_quantization, validate_export
from exporter.vision.tiny_checkpoint import TEXT, make_tiny_vlm_checkpoint
from tests.quantized_reference import dequantized_checkpoint

pytest.importorskip("transformers")

MAX_SEQ_LEN = 192  # gemma3's two-image prompt (2 x 16 image tokens + 12 text) and 24 steps fit; the windows are 128
VOCAB = TEXT["vocab_size"]  # the tiny checkpoints' (no tokenizer: the quality text's bytes mapped into it)
VERDICTS = ("next-token agreement", "mean KL", "perplexity increase")


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality-ckpt")
    return functools.cache(lambda case, seed=0: make_tiny_vlm_checkpoint(case, root / f"{case}-{seed}", seed=seed))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, vlm_checkpoint):
    """quantized(case, dtype, **quant) -> (the export's directory, its report as validation wrote it), exported once
    per arguments through export_model with validation (a failed verdict still publishes the folder and its report)."""
    root = tmp_path_factory.mktemp("quality-exports")

    @functools.cache
    def make(case: str, dtype: str, quant: tuple = ()):
        request = ExportRequest(model=str(vlm_checkpoint(case)), dtype=dtype, ep="cpu", variant="attn_dynamic",
                                max_seq_len=MAX_SEQ_LEN, quant=dict(quant) or None)
        out = root / f"{case}-{dtype}-{len(quant)}"
        try:
            export_model(request, out)
        except ValidationFailed:
            pass
        return out, json.loads((out / contract.REPORT_JSON).read_text())

    return make


def _quality_gates(report: dict) -> dict[str, dict]:
    return {next((v for v in VERDICTS + ("measurement check", "decode steps") if v in g["check"]), g["check"]): g
            for g in report["gates"] if g["gate"] == "quality"}


@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("case", ["gemma3", "qwen3_5"])
def test_a_quantized_image_text_export_gets_the_quality_gate_of_a_text_export(quantized, vlm_checkpoint, case, dtype):
    """The report holds the quality figures and the gate's checks (the measurement check, informational without a
    tokenizer; the three verdicts at the dtype's thresholds; decode through the cache against the export's own
    prefill); the figures are the export's own logits scored against transformers' image-text model on the windows,
    recomputed here by driving the three graphs and the model directly; parity_report.md says them."""
    out, report = quantized(case, dtype)
    quality = report["quality"]
    gates = _quality_gates(report)
    print(f"{case} {dtype}: agreement {quality['agreement']:.4f} ({quality['decisive_positions']} decisive), "
          f"KL {quality['kl_mean']:.4g}, ppl {quality['ppl_delta']:+.2%}; verdicts "
          f"{[gates[v]['status'] for v in VERDICTS]}")
    assert quality["positions"] > 400 and quality["tokenizer"] == "bytes"
    assert gates["measurement check"]["status"] == "info"
    assert {gates[v]["status"] for v in VERDICTS} <= {"pass", "fail"}  # judged
    assert gates["mean KL"]["threshold"] == {"int4": 0.25, "int8": 0.05}[dtype]
    assert gates["decode steps"]["measured"] < 1e-3 * gates["decode steps"]["details"]["logit_range"]

    source = vlm_checkpoint(case)
    chunks = quality_windows(source, VOCAB, MAX_SEQ_LEN)
    ref = reference_logits(load_image_text_reference(source), chunks)
    runtime = open_image_text(out, "cpu")
    again = score(chunks, ref, export_logits(runtime.decoder, chunks), "bytes").to_dict()
    for key in ("agreement", "kl_mean", "ppl_reference", "ppl_export"):
        assert again[key] == pytest.approx(quality[key], rel=1e-6), key
    assert quality["kl_mean"] > 1e-4  # the export's logits are its quantized weights', not the reference's

    markdown = (out / contract.REPORT_MD).read_text()
    assert "Quality against the unquantized reference" in markdown and "steps mean KL (nats)" in markdown
    for prompt in report["components"]["end_to_end"]:  # the image prompts' steps: the same figures, reported
        assert prompt["steps_kl_mean"] > 0 and 0 <= prompt["steps_agreement_all"] <= 1
    assert all(g["status"] == "info" for g in report["gates"] if g["gate"] == "parity")


@pytest.mark.parametrize("case", ["gemma3", "qwen3_5"])
def test_against_its_own_dequantized_weights_the_quality_figures_vanish(quantized, vlm_checkpoint, case, tmp_path):
    """Both sides of the figures are what they claim: an int4 export with fp32 activations (accuracy_level 0), scored
    against the checkpoint whose quantized weights are their own quantize-dequantize, agrees everywhere with a KL of
    fp32 rounding, and so do its image prompts' steps; against the real checkpoint it does not. (gemma3's tied head
    is kept float: quantized, it would read codes where the embedding graph reads the table.)"""
    keep = (("keep", ("lm_head",)),) if case == "gemma3" else ()
    out, report = quantized(case, "int4", (("accuracy_level", 0), *keep))
    exact, _ = dequantized_checkpoint(vlm_checkpoint(case), out, tmp_path / "dequantized")
    own = validate_export(out, reference=str(exact))
    print(f"{case} int4: KL {report['quality']['kl_mean']:.4g} against the checkpoint, {own.quality['kl_mean']:.3g} "
          f"against its dequantized weights")
    assert own.quality["kl_mean"] < 1e-8 and own.quality["agreement_all"] == 1.0
    assert all(p["steps_kl_max"] < 1e-8 for p in own.components["end_to_end"])
    assert report["quality"]["kl_mean"] > 1e4 * own.quality["kl_mean"]


def test_a_decoder_that_is_not_the_reference_fails_the_kl_gate(quantized, vlm_checkpoint, tmp_path):
    """The control: the int8 gemma3 export, validated against its checkpoint with one language-model weight perturbed
    (the vision and embedding weights untouched, so those gates still pass), fails the mean-KL verdict."""
    import torch
    from safetensors.torch import load_file, save_file

    out, report = quantized("gemma3", "int8")
    assert report["status"] == "passed", report["failed_gates"]
    other = shutil.copytree(vlm_checkpoint("gemma3"), tmp_path / "perturbed")
    perturbed = []
    for file in other.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if "language_model" in n and n.endswith("layers.0.mlp.down_proj.weight")]:
            # noise as large as the weights (not a scale: gemma3 norms the MLP's output)
            noise = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))
            tensors[name] = tensors[name] + 0.2 * noise
            perturbed.append(name)
        save_file(tensors, file, metadata={"format": "pt"})
    assert len(perturbed) == 1
    judged = validate_export(out, reference=str(other))
    kl = next(g for g in judged.gates if g.gate == "quality" and g.check.startswith("mean KL"))
    print(f"gemma3 int8 against a perturbed decoder: KL {kl.measured} (limit {kl.threshold}); "
          f"its own checkpoint: {report['quality']['kl_mean']:.4g}")
    assert kl.status == "fail" and kl.measured > 0.05 > report["quality"]["kl_mean"]
    assert all(g.status != "fail" for g in judged.gates if g.gate in ("vision", "embedding"))


@pytest.mark.parametrize("case", ["gemma3", "qwen3_5"])
def test_the_image_text_model_on_text_is_the_language_model_s_reference(vlm_checkpoint, case):
    """One key keeps the windows' logits of a checkpoint whichever reference computed them (an activation measurement
    on the image-text model, validation of an image-text export, or of a language-model-alone export through the
    streamed causal LM): on text ids the two are one model, the same logits."""
    source = vlm_checkpoint(case)
    chunks = quality_windows(source, VOCAB, MAX_SEQ_LEN)
    whole = reference_logits(load_image_text_reference(source), chunks)
    streamed = reference.open_reference(source)
    try:
        alone = reference_logits(streamed, chunks)
    finally:
        streamed.close()
    worst = max(float(np.abs(a - b).max() / np.ptp(a)) for a, b in zip(whole, alone))
    print(f"{case}: {type(streamed.model).__name__} vs the image-text model: {worst:.2e} of the logit range")
    assert worst <= 1e-6


def _loud(source, out, scale):
    """``source`` with its token embedding ``scale`` times larger: activations far beyond fp16's range, as a real
    Gemma 3's residual stream goes past its largest value."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v * scale if "embed_tokens" in k else v for k, v in tensors.items()}, file,
                  metadata={"format": "pt"})
    return out


def _cuda_int4(source, **kw):
    return ExportRequest(model=str(source), dtype="int4", ep="cuda", variant="gqa", max_seq_len=MAX_SEQ_LEN, **kw)


def test_a_cuda_quantized_image_text_request_is_measured_and_validation_reuses_the_pass(
        quantized, vlm_checkpoint, tmp_path):
    """The measurement runs the quality windows through the image-text model in fp32, watching its language model
    and head: fp16, saying why; its logits are the quality gate's reference, kept where validation finds them (a cpu
    int4 export of the same checkpoint validates on them, to the same figures). A request that names its
    activations is not measured."""
    source = resolve_source(str(vlm_checkpoint("gemma3")))
    activations, chosen = _activations(_cuda_int4(source.path), source, False, "gemma3", tmp_path, None)
    print(f"gemma3 int4 cuda: {activations.value}, {chosen['why']}")
    assert activations.value == "fp16" and chosen["by"] == "measurement" and chosen["tokens"] == 512
    assert chosen["where"].startswith("decoder layer 0") or chosen["where"].startswith("lm_head")
    assert chosen["measured_on"] == "the image-text model's language model" and len(chosen["layer_peaks"]) == 1

    chunks = quality_windows(source.path, VOCAB, MAX_SEQ_LEN)
    _, kept = reference.cached_window_logits(tmp_path, source.revision, chunks)
    assert kept is not None
    expected = reference_logits(load_image_text_reference(source.path), chunks)
    assert all(np.array_equal(a, b) for a, b in zip(kept, expected))
    out, report = quantized("gemma3", "int4")
    shared = validate_export(out, reference_cache=tmp_path)
    assert shared.timings_s["reference_cached"] == 1.0 and shared.quality == pytest.approx(report["quality"])

    named = _cuda_int4(source.path, quant={"activations": "fp16"})
    assert _activations(named, source, False, "gemma3", None, None)[1]["by"] == "request"


@pytest.mark.parametrize("case, scale", [("gemma3", 8000.0), ("qwen3_5", 1e5)])
def test_activations_beyond_fp16_make_the_bf16_image_text_export(vlm_checkpoint, tmp_path, case, scale):
    """Where the activations do not fit fp16, the export computes in bf16 as a bf16 request of the checkpoint would:
    its image-text export (vision, embedding and the decoder on inputs_embeds) in bf16, a Qwen3.5 hybrid's too. Built,
    not validated: onnxruntime's CPU EP cannot run bf16 graphs (tests/test_vlm_bf16.py checks them on CUDA)."""
    import onnx

    loud = _loud(vlm_checkpoint(case), tmp_path / f"loud-{case}", scale)
    result = export_model(_cuda_int4(loud), tmp_path / case, validate=False)
    manifest = result.manifest.data
    quantization = manifest["quantization"]
    chosen = quantization["activations_chosen"]
    print(f"{case} x {scale:g} int4 cuda: {quantization['activations']}, {chosen['why']}")
    assert quantization["activations"] == "bf16" and chosen["by"] == "measurement" and chosen["peak"] * 2 > 65504
    assert chosen["measured_on"] == "the image-text model's language model"
    assert manifest["task"] == contract.IMAGE_TEXT_TASK and manifest["image_text"]["model_type"] == case
    components = manifest["image_text"]["components"]
    for component in (contract.VISION, contract.EMBEDDING):
        assert components[component]["dtype"] == "BFLOAT16"
        assert (result.out_dir / components[component]["file"]).is_file()
    decoder = onnx.load(str(result.out_dir / contract.MODEL_FILE), load_external_data=False).graph
    inputs = {v.name: v.type.tensor_type.elem_type for v in decoder.input}
    assert contract.INPUT_IDS not in inputs and inputs[contract.INPUTS_EMBEDS] == onnx.TensorProto.BFLOAT16


def test_a_failed_int4_image_text_verdict_says_why_no_recipe_is_advised():
    """The advice simulates int4 recipes on a text export's streamed reference, which an image-text checkpoint's is
    not: the failed check and the report say so instead of measuring."""
    failed = GateResult("quality", "mean KL(reference || export) per token (nats)", False, 0.9, 0.25, "mean KL 0.9")
    quality = {"tokenizer": "checkpoint"}
    manifest = {"request": {"model": "m", "dtype": "int4", "ep": "cpu"}}
    assert not _advise_quantization([failed], quality, manifest, "int4", "fp32", None, {}, None, None, None,
                                    image_text=True)
    assert failed.message == f"mean KL 0.9; {IMAGE_TEXT_NO_ADVICE}"
    assert quality["advice"] == {"skipped": IMAGE_TEXT_NO_ADVICE}
