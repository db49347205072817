"""Mixture-of-experts exports (mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe) through onnxruntime's
fused expert ops: every variant matches transformers, the experts run as one MoE / QMoE node per
layer, quantized experts equal the checkpoint's own quantize-dequantize in transformers, and the
weight gate reads every expert back by value."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from exporter.contract import META_CONFIG
from exporter.errors import ExportError
from exporter.graph.architectures import ARCHITECTURES as REGISTRY
from exporter.graph.config import load_model_config
from exporter.packaging.checkpoint import Checkpoint
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.runtime.session import Decoder
from exporter.tiny_checkpoint import MOE_ARCHITECTURES, mxfp4_checkpoint
from exporter.validation.gates.weights import weight_integrity
from exporter.validation.parity import run_parity
from exporter.validation.reference import load_reference, reference_greedy
from exporter.validation.streamed import StreamedReference
from exporter.validation.validate import validate_export
from tests.conftest import DECODE_STEPS, MAX_SEQ_LEN, VARIANTS
from tests.quantized_reference import dequantized_checkpoint

MOE = list(MOE_ARCHITECTURES)
# gpt-oss's attention sinks exist only in GroupQueryAttention: its other variants are refused.
SINKS = {"gpt_oss"}
CASES = [(arch, variant) for arch in MOE for variant in VARIANTS if arch not in SINKS or variant == "gqa"]


def _variant(arch: str) -> str:
    return "gqa" if arch in SINKS else "attn_dynamic"


def _prompt(arch: str, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(len(arch) + n).integers(3, 250, size=n)]


def _nodes(export_dir) -> list[onnx.NodeProto]:
    return list(onnx.load(str(export_dir / "model.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("arch, variant", CASES)
def test_fp32_matches_transformers(arch, variant, exported, reference):
    ref = reference(arch)
    result = run_parity(Decoder(exported(arch, variant)), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("arch, variant", CASES)
def test_fp16_matches_transformers_except_near_ties(arch, variant, exported, reference):
    ref = reference(arch)
    result = run_parity(Decoder(exported(arch, variant, "fp16")), ref, near_tie_margin=0.1)
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    assert len(result.near_ties) <= result.steps // 2
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


@pytest.mark.parametrize("arch", MOE)
def test_experts_run_as_one_fused_op_per_sparse_layer(arch, checkpoint, exported):
    """One MoE node per sparse layer (no per-expert loop, no control flow), fc1 stacked
    [experts, 2I, hidden] and fc2 [experts, hidden, I], attributes stated for the family's routing."""
    cfg = load_model_config(checkpoint(arch), REGISTRY)
    moe = cfg.moe
    nodes = _nodes(exported(arch, _variant(arch)))
    fused = [n for n in nodes if n.op_type == "MoE" and n.domain == "com.microsoft"]
    assert len(fused) == sum(moe.sparse_layers) >= 1
    assert not any(n.op_type in ("Loop", "If", "Scan") for n in nodes)
    model = onnx.load(str(exported(arch, _variant(arch)) / "model.onnx"), load_external_data=False)
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    for node in fused:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k"] == moe.top_k and attrs["swiglu_fusion"] == 1 and attrs["activation_type"] == b"swiglu"
        assert attrs["normalize_routing_weights"] == int(moe.op_normalize)
        if arch == "gpt_oss":  # its clamped SwiGLU, and biases on the experts
            assert (attrs["activation_alpha"], attrs["activation_beta"], attrs["swiglu_limit"]) == (
                pytest.approx(1.702), 1.0, 7.0)
            assert node.input[3] and node.input[5]
        assert dims[node.input[2]] == [moe.num_experts, 2 * moe.expert_intermediate, cfg.hidden_size]
        assert dims[node.input[4]] == [moe.num_experts, cfg.hidden_size, moe.expert_intermediate]
    # qwen2_moe: layer 1 is in mlp_only_layers, a dense MLP; its shared expert sits beside the op.
    if arch == "qwen2_moe":
        assert moe.sparse_layers == (True, False) and moe.shared_expert_intermediate == 48 and not moe.normalize


@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("arch", MOE)
def test_quantized_experts_match_the_dequantized_checkpoint_in_transformers(arch, dtype, checkpoint, tmp_path):
    """QMoE (int4 blocks of 32, int8 one scale per row) and 4-bit MatMulNBits at accuracy level 0
    compute in fp32 on the CPU: the export's logits are transformers' on the checkpoint whose quantized
    weights are replaced by their dequantized values, to 1e-4 of the logit range, and greedy decode
    gives the same tokens. 8-bit MatMulNBits runs int8 activations there (its only fast kernel): within
    5% of the range, at most 2 of 24 decisive steps different on these random weights (measured
    0.5-3.7%, 0-2)."""
    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype=dtype, ep="cpu", variant=_variant(arch), max_seq_len=MAX_SEQ_LEN,
                            quant={"accuracy_level": 0} if dtype == "int4" else None)
    out = export_model(request, tmp_path / "export", validate=False).out_dir
    nodes = _nodes(out)
    qmoe = [n for n in nodes if n.op_type == "QMoE"]
    cfg = load_model_config(source, REGISTRY)
    assert len(qmoe) == sum(cfg.moe.sparse_layers) and not any(n.op_type == "MoE" for n in nodes)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in qmoe[0].attribute}
    assert attrs["expert_weight_bits"] == int(dtype[-1]) and attrs["weights_prepacked"] == 0
    assert ("block_size" in attrs) == (dtype == "int4")
    # a model that does not renormalize its top k mixes by the softmax, given as router_weights
    assert (len(qmoe[0].input) > 14 and qmoe[0].input[14] != "") == (not cfg.moe.op_normalize)
    manifest = json.loads((out / "manifest.json").read_text())
    decisions = manifest["quantization"]["weights"]
    routers = [name for name, d in decisions.items() if "router" in d.get("roles", [])]
    assert routers and all(decisions[n]["quantized"] is False for n in routers)  # routing stays in float
    assert all(d["quantized"] for d in decisions.values() if "experts" in d.get("roles", []))

    dequantized, _ = dequantized_checkpoint(source, out, tmp_path / "dequantized")
    ref = reference_greedy(load_reference(dequantized), _prompt(arch), DECODE_STEPS)
    if dtype == "int4":
        result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
        assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, result
        assert result.tokens == ref.tokens, result.mismatches
    else:  # the CPU's 8-bit MatMulNBits runs int8 activations (fold.CPU_ACCURACY_LEVEL): close, not exact
        result = run_parity(Decoder(out), ref, near_tie_margin=0.1)
        assert result.prefill_max_abs_error <= 5e-2 * result.logit_range, result
        assert len(result.mismatches) <= 2, result  # of 24 teacher-forced steps, on hypersensitive random weights


@pytest.mark.parametrize("arch", ["qwen2_moe", "granitemoe"])
def test_a_quantized_moe_export_passes_structure_weights_and_runtime(arch, checkpoint, tmp_path):
    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype="int4", ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "q", validate=False).out_dir
    report = validate_export(out)
    for g in report.gates:
        if g.gate in ("structure", "weights", "runtime"):
            assert g.status in ("pass", "info"), g.to_dict()
    weights = next(g for g in report.gates if g.check.startswith("every checkpoint slice"))
    experts = sum(1 for n in Checkpoint(source).names() if "expert" in n or "linear" in n)
    assert int(weights.measured.split("/")[1].split()[0]) >= experts  # every expert tensor, slice by slice


def _flip_row(export_dir, name, row, width, dtype=np.float32) -> None:
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name == name)
    info = {e.key: e.value for e in init.external_data}
    offset = int(info["offset"]) + row * width * np.dtype(dtype).itemsize
    with open(export_dir / "model.onnx.data", "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(width * np.dtype(dtype).itemsize), dtype).copy()
        f.seek(offset)
        f.write((-values).tobytes())


@pytest.mark.parametrize("arch", ["mixtral", "granitemoe", "gpt_oss"])
def test_the_weight_gate_finds_one_wrong_expert_row(arch, checkpoint, tmp_path):
    """Expert 2's up row 5 sits at fc1 row 2 * (2 * I) + 2 * 5 + 1: negated there, the gate fails and
    names that expert's tensor (mixtral: its own w3; granitemoe: input_linear's second half)."""
    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant=_variant(arch), max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "e", validate=False).out_dir
    manifest = json.loads((out / "manifest.json").read_text())
    cfg = load_model_config(source, REGISTRY)
    width = cfg.moe.expert_intermediate
    fc1 = next(n for n in manifest["initializers"] if n.endswith("layers.0.block_sparse_moe.experts.fc1_gate_up")
               or n.endswith("layers.0.mlp.experts.fc1_gate_up"))
    results, _ = weight_integrity(out / "model.onnx", manifest, Checkpoint(source), "fp32")
    assert all(r.passed for r in results)
    _flip_row(out, fc1, 2 * (2 * width) + 2 * 5 + 1, cfg.hidden_size)  # expert 2's up row 5
    results, stats = weight_integrity(out / "model.onnx", manifest, Checkpoint(source), "fp32")
    assert not results[0].passed
    bad = [s for s in stats if not s.passed]
    # gpt-oss: fc1 is each expert's gate_up_proj transposed, its columns already interleaved
    want = {"mixtral": "experts.2.w3.weight", "granitemoe": "input_linear.weight expert 2 rows 32:64",
            "gpt_oss": "experts.gate_up_proj expert 2"}[arch]
    assert len(bad) == 1 and want in bad[0].source, [s.source for s in bad]


@pytest.mark.parametrize("arch", MOE)
def test_the_streamed_reference_reads_experts_as_transformers_loads_them(arch, checkpoint):
    """The checkpoint keeps experts one by one (or renamed); transformers' model holds them fused:
    the streamed reference builds them through transformers' own conversion mapping, bit for bit."""
    source = checkpoint(arch, dtype="bfloat16")
    whole, streamed = load_reference(source), StreamedReference(source)
    ids = torch.tensor([_prompt(arch, 30)])
    with torch.no_grad():
        want = whole(input_ids=ids, use_cache=False).logits
    assert torch.equal(streamed(input_ids=ids, use_cache=False).logits, want)


def test_moe_configs_are_read_and_refused_by_name(checkpoint, tmp_path):
    cfg = load_model_config(checkpoint("qwen3_moe"), REGISTRY)
    raw = json.loads((checkpoint("qwen3_moe") / "config.json").read_text())
    assert "num_local_experts" in raw or "num_experts" in raw  # transformers writes the former for qwen3_moe
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_intermediate, cfg.moe.normalize) == (8, 2, 32, True)
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint("mixtral"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="num_experts_per_tok must be between 1 and the expert count"):
        load_model_config(bad, REGISTRY)
    config["num_experts_per_tok"], config["num_local_experts"] = 2, 4  # the checkpoint holds 8
    (bad / "config.json").write_text(json.dumps(config))
    request = ExportRequest(model=str(bad), dtype="fp32", ep="cpu", variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match="config.json says 4 experts"):
        export_model(request, tmp_path / "out", validate=False)


def test_an_int4_block_that_does_not_divide_the_expert_width_is_refused(checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint("mixtral")), dtype="int4", ep="cpu", variant="attn_dynamic",
                            max_seq_len=MAX_SEQ_LEN, quant={"block_size": 64})
    with pytest.raises(ExportError, match="does not divide"):
        export_model(request, tmp_path / "out", validate=False)


@pytest.mark.parametrize("dtype, activations", [("fp32", "fp32"), ("fp16", "fp16"), ("int4", "fp32"), ("int8", "fp32")])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_runtime_probe_runs_the_export_s_expert_op_to_a_known_answer(dtype, activations, normalize, monkeypatch):
    from exporter.graph.components import moe
    from exporter.validation.gates.runtime_probe import expert_gate

    gate = expert_gate("cpu", activations, dtype, {"top_k": 8, "normalize": normalize})
    assert gate.passed, gate.to_dict()
    # An op routed the other way (renormalizing where the model does not, or the reverse) is caught.
    wrong = moe.expert_attributes
    monkeypatch.setattr(moe, "expert_attributes", lambda k, n, *swiglu: wrong(k, not n, *swiglu))
    gate = expert_gate("cpu", activations, dtype, {"top_k": 8, "normalize": normalize})
    assert not gate.passed and gate.measured == "wrong-result", gate.to_dict()


@pytest.mark.parametrize("variant", ["attn_dynamic", "attn_static"])
def test_gpt_oss_attention_sinks_refuse_the_variants_without_a_sink_input(variant, checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint("gpt_oss")), dtype="fp32", ep="cpu", variant=variant,
                            static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match="only GroupQueryAttention takes .*use --variant gqa"):
        export_model(request, tmp_path / "out", validate=False)


def test_phimoe_s_sparsemixer_is_what_routes_and_longrope_switches_like_transformers(checkpoint, exported, reference,
                                                                                    monkeypatch, tmp_path):
    """A prompt crossing original_max_position_embeddings (64): the long half of the rope tables (with
    transformers' phimoe scaling) takes over, in every variant. And the sparsemixer matters: routed as
    a plain softmax top 2 instead, the same checkpoint leaves transformers' logits."""
    ref = reference("phimoe", prompt_len=56)
    for variant in VARIANTS:
        result = run_parity(Decoder(exported("phimoe", variant)), ref, near_tie_margin=0.0)
        assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, variant
        assert result.tokens == ref.tokens, variant
    import dataclasses

    monkeypatch.setitem(REGISTRY, "phimoe", dataclasses.replace(REGISTRY["phimoe"], sparse_mixer=False))
    request = ExportRequest(model=str(checkpoint("phimoe")), dtype="fp32", ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    naive = export_model(request, tmp_path / "naive", validate=False).out_dir
    result = run_parity(Decoder(naive), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error > 1e-2 * result.logit_range


def _fused_mixers(export_dir) -> list[onnx.NodeProto]:
    return [n for n in _nodes(export_dir) if n.op_type in ("MoE", "QMoE")
            and any(a.name == "use_sparse_mixer" and a.i == 1 for a in n.attribute)]


def test_phimoe_for_cuda_routes_with_the_op_s_own_sparse_mixer_where_its_kernel_computes_the_model_s(checkpoint,
                                                                                                     tmp_path):
    """For CUDA, a float phimoe whose threshold is the kernel's (0.01) over 8 experts routes inside the
    op (use_sparse_mixer=1, unnormalized, no routing nodes), and such an export refuses validation on
    the CPU, whose kernels ignore the attribute. Quantized experts (QMoE ignores it on CUDA too),
    another threshold, or a CPU export keep the sparsemixer in the graph; the quantize pass refuses to
    turn a sparse-mixer MoE into a QMoE."""
    from exporter.validation.gates.runtime_probe import expert_probe_graph

    wide = dict(hidden_size=64, intermediate_size=64)
    exact = checkpoint("phimoe", router_jitter_noise=0.01, **wide)
    for dtype in ("fp16", "bf16"):
        request = ExportRequest(model=str(exact), dtype=dtype, ep="cuda", variant="gqa", max_seq_len=MAX_SEQ_LEN)
        out = export_model(request, tmp_path / f"cuda-{dtype}", validate=False).out_dir
        fused = _fused_mixers(out)
        assert [n.op_type for n in fused] == ["MoE"] * load_model_config(exact, REGISTRY).num_layers
        for node in fused:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert (attrs["k"], attrs["normalize_routing_weights"]) == (2, 0)
        assert not {"ArgMax", "GatherElements", "Softmax"} & {n.op_type for n in _nodes(out)}
        meta = {p.key: p.value for p in onnx.load(str(out / "model.onnx"), load_external_data=False).metadata_props}
        assert json.loads(meta[META_CONFIG])["moe"]["routing"] == "cuda_sparse_mixer"
        with pytest.raises(ExportError, match="CUDA sparse mixer, which the cpu kernels ignore.*--ep cuda"):
            validate_export(out, ep="cpu")
    for name, source, ep, dtype in (("int4", exact, "cuda", "int4"), ("threshold 0.1", checkpoint("phimoe", **wide),
                                     "cuda", "fp16"), ("cpu", exact, "cpu", "fp16")):
        request = ExportRequest(model=str(source), dtype=dtype, ep=ep, variant="gqa", max_seq_len=MAX_SEQ_LEN)
        out = export_model(request, tmp_path / name.replace(" ", "-"), validate=False).out_dir
        assert _fused_mixers(out) == [], name
        assert "ArgMax" in {n.op_type for n in _nodes(out)}, name
    with pytest.raises(ExportError, match="QMoE ignores use_sparse_mixer"):
        expert_probe_graph("fp16", 4, 2, False, tmp_path, sparse_mixer=True)


def test_the_sparse_mixer_known_answer_is_transformers_sparsemixer_and_not_softmax_top_2():
    """The expert gate's sparse-mixer answer: its routing equals transformers' sparsemixer on random
    rows (and on the probe's own), and the probe's answer is not what softmax top-2 would give."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from exporter.validation.gates import runtime_probe as probe

    rows = np.random.default_rng(0).standard_normal((64, 8)) * np.array([[0.02], [1.0], [3.0], [0.5]]).repeat(16, 0)
    rows[:16] += 1.0
    rows = np.vstack([rows, [probe.MIXER_LOGITS]])
    weights, experts = sparsemixer(torch.from_numpy(rows), jitter_eps=0.01, training=False, top_k=2)
    for row, w, e in zip(rows, weights.numpy(), experts.numpy()):
        chosen, ours = probe.sparse_mixer_weights(row, 0.01)
        assert chosen == list(e)
        np.testing.assert_allclose(ours, w, rtol=1e-12)
    mixer = probe.expert_answer(2, False, sparse_mixer=True)
    gates = np.array(probe.MIXER_GATES)
    act = gates / (1 + np.exp(-gates))
    p = np.exp(probe.MIXER_LOGITS) / np.exp(probe.MIXER_LOGITS).sum()
    assert abs(mixer - (p[0] * act[0] + p[1] * act[1])) > 0.5
    assert abs(mixer - (p[0] * act[0] + p[1] * act[1]) / (p[0] + p[1])) > 0.5


def test_quantized_experts_for_cuda_need_the_widths_its_qmoe_kernels_take(checkpoint, tmp_path):
    """onnxruntime-gpu's QMoE checks hidden and expert widths against its 64-wide tile only when it
    runs: refused at export, with what to do instead (the tiny experts are 32 wide)."""
    request = ExportRequest(model=str(checkpoint("mixtral")), dtype="int4", ep="cuda", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match="multiples of 64; this model's expert width is 32"):
        export_model(request, tmp_path / "out", validate=False)
    wide = checkpoint("mixtral", intermediate_size=64)
    request = ExportRequest(model=str(wide), dtype="int4", ep="cuda", max_seq_len=MAX_SEQ_LEN)
    assert export_model(request, tmp_path / "ok", validate=False).out_dir.is_dir()


def test_a_pre_quantized_checkpoint_is_refused_with_the_way_around(checkpoint, tmp_path):
    """A config that declares GPTQ over float weights is refused by name, not as a missing tensor (a
    real GPTQ checkpoint is imported: tests/test_prequantized.py); gpt-oss's MXFP4 is read (test below)."""
    bad = tmp_path / "gptq"
    shutil.copytree(checkpoint("mixtral"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (bad / "config.json").write_text(json.dumps(config))
    request = ExportRequest(model=str(bad), dtype="fp16", ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match="config.json declares gptq weights, but gptq holds no packed linears"):
        export_model(request, tmp_path / "out", validate=False)


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_gpt_oss_mxfp4_experts_are_decoded_as_they_are_read(dtype, checkpoint, tmp_path):
    """A gpt-oss checkpoint as published (MXFP4 experts) exports, the experts decoded exactly: its
    logits are transformers' on the same values stored as floats (fp32: within 1e-4 of the range);
    the weight gate reads every MXFP4 block back with its own decoder; the streamed reference, through
    transformers' own MXFP4 decoder, gives the same logits bit for bit."""
    source, twin = mxfp4_checkpoint(checkpoint("gpt_oss"), tmp_path / "mxfp4", twin=tmp_path / "twin")
    request = ExportRequest(model=str(source), dtype=dtype, ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, tmp_path / "export", validate=False).out_dir
    manifest = json.loads((out / "manifest.json").read_text())
    results, stats = weight_integrity(out / "model.onnx", manifest, Checkpoint(source), dtype, "fp32")
    assert all(r.passed for r in results), [r.to_dict() for r in results]
    assert any("_blocks expert" in s.source for s in stats)
    if dtype == "fp32":
        assert all(s.exact for s in stats)  # decoded values are exact in fp32
        ref = reference_greedy(load_reference(twin), _prompt("gpt_oss"), DECODE_STEPS)
        result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
        assert result.prefill_max_abs_error <= 1e-4 * result.logit_range, result
        assert result.tokens == ref.tokens
        ids = torch.tensor([_prompt("gpt_oss", 30)])
        with torch.no_grad():
            want = load_reference(twin)(input_ids=ids, use_cache=False).logits
        assert torch.equal(StreamedReference(source)(input_ids=ids, use_cache=False).logits, want)


def test_the_streamed_reference_holds_one_layer_s_experts_at_a_time(checkpoint):
    """Validation memory stays bounded for a mixture of experts as for a dense model: the experts of one
    decoder layer (stacked as transformers holds them) are in memory while it runs, none between passes."""
    source = checkpoint("qwen3_moe", num_hidden_layers=4)
    streamed = StreamedReference(source, prefetch=False)
    seen = []
    for layer in streamed.layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(streamed.materialized_layers()))
    streamed(input_ids=torch.tensor([_prompt("qwen3_moe", 20)]), use_cache=False)
    assert seen == [[0], [1], [2], [3]] and streamed.materialized_layers() == []
    experts = streamed.layers[0].mlp.experts
    assert experts.gate_up_proj.device.type == "meta"  # dropped after its layer ran
