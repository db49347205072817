"""Gemma 4 (text) built by hand (gemma4_text): every variant against transformers on the CPU.

The tiny checkpoint (exporter/tiny_checkpoint.py ARCH_CONFIGS["gemma4_text"]) switches on every feature of the text
decoder at once: per-layer inputs (PLE), global layers with their own head size whose values are their keys
(attention_k_eq_v) in fewer KV heads, rotated by the proportional rope, the last two layers reading layers 2 and 3's
keys and values (num_kv_shared_layers) through MLPs twice as wide, the sliding window, layer scalars off 1 and
soft-capped logits. A second layout gives the global layers values of their own and drops the per-layer inputs.
The experts of Gemma 4 26B-A4B (enable_moe_block) are tested on the first layout, at the end.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
# beside a vision tower; its language model is exported alone (graph/language_model.py LANGUAGE_MODEL_OF).
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


# Gemma 4 26B-A4B's experts (enable_moe_block), shrunk: 4 experts of 32, two a token, beside every layer's dense MLP, on
# the every-feature layout (the tiny checkpoint draws the router's scale and per-expert scales off 1). On the CPU they
# run as standard ops, each expert on the tokens routed to it; for ep cuda through the MoE op's GEGLU.
EXPERTS = (("enable_moe_block", True), ("num_experts", 4), ("top_k_experts", 2), ("moe_intermediate_size", 32))
# CUDA's QMoE takes widths in multiples of 64.
WIDE_EXPERTS = (*EXPERTS[:3], ("moe_intermediate_size", 64))


def _experts(out) -> list[onnx.NodeProto]:
    return [n for n in _nodes(out) if n.op_type in ("MoE", "QMoE")]


def _attributes(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", [ARCH, IMAGE_TEXT])
def test_experts_beside_the_dense_mlp_match_transformers(arch, variant, exported, reference):
    ref = reference(arch, PROMPT, EXPERTS)
    result = run_parity(Decoder(exported(arch, variant, "fp32", EXPERTS)), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("variant", ["attn_dynamic", "attn_static"])
def test_experts_in_a_left_padded_batch_match_each_prompt_alone(variant, exported, reference):
    """The padded positions are routed too (to whatever experts they pick): they must not disturb the real rows."""
    refs = [reference(ARCH, PROMPT, EXPERTS), reference(ARCH, 9, EXPERTS)]
    decoder = Decoder(exported(ARCH, variant, "fp32", EXPERTS))
    for ref, result in zip(refs, run_batch_parity(decoder, refs, near_tie_margin=0.0)):
        assert _close(result), result
        assert result.tokens == ref.tokens, result.mismatches


def test_experts_in_fp16_match_transformers_except_near_ties(exported, reference):
    ref = reference(ARCH, PROMPT, EXPERTS)
    result = run_parity(Decoder(exported(ARCH, "gqa", "fp16", EXPERTS)), ref, near_tie_margin=0.1)
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


def test_the_cpu_export_runs_each_expert_on_its_tokens_without_the_moe_op_or_control_flow(exported):
    """onnxruntime's CPU MoE kernels have no GEGLU: each layer gathers its routed tokens once (NonZero), splits them by
    expert and runs every expert's own MatMuls on its rows; no MoE / QMoE node, no If / Loop / Scan."""
    nodes = _nodes(exported(ARCH, "attn_dynamic", "fp32", EXPERTS))
    ops = [n.op_type for n in nodes]
    assert not _experts(exported(ARCH, "attn_dynamic", "fp32", EXPERTS))
    assert not {"If", "Loop", "Scan"} & set(ops)
    assert ops.count("NonZero") == 6
    expert_weights = {i for n in nodes if n.op_type == "MatMul" for i in n.input if ".experts." in i}
    assert len(expert_weights) == 6 * 4 * 2  # fc1 and fc2 of each of 4 experts, each of 6 layers


def test_int4_experts_are_exact_to_their_dequantized_weights(checkpoint, reference, tmp_path):
    """int4 on the CPU: every expert's two MatMuls become MatMulNBits, quantized row by row as the checkpoint's stacked
    experts are; the routers stay float (they pick where every token goes)."""
    from tests.quantized_reference import dequantized_checkpoint

    source = checkpoint(ARCH, **dict(EXPERTS))
    request = ExportRequest(model=str(source), dtype="int4", ep="cpu", variant="attn_dynamic",
                            quant={"accuracy_level": 0})
    out = export_model(request, tmp_path / "int4", validate=False).out_dir
    deq, schemes = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    assert {"model.layers.0.experts.gate_up_proj", "model.layers.5.experts.down_proj"} <= set(schemes)
    assert not any("router" in name for name in schemes)
    assert [n.op_type for n in _nodes(out)].count("MatMulNBits") >= 6 * 4 * 2
    ref = reference_greedy(load_reference(deq), reference(ARCH, PROMPT, EXPERTS).prompt, DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("dtype, variant, op", [("fp16", "gqa", "MoE"), ("bf16", "attn_static", "MoE"),
                                                ("int4", "gqa", "QMoE")])
def test_for_cuda_the_experts_are_one_geglu_moe_op_a_layer(dtype, variant, op, checkpoint, tmp_path):
    """ep cuda (which this machine cannot run): one MoE (QMoE for int4) a layer with GELU-tanh(gate) * up over the
    checkpoint's [gate | up] rows (swiglu_fusion 2), the picked experts renormalized (log weights from the graph's
    router), and none of the CPU form's per-expert nodes; the metadata names the activation for the expert gate."""
    source = checkpoint(ARCH, **dict(WIDE_EXPERTS))
    request = ExportRequest(model=str(source), dtype=dtype, ep="cuda", variant=variant,
                            static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / dtype, validate=False).out_dir
    experts = _experts(out)
    assert [n.op_type for n in experts] == [op] * 6
    for node in experts:
        attrs = _attributes(node)
        assert (attrs["activation_type"], attrs["swiglu_fusion"], attrs["k"], attrs["normalize_routing_weights"]) == (
            b"geglu", 2, 2, 1)
    assert "NonZero" not in {n.op_type for n in _nodes(out)}
    meta = {p.key: p.value for p in onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).metadata_props}
    assert json.loads(meta[contract.META_CONFIG])["moe"] == {"experts": 4, "top_k": 2, "normalize": True,
                                                             "activation": "geglu"}


def test_for_cuda_without_the_geglu_kernel_the_experts_are_standard_ops(checkpoint, tmp_path, monkeypatch):
    """An onnxruntime whose MoE has no CUDA GEGLU (onnxruntime-gpu 1.31.1, the newest on PyPI, as the GPU workers run
    it): a cuda export takes the standard-op form the CPU takes, and the expert gate says it did not run the op."""
    from exporter.graph.components import moe
    from exporter.validation.gates.runtime_probe import expert_gate

    monkeypatch.setattr(moe, "cuda_geglu", lambda: False)
    source = checkpoint(ARCH, **dict(WIDE_EXPERTS))
    request = ExportRequest(model=str(source), dtype="fp16", ep="cuda", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "fp16", validate=False).out_dir
    assert _experts(out) == [] and "NonZero" in {n.op_type for n in _nodes(out)}
    gate = expert_gate("cuda", "fp16", "fp16", {"experts": 4, "top_k": 2, "normalize": True, "activation": "geglu"})
    assert gate.informational and gate.measured == "not run"


def _moe_in_standard_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every com.microsoft MoE node of ``model`` replaced by what its schema says it computes, in standard ops: softmax
    of router_probs over every expert, its top k renormalized (normalize_routing_weights 1), GELU-tanh(gate) * up over
    fc1's [gate | up] rows (swiglu_fusion 2), fc2, the k outputs mixed by those weights (every expert on every token,
    the unpicked weighted by 0)."""
    from onnx import helper

    graph = model.graph
    nodes = []
    for n in graph.node:
        if n.op_type != "MoE":
            nodes.append(n)
            continue
        assert _attributes(n)["activation_type"] == b"geglu" and _attributes(n)["swiglu_fusion"] == 2
        x, probs, fc1, _, fc2 = n.input[:5]
        t = lambda name: f"{n.name or n.output[0]}.{name}"  # noqa: E731
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([_attributes(n)["k"]], np.int64), t("k")))
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), t("last")))
        nodes += [
            helper.make_node("Softmax", [probs], [t("p")], axis=-1),
            helper.make_node("TopK", [t("p"), t("k")], [t("top"), t("picked")], axis=-1),
            helper.make_node("ReduceSum", [t("top"), t("last")], [t("sum")], keepdims=1),
            helper.make_node("Div", [t("top"), t("sum")], [t("w")]),
            helper.make_node("Sub", [t("p"), t("p")], [t("zeros")]),
            helper.make_node("ScatterElements", [t("zeros"), t("picked"), t("w")], [t("mix")], axis=-1),
            helper.make_node("Einsum", [x, fc1], [t("h")], equation="th,eoh->teo"),
            helper.make_node("Split", [t("h")], [t("gate"), t("up")], axis=-1, num_outputs=2),
            helper.make_node("Gelu", [t("gate")], [t("act")], approximate="tanh"),
            helper.make_node("Mul", [t("act"), t("up")], [t("glu")]),
            helper.make_node("Einsum", [t("glu"), fc2], [t("out")], equation="tei,ehi->teh"),
            helper.make_node("Einsum", [t("mix"), t("out")], [n.output[0]], equation="te,teh->th"),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def test_the_cuda_graph_with_its_moe_op_as_the_schema_defines_it_matches_transformers(checkpoint, reference, tmp_path):
    """What the CUDA export asks of its MoE op, checked here without a GPU: the fp32 ep cuda graph, each MoE node
    replaced by the schema's computation in standard ops (_moe_in_standard_ops), runs on the CPU to transformers'
    logits and tokens. Its router hands the op log(p * per_expert_scale) at the picked experts and scales the op's
    output back by sum(p * scale) / sum(p): transformers' weights exactly. The kernel itself is not run."""
    source = checkpoint(ARCH, **dict(EXPERTS))
    request = ExportRequest(model=str(source), dtype="fp32", ep="cuda", variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "cuda", validate=False).out_dir
    assert len(_experts(out)) == 6
    model = _moe_in_standard_ops(onnx.load(str(out / contract.MODEL_FILE), load_external_data=False))
    onnx.save(model, str(out / "emulated.onnx"))
    ref = reference(ARCH, PROMPT, EXPERTS)
    result = run_parity(Decoder(out / "emulated.onnx"), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


def test_for_cuda_a_per_expert_scale_that_is_not_positive_is_refused(checkpoint, tmp_path):
    """The op weighs experts through a softmax of log weights: a scale <= 0 has no log (the CPU form takes any)."""
    from safetensors.numpy import load_file, save_file

    source = _with_config(checkpoint(ARCH, **dict(EXPERTS)), tmp_path)
    shard = next(source.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.3.router.per_expert_scale"][1] = -0.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    request = ExportRequest(model=str(source), dtype="fp16", ep="cuda", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match=r"model.layers.3.router.per_expert_scale holds 1 scales <= 0 .* export it "
                                          r"for ep cpu"):
        export_model(request, tmp_path / "cuda", validate=False)
    assert export_model(dataclasses.replace(request, ep="cpu"), tmp_path / "cpu", validate=False).out_dir.is_dir()


@pytest.mark.parametrize("changes, message", [
    ({"top_k_experts": 5}, r"top_k_experts at most num_experts; config.json gives 4, 5 and 32"),
    ({"moe_intermediate_size": None}, r"gemma4_text with enable_moe_block needs num_experts, top_k_experts and "
                                      r"moe_intermediate_size"),
    ({"hidden_activation": "silu"}, r"gemma4_text experts with hidden_activation 'silu' are not exported"),
])
def test_expert_settings_the_exporter_does_not_build_are_refused_by_name(changes, message, checkpoint, tmp_path):
    path = _with_config(checkpoint(ARCH, **dict(EXPERTS)), tmp_path, **changes)
    with pytest.raises(ExportError, match=message):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


def test_the_expert_gate_probes_geglu_on_cuda_and_says_why_it_does_not_on_the_cpu(tmp_path):
    """On the CPU the export has no expert op to probe (informational); for CUDA the probe is the export's own GEGLU
    MoE over [gate | up] rows, whose known answer is GELU-tanh's."""
    from exporter.validation.gates.runtime_probe import expert_answer, expert_gate, expert_probe_graph

    moe = {"experts": 4, "top_k": 2, "normalize": True, "activation": "geglu"}
    gate = expert_gate("cpu", "fp32", "fp32", moe)
    assert gate.informational and gate.measured == "not run" and "standard ops" in gate.message
    model, _ = expert_probe_graph("fp16", None, 2, True, tmp_path, geglu=True)
    node = next(n for n in model.graph if n.op_type == "MoE")
    assert (node.attributes["activation_type"].value, node.attributes["swiglu_fusion"].value) == ("geglu", 2)
    assert abs(expert_answer(2, True, geglu=True) - expert_answer(2, True)) > 0.1


def count_expert_runs(export_dir, ep):
    """A rehearsal runner that reports, as its runs, how many layers of the tiny twin route tokens to experts."""
    return {"runs": [n.op_type for n in _nodes(Path(export_dir))].count("NonZero"), "max_diff": 0.0}


def test_the_decode_rehearsal_of_an_export_with_experts_rehearses_a_twin_with_experts(exported):
    """The rehearsal (validation's decode under CUDA graph capture) exports a tiny twin of the build: gemma4's tiny
    checkpoint is dense, so an export with experts gets a twin with experts (here on the CPU, one NonZero a layer)."""
    from exporter.runtime.session import read_metadata
    from exporter.validation.gates.rehearsal import rehearsal_gate

    out = exported(ARCH, "gqa", "fp16", EXPERTS)
    manifest = json.loads((out / contract.MANIFEST_FILE).read_text())
    gate = rehearsal_gate(manifest, read_metadata(out / contract.MODEL_FILE)["config"], "fp16", "cpu",
                          runner=count_expert_runs)
    assert gate.status == "pass" and gate.details["runs"] == 6, gate
