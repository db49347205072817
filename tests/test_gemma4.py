"""Gemma 4 (text) built by hand (gemma4_text): every variant against transformers on the CPU.

The tiny checkpoint (exporter/tiny_checkpoint.py ARCH_CONFIGS["gemma4_text"]) switches on every feature of the text
decoder at once: per-layer inputs (PLE), global layers with their own head size whose values are their keys
(attention_k_eq_v) in fewer KV heads, rotated by the proportional rope, the last two layers reading layers 2 and 3's
keys and values (num_kv_shared_layers) through MLPs twice as wide, the sliding window, layer scalars off 1 and
soft-capped logits. A second layout gives the global layers values of their own and drops the per-layer inputs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime_genai as og
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.graph.architectures import ARCHITECTURES as REGISTRY
from exporter.graph.build import build_model
from exporter.graph.config import load_model_config
from exporter.packaging.resolve import resolve_source
from exporter.pipeline import export_model
from exporter.request import ExportRequest, Variant
from exporter.runtime.session import Decoder
from exporter.tiny_checkpoint import TINY_TOKENIZER_VOCAB, make_tiny_checkpoint, make_tiny_tokenizer
from exporter.validation.parity import run_batch_parity, run_parity
from exporter.validation.reference import load_reference, reference_greedy
from tests.conftest import DECODE_STEPS, MAX_SEQ_LEN, VARIANTS
from tests.genai_greedy import genai_greedy
from tests.test_new_families import PROMPT, _close, _nodes, _with_config

ARCH = "gemma4_text"
# Values projected apart (v_proj, two KV heads on the global layers too), no per-layer inputs; sharing stays on.
OWN_VALUES = (("attention_k_eq_v", False), ("hidden_size_per_layer_input", 0))
LAYOUTS = {"every-feature": (), "own-values": OWN_VALUES}
# (exported / reference are cached by their arguments as given: every call spells out dtype and layout.)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_matches_transformers(layout, variant, exported, reference):
    ref = reference(ARCH, PROMPT, LAYOUTS[layout])
    result = run_parity(Decoder(exported(ARCH, variant, "fp32", LAYOUTS[layout])), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("variant", ["attn_dynamic", "attn_static"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_left_padded_batch_matches_each_prompt_alone(layout, variant, exported, reference):
    """Batch 2, prompts of 20 and 9 tokens: attn_dynamic left-pads the short row, attn_static prefills rows apart."""
    refs = [reference(ARCH, PROMPT, LAYOUTS[layout]), reference(ARCH, 9, LAYOUTS[layout])]
    decoder = Decoder(exported(ARCH, variant, "fp32", LAYOUTS[layout]))
    for ref, result in zip(refs, run_batch_parity(decoder, refs, near_tie_margin=0.0)):
        assert _close(result), result
        assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("variant", ["gqa", "attn_dynamic"])
def test_fp16_matches_transformers_except_near_ties(variant, exported, reference):
    ref = reference(ARCH, PROMPT)
    result = run_parity(Decoder(exported(ARCH, variant, "fp16", ())), ref, near_tie_margin=0.1)
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    assert len(result.near_ties) <= result.steps // 2
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


def test_int4_is_exact_to_its_dequantized_weights(checkpoint, reference, tmp_path):
    """int4 with fp32 activations (accuracy_level 0) against transformers on the checkpoint whose quantized weights
    are replaced by their own quantize-dequantize: the packed [q | k] of the global layers, the q-only projections of
    the KV-shared ones and the per-layer input projections quantize row by row as their sources."""
    from tests.quantized_reference import dequantized_checkpoint

    source = checkpoint(ARCH)
    request = ExportRequest(model=str(source), dtype="int4", ep="cpu", variant="attn_dynamic",
                            quant={"accuracy_level": 0})
    out = export_model(request, tmp_path / "int4", validate=False).out_dir
    deq, schemes = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    assert {"model.per_layer_model_projection.weight", "model.layers.5.per_layer_input_gate.weight",
            "model.layers.5.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"} <= set(schemes)
    ref = reference_greedy(load_reference(deq), reference(ARCH, PROMPT).prompt, DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_shared_layers_carry_no_cache_and_global_layers_their_own_shapes(variant, checkpoint, exported):
    """Layers 4 and 5 read layers 2 and 3's keys and values: no cache of their own. The global layers' caches hold
    one KV head of 32, the sliding layers' two of 16; every layer attends (six attention ops)."""
    cfg = load_model_config(checkpoint(ARCH), REGISTRY)
    assert [cfg.kv_source(i) for i in range(cfg.num_layers)] == [0, 1, 2, 3, 2, 3]
    assert cfg.layer_intermediate == (128, 128, 128, 128, 256, 256)
    model = onnx.load(str(exported(ARCH, variant, "fp32", ()) / contract.MODEL_FILE), load_external_data=False)
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}
    for i in range(cfg.num_layers):
        names = contract.cache_names(Variant(variant), i)
        if i >= 4:
            assert not set(names) & set(dims), names
            continue
        heads, width = (1, 32) if i % 2 else (2, 16)
        for name in names:
            assert dims[name][-1] == heads * width if variant == "attn_static" else dims[name][1:4:2] == [heads, width]
    ops = [n for n in model.graph.node if n.op_type in ("Attention", "GroupQueryAttention")]
    assert len(ops) == cfg.num_layers


def test_the_proportional_rope_is_transformers_own():
    """The global layers' rope: a quarter of a 32-wide head's angles turn, the rest stay 0 (transformers' tables)."""
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from exporter.graph.rope_init import inv_freq

    config = transformers.Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                           head_dim=16, global_head_dim=32)
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    got, scaling = inv_freq("proportional", config.rope_parameters["full_attention"], 32, 256)
    assert scaling == 1.0 and torch.equal(got, want) and int((got != 0).sum()) == 4


@pytest.mark.parametrize("changes, message", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
     r"gemma4_text with enable_moe_block .* is not exported yet"),
    ({"use_bidirectional_attention": "all"}, r"use_bidirectional_attention \"all\" attends both ways"),
])
def test_what_the_exporter_does_not_build_is_refused_by_name(changes, message, checkpoint, tmp_path):
    path = _with_config(checkpoint(ARCH), tmp_path, **changes)
    with pytest.raises(ExportError, match=message):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


def test_the_compat_target_matches_transformers_with_a_left_padded_batch(checkpoint, reference, tmp_path):
    """attn_dynamic for older onnxruntime: the KV-shared layers attend over their source's present through
    MultiHeadAttention, as every compat layer does (tests/test_compat.py runs it in onnxruntime 1.21 too)."""
    request = ExportRequest(model=str(checkpoint(ARCH)), ep="cpu", variant="attn_dynamic", compat=True)
    out = export_model(request, tmp_path / "compat", validate=False).out_dir
    assert "MultiHeadAttention" in {n.op_type for n in _nodes(out)}
    refs = [reference(ARCH, PROMPT, ()), reference(ARCH, 9, ())]
    for ref, result in zip(refs, run_batch_parity(Decoder(out), refs, near_tie_margin=0.0)):
        assert _close(result), result
        assert result.tokens == ref.tokens, result.mismatches


def test_the_hf_layout_is_refused_by_name(checkpoint, tmp_path):
    with pytest.raises(ExportError, match=r"no hf layout for a gemma4_text model: transformers.js 4.3 feeds a cache to "
                                          r"every layer, all alike"):
        export_model(ExportRequest(model=str(checkpoint(ARCH)), layout="hf"), tmp_path / "hf", validate=False)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-genai")
    source = make_tiny_checkpoint(ARCH, root / "ckpt", vocab_size=TINY_TOKENIZER_VOCAB)
    return make_tiny_tokenizer(source)


@pytest.mark.parametrize("variant", ["gqa", "attn_dynamic"])
def test_the_genai_package_generates_transformers_tokens(variant, tokenized, tmp_path):
    """onnxruntime-genai 0.18 reads each cache's KV heads and head size off the graph; it feeds the caches of layers
    0..3 (num_hidden_layers 4: the KV-shared layers 4 and 5 carry none) and greedy-decodes transformers' tokens."""
    request = ExportRequest(model=str(tokenized), ep="cpu", variant=variant, max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / variant, validate=False).out_dir
    manifest = json.loads((out / contract.MANIFEST_FILE).read_text())
    assert manifest["genai"]["package"], manifest["genai"]["reason"]
    decoder = json.loads((out / contract.GENAI_CONFIG_FILE).read_text())["model"]["decoder"]
    assert decoder["num_hidden_layers"] == 4
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, TINY_TOKENIZER_VOCAB, size=12)]
    want = reference_greedy(load_reference(tokenized), prompt, 20).tokens
    assert genai_greedy(og.Model(str(out)), prompt, 20) == want


def test_the_per_layer_inputs_gather_and_mix_once_for_every_layer(exported):
    """One per-layer embedding gather and one projection of the embedded tokens serve all six layers."""
    nodes = _nodes(exported(ARCH, "attn_dynamic", "fp32", ()))
    gathers = [n for n in nodes if n.op_type == "Gather" and "embed_tokens_per_layer" in " ".join(n.input)]
    assert len(gathers) == 1


# Gemma 4 as Google publishes it (Gemma4ForConditionalGeneration): the text decoder above under model.language_model,
# beside a vision tower; its language model is exported alone, as qwen3_5's image-text checkpoints are.
IMAGE_TEXT = "gemma4"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_image_text_checkpoint_s_language_model_matches_transformers(variant, exported, reference):
    ref = reference(IMAGE_TEXT, PROMPT)
    result = run_parity(Decoder(exported(IMAGE_TEXT, variant, "fp32")), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


def test_the_image_text_checkpoint_s_validated_export_passes_every_gate(checkpoint, tmp_path):
    """The whole validation: the weight gate reads every language-model tensor back (the towers are not the export's),
    parity against Gemma4ForConditionalGeneration's text-only forward, the genai gate."""
    request = ExportRequest(model=str(checkpoint(IMAGE_TEXT)), dtype="fp16", ep="cpu", variant="gqa")
    out = export_model(request, tmp_path / "export", validate=True).out_dir
    report = json.loads((out / "parity_report.json").read_text())
    assert report["status"] == "passed" and not report["failed_gates"], report["failed_gates"]


def test_the_image_text_checkpoint_s_genai_package_generates_transformers_tokens(tmp_path):
    source = make_tiny_tokenizer(make_tiny_checkpoint(IMAGE_TEXT, tmp_path / "ckpt", vocab_size=TINY_TOKENIZER_VOCAB))
    request = ExportRequest(model=str(source), ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "gqa", validate=False).out_dir
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, TINY_TOKENIZER_VOCAB, size=12)]
    want = reference_greedy(load_reference(source), prompt, 20).tokens
    assert genai_greedy(og.Model(str(out)), prompt, 20) == want
