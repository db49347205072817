"""Hybrids (recurrent layers beside attention layers): every family x variant against transformers on the
CPU, through each variant's own cache contract and the recurrent states carried between calls.

The tiny checkpoints (exporter/tiny_checkpoint.py TEXT_HYBRID_ARCHITECTURES: Qwen3.5's image-text checkpoints are
image-text exports, tests/test_genai_vlm_qwen3_5.py, their language models here) interleave two recurrent layers
with two attention layers (nemotron_h: six one-mixer blocks; falcon_h1: two layers of attention and Mamba2
side by side); prompts of 70 tokens run past the convolution's window (3-4 taps) and past
GatedDeltaNet's chunk (64 tokens), so a prefill crosses chunks and the state it leaves is what decode
continues from.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.graph.build import build_model
from exporter.packaging.resolve import resolve_source
from exporter.request import ExportRequest
from exporter.runtime.session import Decoder
from exporter.tiny_checkpoint import TEXT_HYBRID_ARCHITECTURES
from exporter.validation.parity import run_batch_parity, run_parity

VARIANTS = ["attn_dynamic", "gqa", "attn_static"]
LONG_PROMPT = 70  # > GatedDeltaNet's 64-token chunk and the convolutions' windows
# The bar: fp32 logits within 1e-4 of the reference's logit range.
FP32_TOLERANCE = 1e-4


def _close(result) -> bool:
    return result.prefill_max_abs_error <= FP32_TOLERANCE * result.logit_range


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_fp32_matches_transformers_over_a_long_prompt(arch, variant, exported, reference):
    ref = reference(arch, prompt_len=LONG_PROMPT)
    result = run_parity(Decoder(exported(arch, variant)), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_a_prompt_fed_in_chunks_continues_from_the_state_it_left(arch, exported, reference):
    """Three calls of 24, 23 and 23 tokens: each continues from the conv and recurrent states the one
    before left (multi-token continuation, as a chunked prefill or a second turn runs)."""
    ref = reference(arch, prompt_len=LONG_PROMPT)
    for variant in ("attn_dynamic", "attn_static"):
        result = run_parity(Decoder(exported(arch, variant)), ref, near_tie_margin=0.0, prefill_chunks=3)
        assert _close(result), (variant, result)
        assert result.tokens == ref.tokens, (variant, result.mismatches)


@pytest.mark.parametrize("variant", ["attn_dynamic", "attn_static"])
@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_a_left_padded_batch_matches_each_prompt_alone(arch, variant, exported, reference):
    """Batch 2, prompts of 70 and 9 tokens: attn_dynamic left-pads the short row by 61 tokens, which must
    leave its states as if its prompt started at its first real token; attn_static prefills rows apart."""
    refs = [reference(arch, prompt_len=LONG_PROMPT), reference(arch, prompt_len=9)]
    results = run_batch_parity(Decoder(exported(arch, variant)), refs, near_tie_margin=0.0)
    for ref, result in zip(refs, results):
        assert _close(result), result
        assert result.tokens == ref.tokens, result.mismatches


def test_a_gqa_hybrid_refuses_a_ragged_batch_by_name(exported):
    """GroupQueryAttention takes right padding, which would run the padding through the recurrent states:
    a ragged batch is refused with what to do instead; one of equal lengths runs."""
    lm = Decoder(exported("qwen3_5_text", "gqa"))
    with pytest.raises(ValueError, match="one length.*attn_dynamic takes ragged batches"):
        lm.prefill([[5, 6, 7], [8, 9]], lm.new_state(batch=2))
    assert lm.prefill([[5, 6, 7], [8, 9, 10]], lm.new_state(batch=2)).shape[0] == 2


# A near tie here is a top-2 gap under 0.25 (0.1 for the dense families of tests/test_parity.py): fp16
# moves a routed model's router logits enough to change an expert now and then. Measured on the tiny
# qwen3_5_moe: transformers' own fp16 run (teacher-forced) flips steps whose gaps are 0.075 and 0.011, and
# this export one of gap 0.22 on the CPU (none on an H200: benchmarks/results/h200/hybrid_cuda_parity.json).
FP16_NEAR_TIE = 0.25


@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_fp16_matches_transformers_except_near_ties(arch, exported, reference):
    ref = reference(arch, prompt_len=LONG_PROMPT)
    result = run_parity(Decoder(exported(arch, "gqa", "fp16")), ref, near_tie_margin=FP16_NEAR_TIE)
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    assert len(result.near_ties) <= result.steps // 2
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_quantized_is_exact_to_its_dequantized_weights(arch, dtype, checkpoint, reference, tmp_path):
    """int4 / int8 with fp32 activations (accuracy_level 0) against transformers on the checkpoint whose
    quantized weights are replaced by their own quantize-dequantize: the packed and regrouped
    projections (q | k | v | z, the gated attention's query | gate) quantize row by row exactly as their
    sources; the DeltaNet gates' projection stays float."""
    from exporter.pipeline import export_model
    from exporter.validation.reference import load_reference, reference_greedy
    from quantized_reference import dequantized_checkpoint

    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype=dtype, ep="cpu", variant="attn_dynamic",
                            quant={"accuracy_level": 0})
    out = export_model(request, tmp_path / dtype, validate=False).out_dir
    deq, schemes = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    assert not any("in_proj_b" in name or "in_proj_a." in name or "in_proj_ba" in name for name in schemes)
    prompt = reference(arch, prompt_len=LONG_PROMPT).prompt
    ref = reference_greedy(load_reference(deq), prompt, 24)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("arch", TEXT_HYBRID_ARCHITECTURES)
def test_the_graph_holds_one_fused_recurrence_per_recurrent_layer(arch, exported):
    model = onnx.load(str(exported(arch, "attn_dynamic") / contract.MODEL_FILE), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    config = json.loads({p.key: p.value for p in model.metadata_props}[contract.META_CONFIG])
    recurrent = config["recurrent"]["layers"]
    # nemotron_h's tiny blocks: Mamba2, experts, attention, MLP, Mamba2, experts; the others alternate two and two
    assert recurrent == ([0, 4] if arch == "nemotron_h" else [0, 1] if arch == "falcon_h1" else [0, 2])
    feed_forward = config["recurrent"].get("feed_forward_layers", [])
    assert feed_forward == ([1, 3, 5] if arch == "nemotron_h" else [])
    assert ops.count("CausalConvWithState") == len(recurrent)
    # gated DeltaNet and Mamba2 run their recurrence on GatedDeltaNet (its gated_delta / gated rule); LFM2 has none
    assert ops.count("GatedDeltaNet") == (0 if config["recurrent"]["kind"] == "short_conv" else len(recurrent))
    assert config["recurrent"]["ops"] == ["CausalConvWithState"] + (["GatedDeltaNet"] if "GatedDeltaNet" in ops else [])
    assert not {"Loop", "Scan", "If"} & set(ops)
    assert ops.count("Attention") == len(config["recurrent"]["attention_layers"])
    assert config["recurrent"]["attention_layers"] == (
        [2] if arch == "nemotron_h" else [0, 1] if arch == "falcon_h1" else [1, 3])
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for layer in recurrent:  # states by layer index, past_* in and present_* out; no KV cache (falcon_h1: both)
        past, present = contract.state_names(layer, contract.CONV_STATE)
        assert past in inputs and present in outputs
        assert (f"past_key_values.{layer}.key" in inputs) == (arch == "falcon_h1")
    for layer in feed_forward:  # an MLP / experts block carries nothing
        assert not [name for name in inputs if name.endswith(f".{layer}") or f".{layer}." in name]
        dims = [d.dim_value or d.dim_param for d in inputs[past].type.tensor_type.shape.dim]
        assert dims[0] == contract.BATCH and all(isinstance(d, int) and d > 0 for d in dims[1:])


def test_recurrent_state_is_fp32_in_an_fp16_export(exported):
    model = onnx.load(str(exported("qwen3_next", "gqa", "fp16") / contract.MODEL_FILE), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["past_recurrent.0"] == onnx.TensorProto.FLOAT
    assert types["past_conv.0"] == onnx.TensorProto.FLOAT16
    assert types["past_key_values.1.key"] == onnx.TensorProto.FLOAT16


def _with_config(checkpoint, tmp_path, arch="lfm2", **changes):
    import shutil

    source = checkpoint(arch)
    out = tmp_path / "edited"
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_layer_type_the_exporter_does_not_know_is_refused_by_name(checkpoint, tmp_path):
    """A layer type transformers knows but the exporter does not build for this family (a Mamba layer is
    linear_attention to transformers 5), and one transformers itself refuses: both by name."""
    path = _with_config(checkpoint, tmp_path, layer_types=["linear_attention", "full_attention", "conv", "full_attention"])
    with pytest.raises(ExportError, match=r"unsupported layer types \['linear_attention'\] in config.json of this lfm2 "
                                          r"model: the exporter builds full_attention, conv layers"):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))
    path = _with_config(checkpoint, tmp_path / "2", layer_types=["hyena", "full_attention", "conv", "full_attention"])
    with pytest.raises(ExportError, match=r"transformers refuses .*config.json: .*'hyena'"):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


@pytest.mark.parametrize("changes, message", [
    ({"n_group": 3}, r"n_group 3 / topk_group 1 do not divide 8 experts: n_group must divide n_routed_experts"),
    ({"topk_group": 3}, r"n_group 2 / topk_group 3 do not divide 8 experts: .*topk_group lie between 1 and n_group"),
    ({"norm_topk_prob": False}, r"nemotron_h with norm_topk_prob false .* is not exported"),
])
def test_nemotron_h_routing_the_exporter_cannot_reproduce_is_refused_by_name(changes, message, checkpoint, tmp_path):
    path = _with_config(checkpoint, tmp_path, "nemotron_h", **changes)
    with pytest.raises(ExportError, match=message):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


def test_a_checkpoint_whose_convolution_disagrees_with_its_config_is_refused(checkpoint, tmp_path):
    path = _with_config(checkpoint, tmp_path, conv_L_cache=5)
    with pytest.raises(ExportError, match=r"conv\.conv\.weight is \[64, 1, 3\] but config\.json implies \[64, 1, 5\]"):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_the_recurrent_states_really_carry_the_past(arch, exported):
    """A control for the tests above: decode from zeroed states after a prefill gives other logits than
    from the states the prefill left (the states are read, not ignored)."""
    lm = Decoder(exported(arch, "attn_dynamic"))
    prompt = np.random.default_rng(3).integers(3, 250, size=(1, 20))
    state = lm.new_state()
    lm.forward(prompt, state)
    carried = lm.step([7], _copy(state))
    state.states = lm.new_states(1)
    forgotten = lm.step([7], state)
    assert np.abs(carried - forgotten).max() > 1e-3


def _copy(state):
    import copy

    return copy.deepcopy(state)


@pytest.mark.parametrize("arch", ["nemotron_h", "lfm2_moe", "falcon_h1"])
def test_a_validated_half_export_passes_every_gate(arch, checkpoint, tmp_path):
    """The whole validation of an fp16 export: the structure gate counts attention on nemotron_h's one
    attention block only (its MLP and experts blocks attend to nothing and carry nothing), the sigmoid
    routers' fp32 selection biases are allowed in a half build, the weight gate finds every slice
    (nemotron_h's experts' up rows read twice), the expert known answer and parity pass."""
    from exporter.pipeline import export_model

    request = ExportRequest(model=str(checkpoint(arch)), dtype="fp16", ep="cpu", variant="gqa")
    out = export_model(request, tmp_path / "export", validate=True).out_dir
    report = json.loads((out / "parity_report.json").read_text())
    assert report["status"] == "passed" and not report["failed_gates"], report["failed_gates"]
    census = next(g for g in report["gates"] if g["check"] == "attention op census")
    attending = 1 if arch == "nemotron_h" else 2  # falcon_h1: both its layers attend beside Mamba2
    assert census["measured"] == {"com.microsoft::GroupQueryAttention": attending}
    fp32 = next(g for g in report["gates"] if g["check"].startswith("no float32 initializer"))
    assert fp32["passed"] and not fp32.get("informational")


def _exported_matches_transformers(source, out, variant="attn_dynamic", seed=5, max_seq_len=None):
    """Export the checkpoint ``source`` to ``out`` (unvalidated) and check it against transformers like the tests
    above (1e-4 of the logit range over a 70-token prompt, 24 greedy steps); returns the export's folder."""
    from exporter.pipeline import export_model
    from exporter.validation.reference import load_reference, reference_greedy

    request = ExportRequest(model=str(source), ep="cpu", variant=variant, max_seq_len=max_seq_len)
    exported_dir = export_model(request, out, validate=False).out_dir
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=LONG_PROMPT)]
    ref = reference_greedy(load_reference(source), prompt, 24)
    result = run_parity(Decoder(exported_dir), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches
    return exported_dir


def test_a_dense_nemotron_h_from_its_block_pattern_matches_transformers(tmp_path):
    """Nemotron-H's dense checkpoints (Nemotron-H 8B, Nano 2): Mamba2, attention and relu^2 MLP blocks only,
    named by config.json's hybrid_override_pattern as NVIDIA ships them ("M-M*-": no experts, no moe config)."""
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    source = make_tiny_checkpoint("nemotron_h", tmp_path / "dense",
                                  layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"])
    config = json.loads((source / "config.json").read_text())
    del config["layers_block_type"]
    config["hybrid_override_pattern"] = "M-M*-"
    (source / "config.json").write_text(json.dumps(config))
    out = _exported_matches_transformers(source, tmp_path / "export")
    meta = json.loads({p.key: p.value for p in onnx.load(str(out / contract.MODEL_FILE), load_external_data=False)
                       .metadata_props}[contract.META_CONFIG])
    assert meta["recurrent"]["layers"] == [0, 2] and meta["recurrent"]["feed_forward_layers"] == [1, 4]
    assert "moe" not in meta


@pytest.mark.parametrize("norm", [{"mamba_rms_norm": False}, {"mamba_norm_before_gate": False}])
def test_falcon_h1_s_other_mamba_output_norms_match_transformers(norm, tmp_path):
    """Falcon-H1's Mamba2 output without its norm (only y * silu(z)), and gated before it is normed (as
    Granite's): the default (normed, then gated) is the tiny checkpoint's."""
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    _exported_matches_transformers(make_tiny_checkpoint("falcon_h1", tmp_path / "ckpt", **norm), tmp_path / "export",
                                   seed=6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_stack_without_attention_runs_on_its_states_alone(variant, tmp_path):
    """Mamba2 and MLP blocks only (a depth-truncated Nemotron-H, or an attention-free Mamba2 model): no KV cache
    anywhere, the states carry every token; each variant against transformers."""
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    source = make_tiny_checkpoint("nemotron_h", tmp_path / "ckpt",
                                  layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp"])
    out = _exported_matches_transformers(source, tmp_path / "export", variant, seed=7, max_seq_len=128)
    inputs = [i.name for i in onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).graph.input]
    assert not [name for name in inputs if "key" in name or "value" in name]


# Qwen3.5's published rope: multimodal (interleaved sections over its rotary half), partial.
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
                "mrope_interleaved": True}


@pytest.mark.parametrize("variant", ["attn_dynamic", "gqa", "attn_static"])
@pytest.mark.parametrize("arch", ["qwen3_5_text"])
def test_qwen3_5_s_text_export_takes_plain_positions_and_its_bench_runs(arch, variant, reference, tmp_path):
    """Qwen3.5's rope is multimodal (mrope_section), but a text-only export sees text alone, whose three position
    streams are equal: it takes plain position_ids [batch, seq] (gqa none), as onnxruntime-genai and the bench feed
    them (a decoder that asked for M-RoPE's [3, batch, seq] here failed the bench's device binding), and matches
    transformers. (The image-text checkpoint's export is the image-text one, on M-RoPE positions [3, batch, seq] that
    genai and the farm's image-text runtime compute: tests/test_genai_vlm_qwen3_5.py.)"""
    from exporter.pipeline import export_model
    from exporter.runtime.bench import run_bench
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.reference import load_reference, reference_greedy

    source = make_tiny_checkpoint(arch, tmp_path / "ckpt", rope_parameters=QWEN3_5_ROPE)
    out = export_model(ExportRequest(model=str(source), ep="cpu", variant=variant, static_cache=variant == "attn_static",
                                     max_seq_len=64), tmp_path / "export", validate=False).out_dir
    model = onnx.load(str(out / contract.MODEL_FILE), load_external_data=False)
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    if variant == "gqa":
        assert contract.POSITION_IDS not in inputs
    else:
        assert inputs[contract.POSITION_IDS] == ["batch_size", "sequence_length"]
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 250, size=12)]
    ref = reference_greedy(load_reference(source), prompt, 8)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error <= 1e-4 * result.logit_range and result.tokens == ref.tokens, result
    run_bench(out, "cpu", contexts=[16], steps=2, warmup=1, prefill_lengths=[8])
    assert json.loads((out / "benchmark.json").read_text())["decode"][0]["decode_ms_median"] > 0
