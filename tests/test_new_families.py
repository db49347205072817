"""The 2025-26 families built by hand (issue 47): every family x variant against transformers on the CPU.

Dense: seed_oss, ernie4_5 (interleaved rotary), olmo3 and exaone4 (post-norm, sliding windows, exaone4's global
layers NoPE), ministral3 (its position-dependent query scale), hunyuan_v1_dense (q / k norms after the rotary),
cohere2 (attention and MLP in parallel after one bias-free LayerNorm, NoPE global layers, logit scale), apertus
(ungated xIELU MLP).

deepseek_v3's multi-head latent attention (also deepseek_v2's and glm4_moe_lite's) runs absorbed
(components/latent_attention.py): its caches hold the latent, one KV head of kv_rank + rope_dim; glm4_moe, deepseek_v3
and glm4_moe_lite route by sigmoid scores within groups on MoEGroupRouter, deepseek_v2 by unnormalized softmax scores
within groups. The tiny checkpoints (exporter/tiny_checkpoint.py NEW_ARCHITECTURES) have small but real shapes:
a dense first layer then experts, value heads narrower than query / key heads, the interleaved rotary.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
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
from exporter.tiny_checkpoint import NEW_ARCHITECTURES, make_tiny_checkpoint
from exporter.validation.parity import run_batch_parity, run_parity
from exporter.validation.reference import load_reference, reference_greedy
from tests.conftest import DECODE_STEPS, VARIANTS

PROMPT = 20
FP32_TOLERANCE = 1e-4  # the bar: fp32 logits within 1e-4 of the reference's logit range
GROUPED = ["glm4_moe", "deepseek_v3", "glm4_moe_lite"]  # DeepSeek-V3's grouped sigmoid routing
LATENT = ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"]  # multi-head latent attention
MOE_FAMILIES = [*GROUPED, "deepseek_v2", "ernie4_5_moe", "llama4_text"]


def _close(result) -> bool:
    return result.prefill_max_abs_error <= FP32_TOLERANCE * result.logit_range


def _nodes(out) -> list[onnx.NodeProto]:
    return list(onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).graph.node)


# llama4_text's chunked attention has no GroupQueryAttention form (refused below).
NO_GQA = {"llama4_text"}
CASES = [(arch, variant) for arch in NEW_ARCHITECTURES for variant in VARIANTS if arch not in NO_GQA or variant != "gqa"]


def _half_variant(arch: str) -> str:
    return "attn_dynamic" if arch in NO_GQA else "gqa"


@pytest.mark.parametrize("arch, variant", CASES)
def test_fp32_matches_transformers(arch, variant, exported, reference):
    ref = reference(arch, prompt_len=PROMPT)
    result = run_parity(Decoder(exported(arch, variant)), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("variant", ["attn_dynamic", "attn_static"])
@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
def test_a_left_padded_batch_matches_each_prompt_alone(arch, variant, exported, reference):
    """Batch 2, prompts of 20 and 9 tokens: attn_dynamic left-pads the short row, attn_static prefills rows apart."""
    refs = [reference(arch, prompt_len=PROMPT), reference(arch, prompt_len=9)]
    for ref, result in zip(refs, run_batch_parity(Decoder(exported(arch, variant)), refs, near_tie_margin=0.0)):
        assert _close(result), result
        assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
def test_fp16_matches_transformers_except_near_ties(arch, exported, reference):
    ref = reference(arch, prompt_len=PROMPT)
    result = run_parity(Decoder(exported(arch, _half_variant(arch), "fp16")), ref, near_tie_margin=0.1)
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    assert len(result.near_ties) <= result.steps // 2
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


QUANTIZED = [(arch, "int4") for arch in NEW_ARCHITECTURES] + [(arch, "int8") for arch in MOE_FAMILIES]


@pytest.mark.parametrize("arch, dtype", QUANTIZED)
def test_quantized_is_exact_to_its_dequantized_weights(arch, dtype, checkpoint, reference, tmp_path):
    """int4 / int8 with fp32 activations (accuracy_level 0) against transformers on the checkpoint whose quantized
    weights are replaced by their own quantize-dequantize: the packed latent projections (q_a | kv_a) and the
    experts quantize row by row as their sources; the per-head absorbed kv_b_proj and the routers stay float."""
    from tests.quantized_reference import dequantized_checkpoint

    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype=dtype, ep="cpu", variant="attn_dynamic",
                            quant={"accuracy_level": 0})
    out = export_model(request, tmp_path / dtype, validate=False).out_dir
    deq, schemes = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    assert not any("kv_b_proj" in name or name.endswith(("mlp.gate.weight", "router.weight")) for name in schemes)
    ref = reference_greedy(load_reference(deq), reference(arch, prompt_len=PROMPT).prompt, DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", LATENT)
def test_latent_attention_caches_the_latent_and_attends_as_one_kv_head(arch, variant, checkpoint, exported):
    """The cache of a latent-attention layer is its latent (kv_lora_rank + qk_rope_head_dim a token, one head),
    never the expanded per-head keys and values, and every attention op reads it as one KV head."""
    cfg = load_model_config(checkpoint(arch), REGISTRY)
    lat = cfg.latent
    out = exported(arch, variant)
    model = onnx.load(str(out / contract.MODEL_FILE), load_external_data=False)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in (*model.graph.input, *model.graph.output)}
    width = lat.kv_rank + lat.rope_dim
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, width)
    for name in contract.cache_names(Variant(variant), 0):  # [batch, 1, past, width]; attn_static [batch, max, width]
        assert dims[name][-1] == width and (variant == "attn_static" or dims[name][1] == 1), dims[name]
    ops = [n for n in model.graph.node if n.op_type in ("Attention", "GroupQueryAttention")]
    assert len(ops) == cfg.num_layers
    for node in ops:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("kv_num_heads") == 1
        assert attrs.get("q_num_heads", attrs.get("num_heads")) == cfg.num_heads
        assert attrs["scale"] == pytest.approx((lat.nope_dim + lat.rope_dim) ** -0.5)


YARN_MSCALE = {"attention_bias": True, "max_position_embeddings": 512,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                  "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
                                  "beta_fast": 32, "beta_slow": 1}}


@pytest.mark.parametrize("arch, changes", [
    # Queries straight from the input (no q latent); the rotary not interleaved.
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False}),
    # Biased down projections and o_proj; yarn with mscale_all_dim, which scales the softmax too (DeepSeek-V3's).
    ("deepseek_v3", {**YARN_MSCALE, "rope_parameters": {**YARN_MSCALE["rope_parameters"], "mscale": 1.0,
                                                        "mscale_all_dim": 1.0}}),
    # DeepSeek-V2-Lite's routing: softmax over all experts, the top k unnormalized (greedy), scaled; its yarn (mscale
    # 0.707 on both) and a q latent (DeepSeek-V2's).
    ("deepseek_v2", {**YARN_MSCALE, "topk_method": "greedy", "q_lora_rank": 32}),
])
@pytest.mark.parametrize("variant", ["attn_dynamic", "gqa"])
def test_latent_attention_s_other_layouts_match_transformers(arch, changes, variant, tmp_path):
    source = make_tiny_checkpoint(arch, tmp_path / "ckpt", **changes)
    out = export_model(ExportRequest(model=str(source), ep="cpu", variant=variant), tmp_path / "out",
                       validate=False).out_dir
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 250, size=PROMPT)]
    ref = reference_greedy(load_reference(source), prompt, DECODE_STEPS)
    result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == ref.tokens, result.mismatches


@pytest.mark.parametrize("arch", GROUPED)
def test_grouped_sigmoid_routing_is_one_router_and_one_expert_op_per_sparse_layer(arch, checkpoint, exported):
    """The first layer dense (first_k_dense_replace), then per sparse layer one MoEGroupRouter (groups and the
    groups kept as config.json says) feeding one MoE op, the shared expert beside it."""
    cfg = load_model_config(checkpoint(arch), REGISTRY)
    assert cfg.moe.sparse_layers == (False, True, True)
    nodes = _nodes(exported(arch, "attn_dynamic"))
    routers = [n for n in nodes if n.op_type == "MoEGroupRouter"]
    experts = [n for n in nodes if n.op_type == "MoE"]
    assert len(routers) == len(experts) == 2
    for router in routers:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in router.attribute}
        assert (attrs["n_group"], attrs["topk_group"], attrs["top_k"]) == (4, 2, 2)
    assert {e.input[1] for e in experts} == {r.output[0] for r in routers}


def test_deepseek_v2_routes_by_unnormalized_softmax_scores_within_groups(checkpoint, exported, reference, tmp_path):
    """group_limited_greedy: no MoEGroupRouter (softmax scores), the graph's pick feeding one MoE op per sparse layer.
    A control for the parity tests: the same checkpoint routed greedily (every group competing) gives transformers
    other logits, so an export that ignored the groups would fail them; greedy is the op's own routing, unnormalized."""
    cfg = load_model_config(checkpoint("deepseek_v2"), REGISTRY)
    assert cfg.moe.scaled_softmax and cfg.moe.group_limited and not cfg.moe.normalize
    nodes = _nodes(exported("deepseek_v2", "attn_dynamic"))
    assert sum(n.op_type == "MoE" for n in nodes) == 2 and not any(n.op_type == "MoEGroupRouter" for n in nodes)
    ref = reference("deepseek_v2", prompt_len=PROMPT)
    greedy = reference_greedy(load_reference(checkpoint("deepseek_v2", topk_method="greedy")), ref.prompt, 1)
    spread = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    assert np.abs(greedy.prefill_logits - ref.prefill_logits).max() > 100 * FP32_TOLERANCE * spread
    out = exported("deepseek_v2", "attn_dynamic", ckpt_kwargs=(("topk_method", "greedy"),))
    experts = [n for n in _nodes(out) if n.op_type == "MoE"]
    assert [onnx.helper.get_attribute_value(a) for n in experts for a in n.attribute
            if a.name == "normalize_routing_weights"] == [0, 0]


def _with_config(source, tmp_path, **changes):
    out = tmp_path / "edited"
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, message", [
    ({"n_group": 3}, r"n_group 3 / topk_group 2 do not divide 8 experts: n_group must divide n_routed_experts"),
    ({"topk_group": 5}, r"n_group 4 / topk_group 5 do not divide 8 experts: .*topk_group lie between 1 and n_group"),
    ({"norm_topk_prob": False}, r"deepseek_v3 with norm_topk_prob false .* is not exported"),
    ({"kv_lora_rank": 16}, r"kv_a_proj_with_mqa.weight is \[48, 64\] but config.json implies \[32, 64\]"),
])
def test_what_the_exporter_cannot_reproduce_is_refused_by_name(changes, message, checkpoint, tmp_path):
    path = _with_config(checkpoint("deepseek_v3"), tmp_path, **changes)
    with pytest.raises(ExportError, match=message):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


@pytest.mark.parametrize("arch, changes, message", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, r"deepseek_v2 with topk_method 'noaux_tc' is not exported"),
    ("deepseek_v2", {"mlp_bias": True}, r"deepseek_v2 with mlp_bias .* is not exported"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "sparse"]},
     r"mlp_layer_types \['dense', 'moe', 'sparse'\] must name each of the 3 layers"),
    ("glm4_moe_lite", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     r"glm4_moe_lite with partial_rotary_factor 0.5 is not exported: latent attention rotates the whole"),
])
def test_the_latent_families_refuse_what_they_cannot_reproduce_by_name(arch, changes, message, checkpoint, tmp_path):
    path = _with_config(checkpoint(arch), tmp_path, **changes)
    with pytest.raises(ExportError, match=message):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


def test_latent_attention_is_refused_for_the_compat_target(checkpoint):
    path = checkpoint("deepseek_v3", first_k_dense_replace=3)  # dense: the experts have their own refusal
    with pytest.raises(ExportError, match=r"latent attention \(deepseek_v3\) is not built for the compat target"):
        build_model(ExportRequest(model=str(path), compat=True), resolve_source(str(path)))


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_a_validated_half_export_passes_every_gate(arch, checkpoint, tmp_path):
    """The whole validation of an fp16 gqa export: structure (the routers' fp32 selection bias allowed), the weight
    gate reading every packed, stacked and per-head slice back, the expert known answer, parity."""
    variant = _half_variant(arch)
    request = ExportRequest(model=str(checkpoint(arch)), dtype="fp16", ep="cpu", variant=variant)
    out = export_model(request, tmp_path / "export", validate=True).out_dir
    report = json.loads((out / "parity_report.json").read_text())
    assert report["status"] == "passed" and not report["failed_gates"], report["failed_gates"]
    census = next(g for g in report["gates"] if g["check"] == "attention op census")
    op = "com.microsoft::GroupQueryAttention" if variant == "gqa" else "Attention"
    assert census["measured"] == {op: load_model_config(checkpoint(arch), REGISTRY).num_layers}


def test_ernie4_5_moe_picks_experts_by_biased_softmax_scores(checkpoint, exported, reference, tmp_path):
    """Experts on layers 1 and 2 only (moe_layer_start_index), two routers' TopK feeding two MoE ops. A control for
    the parity tests: the same checkpoint with its selection bias zeroed routes some token elsewhere in transformers
    (the bias decides, so an export that ignored it would fail them)."""
    from safetensors.numpy import load_file, save_file

    cfg = load_model_config(checkpoint("ernie4_5_moe"), REGISTRY)
    assert cfg.moe.sparse_layers == (False, True, True) and cfg.moe.biased_softmax
    assert cfg.moe.shared_expert_intermediate == 64
    nodes = _nodes(exported("ernie4_5_moe", "attn_dynamic"))
    assert sum(n.op_type == "MoE" for n in nodes) == 2 and sum(n.op_type == "TopK" for n in nodes) == 2

    unbiased = tmp_path / "unbiased"
    shutil.copytree(checkpoint("ernie4_5_moe"), unbiased)
    tensors = load_file(str(unbiased / "model.safetensors"))
    tensors = {k: (np.zeros_like(v) if k.endswith("e_score_correction_bias") else v) for k, v in tensors.items()}
    save_file(tensors, str(unbiased / "model.safetensors"), metadata={"format": "pt"})
    ref = reference("ernie4_5_moe", prompt_len=PROMPT)
    other = reference_greedy(load_reference(unbiased), ref.prompt, DECODE_STEPS)
    spread = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    assert np.abs(other.prefill_logits - ref.prefill_logits).max() > 100 * FP32_TOLERANCE * spread


def test_llama4_text_chunks_its_local_layers_and_refuses_gqa_by_name(checkpoint, reference, tmp_path):
    """Chunks of 8 on the rotary layers: over a 20-token prompt the chunk boundary is what transformers attends by (a
    control: the same model with chunks of 64, i.e. plain causal attention over these lengths, gives other logits);
    GroupQueryAttention has no chunked form, so gqa is refused with the variants that work."""
    ref = reference("llama4_text", prompt_len=PROMPT)
    wide = reference_greedy(load_reference(checkpoint("llama4_text", attention_chunk_size=64)), ref.prompt, 1)
    spread = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    assert np.abs(wide.prefill_logits - ref.prefill_logits).max() > 100 * FP32_TOLERANCE * spread
    path = checkpoint("llama4_text")
    with pytest.raises(ExportError, match=r"chunked attention \(attention_chunk_size 8\) has no GroupQueryAttention form.*"
                                          r"use the attn_dynamic or attn_static variant"):
        build_model(ExportRequest(model=str(path), variant="gqa"), resolve_source(str(path)))


def test_llama4_text_with_more_than_one_expert_a_token_is_refused_by_name(checkpoint, tmp_path):
    path = _with_config(checkpoint("llama4_text"), tmp_path, num_experts_per_tok=2)
    with pytest.raises(ExportError, match=r"llama4_text with num_experts_per_tok 2 is not exported: its router scales"):
        build_model(ExportRequest(model=str(path)), resolve_source(str(path)))


@pytest.mark.parametrize("arch", [*GROUPED, "lfm2_moe", "nemotron_h"])
def test_sigmoid_routing_in_plain_ops_for_runtimes_without_moegrouprouter_matches_transformers(arch, checkpoint,
                                                                                             tmp_path):
    """onnxruntime-gpu 1.31.1 (the newest on PyPI) and onnxruntime-node 1.30 have no MoEGroupRouter kernel: a cuda
    export (and an hf layout) routes with the same computation in standard ops (fp32 sigmoid, group scores from
    each group's two best biased scores, TopK, ScatterElements). Run here on the CPU EP, where both forms exist:
    transformers' tokens and logits."""
    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype="fp32", ep="cuda", variant="attn_dynamic")
    out = export_model(request, tmp_path / "cuda-export", validate=False).out_dir
    ops = {n.op_type for n in _nodes(out)}
    assert "MoEGroupRouter" not in ops and {"TopK", "ScatterElements", "MoE"} <= ops
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 250, size=PROMPT)]
    want = reference_greedy(load_reference(source), prompt, DECODE_STEPS)
    result = run_parity(Decoder(out, "cpu"), want, near_tie_margin=0.0)
    assert _close(result), result
    assert result.tokens == want.tokens, result.mismatches


def test_a_latent_head_wider_than_cuda_groupqueryattention_takes_is_refused_for_gqa_on_cuda(tmp_path):
    """DeepSeek-V3's latent head is 512 + 64 = 576; onnxruntime-gpu 1.31.1's GroupQueryAttention stops at 512 (measured
    on an H100, benchmarks/results/h100/traced_speed_cuda.json): refused at export with the variants that run."""
    source = make_tiny_checkpoint("deepseek_v3", tmp_path / "wide", kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(ExportError, match=r"latent head \(512 \+ 64 = 576\) is wider than onnxruntime's CUDA "
                                          r"GroupQueryAttention takes \(512.*use the attn_dynamic or attn_static"):
        build_model(ExportRequest(model=str(source), ep="cuda", dtype="fp16", variant="gqa"), resolve_source(str(source)))
    build_model(ExportRequest(model=str(source), ep="cpu", dtype="fp32", variant="gqa"), resolve_source(str(source)))
