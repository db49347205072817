"""Validation gates: good exports pass every gate; each kind of broken export is caught by its gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporter.validation.gates import runtime_probe
from exporter.validation.gates.runtime_probe import ProbeOutcome, classify_probe_output, probe
from exporter.runtime.session import Decoder
from exporter.validation.validate import REPORT_JSON, REPORT_MD, validate_export
from tests.conftest import ARCHITECTURES, VARIANTS


def _failed(report, gate):
    return [g for g in report.gates if g.gate == gate and not g.passed]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_good_exports_pass_every_gate(arch, variant, exported):
    report = validate_export(exported(arch, variant))
    assert report.passed, report.summary()
    genai = {"genai"} if variant != "attn_static" else set()  # a genai package is loaded in onnxruntime-genai too
    assert {g.gate for g in report.gates} == {"structure", "weights", "runtime", "parity"} | genai


@pytest.mark.parametrize("variant", VARIANTS)
def test_good_fp16_exports_pass_every_gate(variant, exported):
    report = validate_export(exported("qwen3", variant, "fp16"))
    assert report.passed, report.summary()


def test_report_files_hold_every_figure(exported, tmp_path):
    export_dir = shutil.copytree(exported("qwen3", "attn_static", "fp16"), tmp_path / "e")
    # One element one fp16 step off: no longer the exact conversion, but within fp16's bounds, so
    # that slice is compared by statistics (and passes) while every other one stays bit-exact.
    down = _data_view(export_dir, "model.layers.1.mlp.down_proj.weight.T")
    bits = down.view(np.uint16)
    bits[3, 5] += 1
    down.flush()
    report = validate_export(export_dir)
    report.write()
    data = json.loads((export_dir / REPORT_JSON).read_text())
    assert data["status"] == "passed" and data["failed_gates"] == []
    checks = {g["check"]: g for g in data["gates"]}
    prefill = checks["prefill logits max abs error vs transformers"]
    assert 0 <= prefill["measured"] <= prefill["threshold"]
    assert data["parity"]["steps"] >= 24 and isinstance(data["parity"]["near_ties"], list)
    weights = checks["every checkpoint slice matches its source by value"]
    slices = int(weights["measured"].split("/")[1].split()[0])
    assert weights["details"]["bit_exact"] == slices - 1 and weights["details"]["compared_by_statistics"] == 1
    [nudged] = weights["details"]["worst"]
    assert nudged["initializer"] == "model.layers.1.mlp.down_proj.weight.T" and not nudged["exact"]
    assert 0 < nudged["rel_l2"] < 1e-3 and nudged["correlation"] > 0.9999 and nudged["max_abs"] > 0
    assert data["gates"][0]["measured"] == "ok"
    markdown = (export_dir / REPORT_MD).read_text()
    assert markdown.startswith("# Validation: PASSED")
    assert f"Weight slices: {slices - 1} bit-exact" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    # header + one row per check, then the weight table's header + the one slice with figures
    assert len(table) == 1 + len(data["gates"]) + 1 + 1
    assert f"{prefill['measured']:.4g}" in markdown


# --- broken exports -------------------------------------------------------------------------------


def _copy(src, dst):
    return shutil.copytree(src, dst)


def _external(export_dir, name):
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name == name)
    info = {e.key: e.value for e in init.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    return int(info["offset"]), tuple(init.dims), np.dtype(dtype)


def _data_view(export_dir, name):
    offset, shape, dtype = _external(export_dir, name)
    return np.memmap(export_dir / "model.onnx.data", dtype=dtype, mode="r+", offset=offset, shape=shape)


def test_zeroed_packed_qkv_slice_is_caught_by_weights_gate(exported, tmp_path):
    export_dir = _copy(exported("llama", "gqa"), tmp_path / "zeroed")
    packed = _data_view(export_dir, "model.layers.0.self_attn.q_k_v_proj.weight.T")
    packed[:, 64:96] = 0  # the K slice (q: 4 heads x 16, k: 2 heads x 16)
    packed.flush()
    report = validate_export(export_dir)
    failed = _failed(report, "weights")
    assert failed and "model.layers.0.self_attn.q_k_v_proj.weight.T[:, 64:96]" in failed[0].message
    assert "k_proj.weight" in failed[0].message
    # Counts and dtypes are unchanged: the structure gate has nothing to say.
    assert not _failed(report, "structure")


def test_fp32_initializer_in_fp16_build_is_caught_by_structure_gate(exported, tmp_path):
    src = exported("qwen2", "attn_dynamic", "fp16")
    model = onnx.load(str(src / "model.onnx"))
    for init in model.graph.initializer:
        if init.name == "model.norm.weight":
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init).astype(np.float32), init.name))
    export_dir = tmp_path / "fp32init"
    export_dir.mkdir()
    onnx.save(model, str(export_dir / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["initializers"]["model.norm.weight"]["dtype"] = "FLOAT"
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    report = validate_export(export_dir)
    failed = _failed(report, "structure")
    assert any("model.norm.weight" in g.message and "float32" in g.check for g in failed)
    assert not report.passed


def test_wrong_present_head_dim_is_caught_by_structure_gate(exported, tmp_path):
    export_dir = _copy(exported("llama", "gqa"), tmp_path / "headdim")
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    out = next(o for o in model.graph.output if o.name == "present.1.key")
    out.type.tensor_type.shape.dim[3].dim_value = 8  # the GQA shape-inference bug: wrong head_dim
    onnx.save(model, str(export_dir / "model.onnx"))
    report = validate_export(export_dir)
    failed = _failed(report, "structure")
    assert failed and "present.1.key" in failed[0].message


def test_if_node_around_attention_is_caught_by_structure_gate(exported, tmp_path):
    export_dir = _copy(exported("llama", "attn_static"), tmp_path / "ifnode")
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    graph = model.graph
    index, attention = next((i, n) for i, n in enumerate(graph.node) if n.op_type == "Attention")
    branch_out = onnx.helper.make_tensor_value_info(attention.output[0], onnx.TensorProto.FLOAT, None)

    def branch(name):
        inner = onnx.helper.make_node("Attention", attention.input, [attention.output[0]], attribute=None, name=name)
        inner.attribute.extend(attention.attribute)
        return onnx.helper.make_graph([inner], name, [], [branch_out])

    cond = onnx.helper.make_tensor("phase_is_decode", onnx.TensorProto.BOOL, [], [True])
    graph.initializer.append(cond)
    wrapped = onnx.helper.make_node(
        "If", ["phase_is_decode"], [attention.output[0]], name="phase_split_layer0",
        then_branch=branch("decode_attention"), else_branch=branch("prefill_attention"),
    )
    graph.node.remove(attention)
    graph.node.insert(index, wrapped)
    onnx.save(model, str(export_dir / "model.onnx"))
    report = validate_export(export_dir)
    failed = _failed(report, "structure")
    assert any("phase_split_layer0 (If)" in g.message for g in failed)
    # The model still computes the right numbers: only the structure gate can see the problem.
    assert not _failed(report, "parity")


class NonpadBeforeScatter(Decoder):
    """A runtime that feeds nonpad_kv_seqlen = tokens cached *before* this step's scatter."""

    def counts(self, cached, new_tokens):
        counts = super().counts(cached, new_tokens)
        counts["nonpad_kv_seqlen"] = counts["write_indices"].copy()
        return counts


def test_nonpad_counted_before_scatter_is_caught_by_parity_gate(exported):
    report = validate_export(exported("llama", "attn_static"), lm_factory=lambda d, ep: NonpadBeforeScatter(d, ep=ep))
    assert _failed(report, "parity"), report.summary()
    assert not _failed(report, "structure") and not _failed(report, "weights")


def test_swapped_mlp_weights_are_caught_by_weights_gate(exported, tmp_path):
    export_dir = _copy(exported("qwen2", "attn_dynamic"), tmp_path / "swapped")
    a = _data_view(export_dir, "model.layers.0.mlp.down_proj.weight.T")
    b = _data_view(export_dir, "model.layers.1.mlp.down_proj.weight.T")
    a_copy = np.array(a)
    a[:] = b
    b[:] = a_copy
    a.flush()
    b.flush()
    report = validate_export(export_dir)
    message = _failed(report, "weights")[0].message
    assert "model.layers.0.mlp.down_proj.weight.T" in message and "model.layers.1.mlp.down_proj.weight.T" in message
    assert _failed(report, "parity")


def test_peer_gate_compares_variants(exported, checkpoint):
    ok = validate_export(exported("phi3", "attn_static"), peer=exported("phi3", "attn_dynamic"))
    assert ok.passed
    other = validate_export(exported("phi3", "attn_static"), peer=exported("llama", "attn_dynamic"))
    assert [g.check for g in other.failed] == ["attn_static vs attn_dynamic of the same checkpoint"]


# --- runtime probe --------------------------------------------------------------------------------


VARIANTS_FORMS = [("attn_static", False), ("attn_dynamic", False), ("gqa", False), ("gqa", True)]


@pytest.mark.parametrize("variant, packed", VARIANTS_FORMS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_probe_supports_cpu(variant, packed, dtype):
    assert probe(variant, "cpu", dtype, packed)[0] is ProbeOutcome.SUPPORTED


def test_probe_reports_missing_cuda_ep():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the missing-EP path cannot be shown here")
    outcome, message = probe("attn_static", "cuda", "fp16")
    assert outcome is ProbeOutcome.MISSING and "CUDAExecutionProvider" in message


def test_probe_catches_a_wrong_count(monkeypatch):
    """Real ORT fed the count before the scatter computes 2.0 (mean of slots 0, 1): wrong-result."""
    monkeypatch.setattr(runtime_probe, "NONPAD_AFTER_SCATTER", 2)
    outcome, message = probe("attn_static", "cpu", "fp32")
    assert outcome is ProbeOutcome.WRONG_RESULT and "2" in message


def test_probe_names_top_left_alignment():
    outcome, message = classify_probe_output(np.full((1, 1, 32), 1.0, np.float32))
    assert outcome is ProbeOutcome.WRONG_RESULT and "top-left" in message


def _attention_nodes(model) -> list:
    wanted = {"Attention", "TensorScatter", "GroupQueryAttention"}
    return [n for n in model.graph.node if n.op_type in wanted]


def _pattern(model, node_count: int) -> list[tuple]:
    """(op, domain, attributes but head counts, rank of each input or None) of the first attention nodes."""
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*model.graph.input, *model.graph.value_info]}
    import onnx.shape_inference

    inferred = onnx.shape_inference.infer_shapes(model)
    ranks.update({v.name: len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info})
    for node in inferred.graph.node:  # a scatter's output is its cache, whatever inference knew
        if node.op_type == "TensorScatter" and node.input[0] in ranks:
            ranks[node.output[0]] = ranks[node.input[0]]
    out = []
    for node in _attention_nodes(inferred)[:node_count]:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                 if a.name not in ("q_num_heads", "kv_num_heads", "num_heads")}
        heads = sorted(a.name for a in node.attribute if a.name in ("q_num_heads", "kv_num_heads", "num_heads"))
        out.append((node.op_type, node.domain, attrs, heads, [ranks.get(i) if i else None for i in node.input[:7]]))
    return out


@pytest.mark.parametrize("arch, variant", [("llama", "attn_static"), ("llama", "attn_dynamic"), ("llama", "gqa"),
                                           ("qwen3", "gqa")])
def test_probe_runs_the_pattern_an_export_ships(arch, variant, exported):
    """Same ops, attributes (head counts aside) and input layouts as the export's first layer."""
    import onnx_ir as ir

    from exporter.validation.validate import _packed_gqa

    export_dir = exported(arch, variant)
    export = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    nodes = {"attn_static": 3, "attn_dynamic": 1, "gqa": 1}[variant]
    probe_model, _ = runtime_probe.probe_graph(variant, "fp32", _packed_gqa(export_dir / "model.onnx"))
    shipped, probed = _pattern(export, nodes), _pattern(ir.to_proto(probe_model), nodes)
    assert len(probed) == nodes and probed == shipped
    assert _packed_gqa(export_dir / "model.onnx") is (variant == "gqa" and arch == "llama")


def test_attn_static_fails_validation_when_probe_fails(exported, monkeypatch):
    monkeypatch.setattr(runtime_probe, "NONPAD_AFTER_SCATTER", 2)
    report = validate_export(exported("llama", "attn_static"))
    assert [g.gate for g in report.failed] == ["runtime"]
    # attn_dynamic's probe runs its own pattern (no scatter counts): unaffected.
    assert validate_export(exported("llama", "attn_dynamic")).passed


def test_checks_that_cannot_fail_for_a_variant_are_info_not_passed(exported):
    report = validate_export(exported("llama", "gqa"))
    flow = next(g for g in report.gates if "If/Loop/Scan" in g.check)
    assert flow.status == "info" and report.to_dict()["gates"][[g.check for g in report.gates].index(flow.check)]["status"] == "info"
    assert "informational" in report.summary()
    static = validate_export(exported("llama", "attn_static"))
    assert next(g for g in static.gates if "If/Loop/Scan" in g.check).status == "pass"


# --- validation as a pipeline stage ---------------------------------------------------------------


def test_export_validates_by_default_and_records_it(checkpoint, tmp_path):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    result = export_model(ExportRequest(model=str(checkpoint("qwen3")), dtype="fp16"), tmp_path / "out")
    manifest = result.manifest.data
    assert manifest["status"] == "ready" and manifest["validation"]["status"] == "passed"
    for name in (REPORT_JSON, REPORT_MD):
        assert manifest["files"][name]["size"] == (tmp_path / "out" / name).stat().st_size


def test_failed_gate_publishes_quarantined_and_exits_non_zero(checkpoint, tmp_path, monkeypatch, capsys):
    from exporter.cli import main

    monkeypatch.setattr(runtime_probe, "NONPAD_AFTER_SCATTER", 2)
    out = tmp_path / "q"
    code = main(["export", "--model", str(checkpoint("llama")), "--static-cache", "--max-seq-len", "64", "--out", str(out)])
    assert code != 0
    err = capsys.readouterr().err
    assert "exportfarm: error: validation failed: runtime" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "quarantined" and manifest["validation"]["failed_gates"] == ["runtime"]
    assert json.loads((out / REPORT_JSON).read_text())["status"] == "failed"


def test_validate_cli_names_the_failed_gate(exported, tmp_path, capsys):
    from exporter.cli import main

    export_dir = _copy(exported("llama", "gqa"), tmp_path / "cli")
    packed = _data_view(export_dir, "model.layers.1.self_attn.q_k_v_proj.weight.T")
    packed[:, :64] = 0
    packed.flush()
    assert main(["validate", str(export_dir)]) != 0
    captured = capsys.readouterr()
    assert "[FAIL] weights" in captured.out and "validation failed: weights" in captured.err
    assert (export_dir / REPORT_MD).read_text().startswith("# Validation: FAILED")


def test_the_reference_run_is_computed_once_per_checkpoint_and_shared_by_variants(exported, tmp_path, monkeypatch):
    """Every variant (and dtype) of one checkpoint validates against one cached reference run; a
    torn cache file is recomputed, not trusted."""
    import exporter.validation.reference as reference

    calls = []
    real = reference.reference_greedy
    monkeypatch.setattr(reference, "reference_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "references"
    reports = [validate_export(exported("qwen3", v), reference_cache=cache) for v in VARIANTS]
    assert len(calls) == 1 and [r.timings_s["reference_cached"] for r in reports] == [0.0, 1.0, 1.0]
    assert all(r.passed for r in reports)
    fresh = validate_export(exported("qwen3", "gqa"))  # no cache: computed again, same figures
    assert fresh.parity["tokens"] == reports[1].parity["tokens"] and len(calls) == 2
    (stored,) = cache.glob("greedy-*.npz")
    stored.write_bytes(stored.read_bytes()[:100])
    again = validate_export(exported("qwen3", "attn_dynamic"), reference_cache=cache)
    assert again.timings_s["reference_cached"] == 0.0 and again.passed and len(calls) == 3


def test_a_fresh_reference_checks_the_export_s_own_tokens_and_reuses_that_run(exported, tmp_path, monkeypatch):
    """With no cached reference, the export decodes on its own first and transformers checks those
    tokens in one pass; where the export chose the reference's tokens at every step that run is the
    teacher-forced one and is judged as it is, and where it strayed it runs again on the reference's
    tokens, so a wrong runtime is still caught, on the reference's history."""
    import exporter.validation.parity as parity

    feeds = []
    real = parity.export_decode
    monkeypatch.setattr(parity, "export_decode", lambda lm, prompt, steps, feed=None, **k:
                        feeds.append(feed) or real(lm, prompt, steps, feed, **k))
    good = validate_export(exported("llama", "attn_static"), reference_cache=tmp_path / "a")
    assert good.passed and good.timings_s["reference_cached"] == 0.0 and feeds == [None]

    feeds.clear()
    bad = validate_export(exported("llama", "attn_static"), reference_cache=tmp_path / "b",
                          lm_factory=lambda d, ep: NonpadBeforeScatter(d, ep=ep))
    # A broken export does not follow the reference: its one redraft misses at once and it is not
    # asked again; then it runs once more, teacher-forced.
    assert _failed(bad, "parity") and feeds[0] is None and bad.timings_s["reference_redrafts"] == 1.0
    assert len(feeds) == 3 and feeds[1] is None and feeds[2] is not None
    # The second run was fed the reference's tokens: those "b" now caches, which are the tokens the
    # good export chose (checked in one pass of its draft in "a").
    again = validate_export(exported("llama", "attn_static"), reference_cache=tmp_path / "b")
    assert again.timings_s["reference_cached"] == 1.0 and again.parity["tokens"] == good.parity["tokens"]
    assert feeds[2] == good.parity["tokens"]


def test_the_reference_loaded_beside_the_session_gives_the_same_report(exported, tmp_path, monkeypatch):
    """Where the export runs on a device, transformers' (streamed) model is set up on a thread while
    the probe and the export's session run; here (CPU) that path is forced: the session is made
    while the load is under way, the report holds the same tokens and figures as loading after the
    session, and a load that fails on the thread still fails the run."""
    import threading

    import exporter.validation.reference as reference
    import exporter.validation.validate as validate
    from exporter.errors import ExportError

    export_dir = exported("qwen3", "attn_static")
    after = validate_export(export_dir, reference_cache=tmp_path / "after")
    loads, loading = [], threading.Event()
    real = reference.open_reference

    def load(*a, **k):
        loads.append(threading.current_thread().name)
        loading.set()
        return real(*a, **k)

    def session(d, ep):
        # Made only once the load has started: if the load waited for the session, this times out.
        assert loading.wait(timeout=60), "the reference did not load while the session was made"
        return validate.validation_session(d, ep, "fp32")

    monkeypatch.setattr(reference, "open_reference", load)
    monkeypatch.setattr(validate, "reference_beside_session", lambda ep: True)
    beside = validate_export(export_dir, reference_cache=tmp_path / "beside", lm_factory=session)
    assert beside.passed and after.passed and len(loads) == 1 and loads[0].startswith("reference")
    assert beside.parity == after.parity and beside.timings_s["reference_load"] > 0
    assert [g.to_dict() for g in beside.gates if g.gate != "weights"] == [g.to_dict() for g in after.gates if g.gate != "weights"]

    def broken(*a, **k):
        loads.append(threading.current_thread().name)
        raise ExportError("transformers cannot load the reference checkpoint")

    loads.clear()
    monkeypatch.setattr(reference, "open_reference", broken)
    with pytest.raises(ExportError, match="cannot load the reference"):
        validate_export(export_dir, reference_cache=tmp_path / "broken")
    assert len(loads) == 1 and loads[0].startswith("reference")


def test_the_export_session_is_made_while_the_prompts_are_tokenized(exported, tmp_path, monkeypatch):
    """onnxruntime makes the export's session on a thread (it releases the GIL meanwhile) while the
    validating thread tokenizes the prompts and looks up the reference, mostly Python: each starts
    before the other is done, and the report is what making them in turn gives."""
    import threading

    import exporter.validation.validate as validate

    export_dir = exported("qwen3", "gqa")
    in_turn = validate_export(export_dir, reference_cache=tmp_path / "r")
    making, tokenizing = threading.Event(), threading.Event()
    real = validate.parity_prompts

    def session(d, ep):
        making.set()
        assert tokenizing.wait(timeout=30), "the prompts waited for the session"
        return validate.validation_session(d, ep, "fp32")

    def prompts(*args, **kwargs):
        tokenizing.set()
        assert making.wait(timeout=30), "the session waited for the prompts"
        return real(*args, **kwargs)

    monkeypatch.setattr(validate, "parity_prompts", prompts)
    beside = validate_export(export_dir, reference_cache=tmp_path / "r", lm_factory=session)
    assert beside.passed and in_turn.passed and beside.parity == in_turn.parity
    assert [g.to_dict() for g in beside.gates if g.gate != "weights"] == [g.to_dict() for g in in_turn.gates
                                                                         if g.gate != "weights"]


def test_a_session_that_fails_does_not_wait_for_the_reference_loading_beside_it(exported, tmp_path, monkeypatch):
    """The parity gate fails at once when the export's session cannot be made; the reference model
    loading on its thread is not waited for (it is dropped when done)."""
    import threading

    import exporter.validation.reference as reference
    import exporter.validation.validate as validate

    release, finished = threading.Event(), threading.Event()

    def slow_load(*a, **k):
        release.wait(timeout=60)
        finished.set()
        return None

    def no_session(d, ep):
        raise RuntimeError("no such device")

    monkeypatch.setattr(reference, "open_reference", slow_load)
    monkeypatch.setattr(validate, "reference_beside_session", lambda ep: True)
    try:
        report = validate_export(exported("qwen3", "attn_static"), reference_cache=tmp_path / "r", lm_factory=no_session)
        assert not finished.is_set()  # returned while the load was still under way
    finally:
        release.set()
    assert _failed(report, "parity") and "no such device" in report.summary()
    assert finished.wait(timeout=60)


def test_the_weight_check_on_several_threads_gives_the_one_thread_figures(exported, monkeypatch):
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.validation.gates import weights

    export_dir = exported("qwen2", "gqa", "fp16")
    manifest = json.loads((export_dir / "manifest.json").read_text())
    source = Checkpoint(Path(manifest["source"]["path"]))
    monkeypatch.setattr(weights, "_exact_part", lambda *args: False)  # every slice through the statistics
    figures = {}
    for threads in (1, 3):
        monkeypatch.setattr(weights, "compare_threads", lambda threads=threads: threads)
        results, stats = weights.weight_integrity(export_dir / "model.onnx", manifest, source, "fp16")
        assert results[0].passed
        figures[threads] = [s.to_dict() for s in stats]
        assert all(s.rel_l2 is not None for s in stats)
    assert figures[1] == figures[3]


def test_validation_s_session_computes_a_default_session_s_logits(exported):
    """Validation's sessions skip the CPU's weight prepacking and keep their threads from spinning;
    the logits are those of a default session."""
    from exporter.validation.validate import validation_session

    export_dir = exported("qwen2", "attn_dynamic")
    prompt = np.array([[5, 17, 99, 3, 42, 8]], dtype=np.int64)
    default, validating = Decoder(export_dir), validation_session(export_dir, "cpu", "fp32")
    # Set under onnxruntime's own keys (kOrtSessionOptionsConfigDisablePrepacking,
    # kOrtSessionOptionsConfigAllowIntraOpSpinning): it ignores unknown keys.
    options = validating.session.get_session_options()
    assert options.get_session_config_entry("session.disable_prepacking") == "1"
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    a, b = default.forward(prompt, default.new_state()), validating.forward(prompt, validating.new_state())
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(a.max() - a.min()))


def _planted_overflow(source: Path, out: Path, layer: int = 1, scale: float = 3e4) -> Path:
    """``source`` with one norm weight scaled so its layer's activations exceed fp16's 65504 (the
    weight itself still fits fp16)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        name = f"model.layers.{layer}.post_attention_layernorm.weight"
        if name in tensors:
            assert np.abs(tensors[name]).max() * scale < 65504
            tensors[name] = tensors[name] * np.float32(scale)
            save_file(tensors, f, metadata={"format": "pt"})
    return out


def test_a_planted_fp16_overflow_fails_naming_the_layer_and_the_dtype_that_passes(checkpoint, tmp_path):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    source = _planted_overflow(checkpoint("llama"), tmp_path / "ckpt")

    def export(dtype):
        request = ExportRequest(model=str(source), dtype=dtype, ep="cpu", variant="attn_dynamic", max_seq_len=64)
        return export_model(request, tmp_path / dtype, validate=False).out_dir

    report = validate_export(export("fp16"))
    assert not report.passed
    [finite] = [g for g in report.gates if g.check == "export outputs finite"]
    assert finite.status == "fail"
    assert finite.message.startswith("fp16 overflows in decoder layer 1 ("), finite.message
    assert "transformers itself in fp16 overflows" in finite.message
    assert finite.message.endswith("export fp32 for cpu (bf16, which has fp32's range, runs on cuda only)")
    assert finite.details["overflow"]["layer"] == 1
    assert "fp16 overflows in decoder layer 1" in report.summary()  # what the API and the page show
    [beside] = [g for g in report.gates if g.check == "transformers in fp16 beside the export"]
    assert beside.status == "info" and beside.details["transformers"]["overflow_layer"] == 1
    # transformers in bf16 holds the model (an fp16 export for cuda is told to export bf16), and the
    # fp32 export the failure names for cpu passes
    assert beside.details["transformers_bf16"]["nonfinite_steps"] == []
    assert validate_export(export("fp32")).passed


def test_an_fp16_report_lists_transformers_in_fp16_beside_the_export(exported):
    report = validate_export(exported("llama", "attn_dynamic", "fp16"))
    assert report.passed, report.summary()
    [beside] = [g for g in report.gates if g.check == "transformers in fp16 beside the export"]
    export, yard = beside.details["export"], beside.details["transformers"]
    assert beside.status == "info" and export["run"] == "export" and yard["run"] == "transformers"
    assert len(export["step_errors"]) == len(yard["step_errors"]) == report.parity["steps"]
    assert 0 < max(yard["step_errors"]) < 1 and yard["nonfinite_steps"] == [] and yard["device"] == "cpu"
    [decode] = [g for g in report.gates if g.check.startswith("greedy decode")]
    assert decode.details["measured_margin"] == pytest.approx(yard["tie_margin"])
    assert yard["tie_margin"] == pytest.approx(2 * max(yard["gap_errors"]))
    # the measured margin widens the fixed one (0.1 for fp16), never narrows it
    assert decode.details["near_tie_margin"] == pytest.approx(max(0.1, yard["tie_margin"]))
    assert decode.details["margin_source"] == ("measured" if yard["tie_margin"] > 0.1 else "fixed")
    assert beside.message == ""  # a passing export is not told its drift is a fault
    assert not [g for g in report.gates if g.check.startswith("transformers in fp32")]  # fp32 has no yardstick
