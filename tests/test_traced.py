"""The traced fallback: causal LMs without a hand-built architecture, exported through transformers.exporters
(exporter/graph/traced.py) onto the attn_dynamic contract, and driven, validated and packaged like ours.

Each model type is a tiny random checkpoint built from its config class (exporter/traced_tiny.py), exported
once with validation (module-scoped), and run through ``Decoder`` against transformers on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np
import pytest

from exporter import contract
from exporter.errors import ExportError, ValidationFailed
from exporter.packaging.hf_layout import OPTIMUM_CONSUMER, TRANSFORMERSJS_CONSUMER, write_hf_layout
from exporter.pipeline import export_model
from exporter.request import ExportRequest, Variant
from exporter.runtime.session import Decoder, read_metadata
from exporter.traced_tiny import make_traced_checkpoint
from exporter.validation.parity import run_batch_parity, run_parity
from exporter.validation.reference import load_reference, reference_greedy
from test_hf_layout import check_rows, hf_generate, js_generate, prompts, transformersjs  # noqa: F401 (a fixture)

# Types with no hand-built architecture, each a different way of attending: GPT-2 (Conv1D as Gemm, learned
# positions, tied head), GPT-NeoX (partial rotary, parallel residual), OPT (learned positions offset by 2),
# Falcon (one KV head, multi-query), BLOOM (ALiBi: no position_ids at all), StableLM (GQA, packed Q/K/V MatMul).
TYPES = ("gpt2", "gpt_neox", "opt", "falcon", "bloom", "stablelm")
# BART's decoder alone (BartForCausalLM) places its learned positions by the past's length, not by the
# mask: a left-padded row sees shifted positions, in transformers itself and so in its trace.
WRONG_WHEN_PADDED = ("bart",)
# Multi-head latent attention as transformers caches it: the normed latent as keys (kv_lora_rank, 32 here), the
# rotated shared key as values (qk_rope_head_dim, 16), one head: keys and values of two head sizes. Both types are
# hand-built too, so these are exported with builder traced. deepseek_v3's first layer is dense, its second of
# experts; deepseek_v2 is one layer of experts (each trace costs seconds a layer).
LATENT = ("deepseek_v3", "deepseek_v2")
LATENT_WIDTHS = {"head_dim": 32, contract.VALUE_HEAD_DIM: 16}
CHECKPOINT_OVERRIDES = {"deepseek_v3": {"first_k_dense_replace": 1},
                        "deepseek_v2": {"first_k_dense_replace": 0, "num_hidden_layers": 1}}
STEPS = 24
RELATIVE = 1e-4  # fp32: max abs error over the logit range
BATCH_CHECK = "left-padded batch of 2"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """traced(model_type, dtype="fp32") -> (checkpoint, export dir, validation report), built once."""
    root = tmp_path_factory.mktemp("traced")

    @functools.cache
    def checkpoint(model_type: str):
        return make_traced_checkpoint(model_type, root / f"ckpt-{model_type}", **CHECKPOINT_OVERRIDES.get(model_type, {}))

    @functools.cache
    def make(model_type: str, dtype: str = "fp32"):
        out = root / f"{model_type}-{dtype}"
        # builder traced: the default (auto) would build the latent types by hand; the others have no hand-built graph
        request = ExportRequest(model=str(checkpoint(model_type)), dtype=dtype, builder="traced")
        try:
            report = export_model(request, out).report
        except ValidationFailed as failed:  # published quarantined: the tests say which gate and why
            report = failed.report
        return checkpoint(model_type), out, report

    make.checkpoint = checkpoint
    return make


@pytest.fixture(scope="module")
def transformers_run(traced):
    """transformers_run(model_type, prompt_len) -> transformers' greedy run on the checkpoint's weights (fp32)."""

    @functools.cache
    def model(model_type: str):
        return load_reference(traced.checkpoint(model_type))

    @functools.cache
    def run(model_type: str, prompt_len: int = 12):
        prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(3, 250, size=prompt_len)]
        return reference_greedy(model(model_type), prompt, STEPS)

    return run


@pytest.mark.parametrize("model_type", TYPES + LATENT)
def test_traced_export_matches_transformers(model_type, traced, transformers_run):
    """One graph, prefill (an empty past) and decode alike: the prompt whole or in two chunks (the second
    through a past of the first), then 24 teacher-forced steps."""
    _, out, report = traced(model_type)
    ref = transformers_run(model_type)
    lm = Decoder(out)
    for chunks in (1, 2):
        result = run_parity(lm, ref, near_tie_margin=0.0, prefill_chunks=chunks)
        assert result.prefill_max_abs_error <= RELATIVE * result.logit_range, (chunks, result)
        assert result.tokens == ref.tokens, f"{chunks} chunks: greedy tokens differ at steps {result.mismatches}"
    # every gate but the batch check (judged below) passed; none that cannot apply passed by default
    assert [g.check for g in report.failed if not g.check.startswith(BATCH_CHECK)] == []
    probe = next(g for g in report.gates if g.gate == "runtime")
    census = next(g for g in report.gates if g.check == "attention op census")
    assert probe.status == census.status == "info"
    by_value, exported = (g for g in report.gates if g.gate == "weights")
    assert by_value.status == "pass" and "bit-exact" in by_value.measured
    # every checkpoint tensor was found in the graph, bit for bit (reported: a traced graph may fold some away; the
    # latent types' 4 experts run on their gate and up projections stacked, 8 tensors not in the graph as stored)
    assert (exported.status, exported.measured) == ("info", 8 if model_type in LATENT else 0)


@pytest.mark.parametrize("model_type", TYPES + LATENT + WRONG_WHEN_PADDED)
def test_a_left_padded_batch_matches_each_prompt_alone_or_the_gate_fails(model_type, traced, transformers_run):
    """Prompts of 12 and 7 tokens in one left-padded batch, each row against transformers run on its
    prompt alone. The traced mask is whatever transformers' code and onnxruntime's fusions made of the
    padding; where a row comes out wrong, validation's batch check must have failed and said so."""
    _, out, report = traced(model_type)
    refs = [transformers_run(model_type, 12), transformers_run(model_type, 7)]
    rows = run_batch_parity(Decoder(out), refs, near_tie_margin=0.0)
    right = all(r.prefill_max_abs_error <= RELATIVE * r.logit_range and r.tokens == ref.tokens
                for r, ref in zip(rows, refs))
    gate = next(g for g in report.gates if g.check.startswith(BATCH_CHECK))
    assert gate.status == ("pass" if right else "fail"), (rows, gate)
    assert right == (model_type not in WRONG_WHEN_PADDED)  # both outcomes are exercised
    if not right:
        assert "left padding" in gate.message and "batch 1" in gate.message
        assert "quarantined" == json.loads((out / contract.MANIFEST_FILE).read_text())["status"]


def test_the_graph_takes_the_attn_dynamic_contract_and_names_its_builder(traced):
    """Inputs and outputs by the contract's names and dims; model metadata and manifest name the builder."""
    import onnx
    import transformers

    _, out, _ = traced("falcon")
    graph = onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).graph
    names = [contract.cache_names(Variant.ATTN_DYNAMIC, i) for i in range(2)]  # the tiny checkpoint's 2 layers
    assert [v.name for v in graph.input] == [contract.INPUT_IDS, contract.ATTENTION_MASK, contract.POSITION_IDS,
                                             *(name for k, v, _, _ in names for name in (k, v))]
    assert [v.name for v in graph.output] == [contract.LOGITS, *(name for _, _, k, v in names for name in (k, v))]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*graph.input, *graph.output]}
    assert dims[names[0][0]] == contract.cache_dims(Variant.ATTN_DYNAMIC, 1, 16)  # falcon-7b's layout: one KV head
    assert dims[names[0][2]] == contract.cache_dims(Variant.ATTN_DYNAMIC, 1, 16, output=True)
    assert dims[names[0][1]] == dims[names[0][0]]  # values as wide as keys: no value head size of their own
    assert dims[contract.ATTENTION_MASK] == [contract.BATCH, contract.TOTAL]
    meta = read_metadata(out / contract.MODEL_FILE)
    assert meta["builder"] == contract.BUILDER_TRACED and meta["variant"] == "attn_dynamic"
    manifest = json.loads((out / contract.MANIFEST_FILE).read_text())
    assert manifest["builder"] == {"name": contract.BUILDER_TRACED, "version": transformers.__version__}
    assert manifest["status"] == "ready" and manifest["variant"] == "attn_dynamic"
    assert contract.VALUE_HEAD_DIM not in meta["config"] and contract.MANIFEST_CACHE not in manifest
    assert manifest["genai"]["package"]


def test_a_latent_cache_declares_its_values_head_size_and_the_runtime_allocates_it(traced):
    """transformers caches latent attention's keys and values at two head sizes: the graph declares each, the
    metadata and the manifest name the values' (contract.VALUE_HEAD_DIM), the runtime allocates each from the graph."""
    import onnx

    _, out, _ = traced("deepseek_v3")
    graph = onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*graph.input, *graph.output]}
    key_in, value_in, key_out, value_out = contract.cache_names(Variant.ATTN_DYNAMIC, 1)
    key, value = LATENT_WIDTHS["head_dim"], LATENT_WIDTHS[contract.VALUE_HEAD_DIM]
    assert (dims[key_in], dims[key_out]) == (contract.cache_dims(Variant.ATTN_DYNAMIC, 1, key),
                                             contract.cache_dims(Variant.ATTN_DYNAMIC, 1, key, output=True))
    assert (dims[value_in], dims[value_out]) == (contract.cache_dims(Variant.ATTN_DYNAMIC, 1, value),
                                                 contract.cache_dims(Variant.ATTN_DYNAMIC, 1, value, output=True))
    config = read_metadata(out / contract.MODEL_FILE)["config"]
    assert {k: config[k] for k in LATENT_WIDTHS} == LATENT_WIDTHS and contract.value_head_dim(config) == value
    manifest = json.loads((out / contract.MANIFEST_FILE).read_text())
    assert manifest[contract.MANIFEST_CACHE] == {"num_kv_heads": 1, **LATENT_WIDTHS}
    lm = Decoder(out)
    state = lm.new_state(batch=2)
    assert [c.shape for c in state.caches] == [(2, 1, 0, key), (2, 1, 0, value)] * 2
    lm.prefill([[5, 6, 7], [8, 9]], state)
    assert [c.shape for c in state.caches] == [(2, 1, 3, key), (2, 1, 3, value)] * 2


def test_the_resource_estimate_counts_values_at_their_own_head_size(tmp_path):
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.resources import Geometry
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    config = load_model_config(make_tiny_checkpoint("llama", tmp_path / "llama"), ARCHITECTURES)
    split = dataclasses.replace(config, value_head_dim=config.head_dim // 2)
    assert Geometry.of(config).kv_per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim
    assert Geometry.of(split).kv_per_token == config.num_layers * config.num_kv_heads * (config.head_dim * 3 // 2)


def test_no_genai_package_for_a_cache_of_two_head_sizes_and_the_manifest_says_why(traced, tmp_path):
    """onnxruntime-genai gives a layer's past and present keys and values one shape. The package is not written (no
    genai gate runs); written anyway, head_size the keys', genai feeds the values at the keys' width and the graph
    refuses them."""
    from exporter.graph.config import ModelConfig, RopeConfig
    from exporter.packaging.genai import build_genai_config

    checkpoint, out, report = traced("deepseek_v3")
    genai = json.loads((out / contract.MANIFEST_FILE).read_text())["genai"]
    assert not genai["package"] and not (out / contract.GENAI_CONFIG_FILE).exists()
    assert re.match(r"the export caches values 16 wide beside keys 32 wide \(transformers' latent-attention cache.*"
                    r"onnxruntime-genai allocates a layer's past and present keys and values with one shape",
                    genai["reason"])
    assert not [g for g in report.gates if g.gate == "genai"]

    og = pytest.importorskip("onnxruntime_genai")
    package = tmp_path / "package"
    package.mkdir()
    for name in contract.MODEL_FILES:
        (package / name).symlink_to(out / name)
    lm, meta = Decoder(out), read_metadata(out / contract.MODEL_FILE)["config"]
    # the numbers the traced export gives its packager, less the values' head size: genai's one head_size, the keys'
    config = ModelConfig("deepseek_v3", meta["vocab_size"], 64, 128, meta["num_layers"], meta["num_heads"],
                         meta["num_kv_heads"], meta["head_dim"], 0.0, 256, False, RopeConfig("traced", 0.0, 0), False,
                         False, None)
    genai_config = build_genai_config(config, Variant.ATTN_DYNAMIC, ExportRequest(model=str(checkpoint)),
                                      list(lm.inputs), lm.output_names, checkpoint, traced=True)
    (package / contract.GENAI_CONFIG_FILE).write_text(json.dumps(genai_config))
    model = og.Model(str(package))
    generator = og.Generator(model, og.GeneratorParams(model))
    with pytest.raises(Exception, match=r"past_key_values\.0\.value.*\n.*index: 3 Got: 32 Expected: 16"):
        generator.append_tokens([5, 6, 7])


def test_transformersjs_runs_a_traced_latent_cache_and_optimum_is_not_offered(traced, transformersjs, tmp_path):
    """transformers.js 4.3 allocates each empty past from the graph's declared dims: the traced deepseek_v3 generates
    transformers' tokens for a left-padded batch. optimum sizes every past alike from config.json: the layout names
    transformers.js alone and says why not optimum."""
    checkpoint, out, _ = traced("deepseek_v3")
    layout = write_hf_layout(out, tmp_path / "hf", checkpoint)["layout"]
    assert layout["consumers"] == [TRANSFORMERSJS_CONSUMER]
    assert "one shape for keys and values" in layout["not_for"][OPTIMUM_CONSUMER]
    ids, mask = prompts("deepseek_v3")
    check_rows(js_generate(transformersjs, tmp_path / "hf", "fp32", ids, mask),
               hf_generate(checkpoint, json.dumps(ids), json.dumps(mask)), ids)


def test_the_hf_layout_refuses_a_traced_latent_cache_of_a_type_transformersjs_lacks(traced, tmp_path):
    """deepseek_v2 is refused before anything is traced (transformers.js 4.3 has no such model); another type whose
    built graph caches two head sizes when its layout is written (here deepseek_v3's export under sarvam_mla's name,
    a type that runs DeepSeek-V3's code in transformers)."""
    import shutil

    with pytest.raises(ExportError, match=r"no hf layout for a traced deepseek_v2 model: .*two head sizes.*no "
                                          r"deepseek_v2 model .*optimum"):
        export_model(ExportRequest(model=str(traced.checkpoint("deepseek_v2")), builder="traced", layout="hf"),
                     tmp_path / "v2")
    assert not (tmp_path / "v2").exists()
    renamed = tmp_path / "sarvam_mla"
    shutil.copytree(traced.checkpoint("deepseek_v3"), renamed)
    config = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "model_type": "sarvam_mla"}))
    with pytest.raises(ExportError, match=r"no hf layout for this sarvam_mla export: .*no sarvam_mla model"):
        write_hf_layout(traced("deepseek_v3")[1], tmp_path / "hf", renamed)
    assert not (tmp_path / "hf").exists()


def test_bloom_keeps_the_contract_s_position_ids_unread(traced):
    """ALiBi reads positions off attention_mask: position_ids stays an input (every runtime feeds every
    traced export alike) and the metadata says nothing reads it."""
    _, out, _ = traced("bloom")
    meta = read_metadata(out / contract.MODEL_FILE)
    assert meta["config"]["position_ids"].startswith("unread")
    assert contract.POSITION_IDS in Decoder(out).inputs


def test_a_hand_built_export_names_exportfarm(tmp_path):
    from exporter import __version__
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("llama", tmp_path / "llama")
    result = export_model(ExportRequest(model=str(checkpoint)), tmp_path / "out", validate=False)
    assert result.manifest.data["builder"] == {"name": contract.BUILDER_HAND, "version": __version__}
    assert "builder" not in read_metadata(result.out_dir / contract.MODEL_FILE)


def test_int4_quantizes_the_traced_matmuls_and_passes_its_quality_gate(traced):
    """StableLM's projections run as MatMul on (packed, transposed) checkpoint weights: MatMulNBits."""
    _, out, report = traced("stablelm", "int4")
    _, fp32, _ = traced("stablelm")
    manifest = json.loads((out / contract.MANIFEST_FILE).read_text())
    # every MatMul on a transposed checkpoint weight in the fp32 graph (the names fold as ours: <weight>.T)
    projections = [n for n in json.loads((fp32 / contract.MANIFEST_FILE).read_text())["initializers"] if n.endswith(".T")]
    decisions = manifest["quantization"]["weights"]
    assert sorted(decisions) == sorted(projections) and all(d["quantized"] for d in decisions.values())
    assert manifest["op_census"]["com.microsoft::MatMulNBits"] == len(projections) > 0
    assert "not_quantized" not in manifest["quantization"]
    assert report.passed, report.summary()
    assert {g.gate for g in report.gates} >= {"quality", "weights", "structure"}


def test_int4_is_refused_where_no_weight_is_a_matmul(traced, tmp_path):
    """GPT-2 multiplies through Gemm (Conv1D) and FusedMatMul (its tied head): nothing MatMulNBits can
    replace, so an "int4" export would be fp32 under another name."""
    with pytest.raises(ExportError, match="none of this traced graph's weights could be quantized to int4.*Gemm"):
        export_model(ExportRequest(model=str(traced.checkpoint("gpt2")), dtype="int4"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_builder_hand_and_untraceable_requests_are_refused_with_the_reason(traced, tmp_path):
    gpt2 = str(traced.checkpoint("gpt2"))
    with pytest.raises(ExportError, match="no hand-built architecture for model_type 'gpt2'.*builder auto or traced"):
        export_model(ExportRequest(model=gpt2, builder="hand"), tmp_path / "hand")
    with pytest.raises(ExportError, match="attn_dynamic contract only, not variant gqa"):
        export_model(ExportRequest(model=gpt2, variant="gqa"), tmp_path / "gqa")
    with pytest.raises(ExportError, match="attn_dynamic contract only, not static_cache"):
        ExportRequest(model=gpt2, builder="traced", static_cache=True, max_seq_len=64).resolved_variant()


def test_weights_that_are_not_the_config_s_model_are_refused_before_any_trace(traced, tmp_path):
    """transformers would fill the weights it does not find with random values (and warn): an export of noise."""
    import shutil

    mislabeled = tmp_path / "gpt2-says-opt"
    shutil.copytree(traced.checkpoint("gpt2"), mislabeled)
    config = json.loads((mislabeled / "config.json").read_text())
    (mislabeled / "config.json").write_text(json.dumps({**config, "model_type": "opt"}))
    with pytest.raises(ExportError, match="does not hold the weights transformers' OPTForCausalLM expects .* missing"):
        export_model(ExportRequest(model=str(mislabeled)), tmp_path / "out")


def test_a_model_with_recurrent_state_is_refused_by_name(tmp_path):
    """Mamba keeps no keys and values: the contract has nowhere to carry its states."""
    checkpoint = make_traced_checkpoint("mamba", tmp_path / "mamba")
    with pytest.raises(ExportError, match="mamba keeps its state in DynamicCache .*not a KV cache"):
        export_model(ExportRequest(model=str(checkpoint)), tmp_path / "out")


def test_prophetnet_does_not_trace_and_the_job_says_why(tmp_path):
    """ProphetNet's decoder asserts one new token per cached step: the contract's many-token step (a prefill
    through the same graph) cannot be traced from it."""
    checkpoint = make_traced_checkpoint("prophetnet", tmp_path / "prophetnet")
    with pytest.raises(ExportError, match=r"could not trace prophetnet \(AssertionError: .*use_cache.*\).*hand"):
        export_model(ExportRequest(model=str(checkpoint)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_untraceable_model_fails_with_the_trace_s_reason(traced, tmp_path, monkeypatch):
    """A forward torch.export cannot trace (a branch on a tensor's value, as some remote code has) fails
    the job with transformers.exporters' own reason and what to do."""
    import torch
    from transformers.models.gpt2 import modeling_gpt2

    original = modeling_gpt2.GPT2MLP.forward

    def data_dependent(self, hidden_states):
        if hidden_states.sum() > 0:  # a Python branch on a value: no graph can hold it
            return original(self, hidden_states)
        return torch.zeros_like(hidden_states)

    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", data_dependent)
    with pytest.raises(ExportError, match=r"transformers.exporters could not trace gpt2 \(.*\).*hand") as failed:
        export_model(ExportRequest(model=str(traced.checkpoint("gpt2"))), tmp_path / "out")
    assert "data-dependent" in str(failed.value).lower() or "guard" in str(failed.value).lower()
    assert not (tmp_path / "out").exists()


def test_the_api_queues_a_traced_model_as_attn_dynamic_and_refuses_builder_hand(traced, tmp_path):
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from services.catalog.database import upgrade_schema
    from services.settings import Settings

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-gpt2").symlink_to(traced.checkpoint("gpt2"))
    admin = "admin-token-for-traced-tests-0123456789"
    settings = Settings(data_dir=tmp_path / "data", models_dir=models, admin_token=admin)
    upgrade_schema(settings.catalog_url)
    api = TestClient(create_app(settings))
    headers = {"Authorization": f"Bearer {admin}"}
    queued = api.post("/exports", json={"model": "tiny-gpt2", "dtype": "fp16", "ep": "cuda"}, headers=headers)
    assert queued.status_code == 202, queued.text
    assert (queued.json()["variant"], queued.json()["builder"]) == ("attn_dynamic", "auto")  # not cuda's gqa
    refused = api.post("/exports", json={"model": "tiny-gpt2", "builder": "hand"}, headers=headers)
    assert refused.status_code in (400, 422) and "no hand-built architecture" in refused.text
