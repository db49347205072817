"""``exportfarm diff``: identical exports, planted regressions, two variants of one checkpoint, the CLI."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from exporter.runtime.bench import run_bench
from exporter.cli import main
from exporter.reports.diff import DIFF_JSON, DIFF_MD, ExportArtifacts, Thresholds, diff_exports, write_diff
from exporter.validation.validate import validate_export


@pytest.fixture(scope="module")
def measured(exported, tmp_path_factory):
    """measured(variant) -> a validated and benchmarked copy of the llama export (made once per module)."""
    root = tmp_path_factory.mktemp("diff")
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            export_dir = shutil.copytree(exported("llama", variant), root / variant)
            validate_export(export_dir).write()
            run_bench(export_dir, "cpu", contexts=[16, 32], steps=4, warmup=1)
            made[variant] = export_dir
        return made[variant]

    return make


def _copy(src: Path, dst: Path) -> Path:
    return shutil.copytree(src, dst)


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_identical_exports_have_no_regression_and_zero_deltas(measured, tmp_path):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "again")
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert not diff.regression and diff.regressions == [] and diff.comparable
    assert diff.op_census == {} and diff.node_count["delta"] == 0 and diff.node_count["pct"] == 0
    assert all(not changes for side in diff.io.values() for changes in side.values())
    assert all(c["delta"] == 0 for c in diff.sizes["files"].values()) and diff.sizes["weight_bytes"]["delta"] == 0
    assert [r["ctx"] for r in diff.decode["contexts"]] == [16, 32]
    assert all(r["pct"] == 0 and not r["flagged"] for r in diff.decode["contexts"])
    assert diff.parity["old"] == diff.parity["new"] and diff.parity["new"]["status"] == "passed"
    assert diff.parity["new"]["mismatches"] == 0 and diff.parity["new"]["steps"] == 24
    assert diff.kernels == {"compared": False, "changes": []}
    md = diff.to_markdown()
    assert md.startswith("# Export diff: no regression\n")
    assert "Op census unchanged." in md and "Graph inputs and outputs unchanged." in md
    json.dumps(diff.to_dict())  # JSON-safe


def test_an_hf_layout_predecessor_diffs_file_for_file_with_a_farm_export_of_its_build(measured, checkpoint, tmp_path):
    """A re-export of an hf-layout export is diffed (at the worker's diff stage) while still in the farm
    layout, against its predecessor's published hf manifest: the graph and weights are compared as
    the same files, not as one removed and one added."""
    from exporter.packaging.hf_layout import write_hf_layout

    old = measured("attn_dynamic")
    laid_out = tmp_path / "hf"
    write_hf_layout(old, laid_out, checkpoint("llama"))
    diff = diff_exports(ExportArtifacts.from_dir(laid_out), ExportArtifacts.from_dir(old))
    assert diff.sizes["files"]["model.onnx.data"]["delta"] == 0 and diff.sizes["files"]["model.onnx"]["delta"] is not None
    assert not any(name.startswith("onnx/") for name in diff.sizes["files"])
    assert diff.sizes["model_files"]["delta"] != diff.sizes["model_files"]["new"]  # both sides counted


def test_parity_gate_newly_failing_and_new_mismatches_are_regressions(measured, tmp_path):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "broken")

    def fail(report):
        report["status"] = "failed"
        report["failed_gates"] = ["parity"]
        report["parity"]["mismatches"] = [3, 7]
        for gate in report["gates"]:
            if gate["check"].startswith("greedy decode"):
                gate["passed"] = False

    _edit(new / "parity_report.json", fail)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert diff.regression
    assert "parity gate newly failing: parity" in diff.regressions
    assert "new token mismatches: 0 -> 2" in diff.regressions
    md = diff.to_markdown()
    assert md.startswith("# Export diff: REGRESSION\n") and "- parity gate newly failing: parity" in md
    assert "| token mismatches | 0 | **2** |" in md and "| tokens equal | 24/24 | 22/24 |" in md
    # the other way round nothing got worse
    assert not diff_exports(ExportArtifacts.from_dir(new), ExportArtifacts.from_dir(old)).regression
    # switched off in settings
    off = Thresholds(parity_gate_newly_failing=False, new_token_mismatch=False)
    assert not diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new), off).regression


def test_latency_increase_at_one_context_is_a_regression_naming_it(measured, tmp_path):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "slow")

    def slower(bench):
        for row in bench["decode"]:
            if row["ctx"] == 32:
                row["decode_ms_median"] *= 1.2

    _edit(new / "benchmark.json", slower)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert len(diff.regressions) == 1 and diff.regressions[0].startswith("decode at ctx 32 +20.0% (")
    assert [r["ctx"] for r in diff.decode["contexts"] if r["flagged"]] == [32]
    assert "| 32 |" in diff.to_markdown() and "(+20.0%)**" in diff.to_markdown()
    assert not diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new), Thresholds(latency_pct=25)).regression


def test_node_count_increase_is_a_regression(measured, tmp_path):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "bigger")
    nodes = json.loads((old / "manifest.json").read_text())["node_count"]
    extra = math.ceil(nodes * 0.15)

    def grow(manifest):
        manifest["op_census"]["Identity"] = extra
        manifest["node_count"] += extra

    _edit(new / "manifest.json", grow)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    pct = extra / nodes * 100
    assert diff.regressions == [f"node count +{pct:.1f}% ({nodes} -> {nodes + extra})"]
    assert diff.op_census == {"Identity": {"old": 0, "new": extra, "delta": extra}}
    assert f"| Identity | 0 | {extra} | +{extra} |" in diff.to_markdown()


def test_io_change_within_a_variant_is_a_regression(measured, tmp_path):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "io")

    def retype(manifest):
        manifest["graph"]["inputs"][-1]["dtype"] = "INT32"

    _edit(new / "manifest.json", retype)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert diff.regressions == ["graph I/O changed within attn_static: ~input nonpad_kv_seqlen"]
    assert "| input changed | `nonpad_kv_seqlen` | INT64 [batch_size] | INT32 [batch_size] |" in diff.to_markdown()


def test_two_variants_of_one_checkpoint_give_a_readable_table(measured, tmp_path):
    old, new = measured("attn_dynamic"), _copy(measured("attn_static"), tmp_path / "static")

    def much_slower(bench):
        for row in bench["decode"]:
            row["decode_ms_median"] *= 10

    _edit(new / "benchmark.json", much_slower)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    # performance across variants is shown, not judged; correctness is the same on both
    assert not diff.comparable and not diff.regression
    assert diff.not_comparable == ["variant differs (attn_dynamic -> attn_static)"]
    assert all(r["pct"] > 50 and not r["flagged"] for r in diff.decode["contexts"])
    assert diff.op_census["TensorScatter"] == {"old": 0, "new": 4, "delta": 4}
    added = [v["name"] for v in diff.io["inputs"]["added"]]
    removed = [v["name"] for v in diff.io["inputs"]["removed"]]
    assert {"write_indices", "nonpad_kv_seqlen", "key_cache.0"} <= set(added)
    assert {"attention_mask", "past_key_values.0.key"} <= set(removed) and "input_ids" not in added + removed
    assert "updated_key_cache.0" in [v["name"] for v in diff.io["outputs"]["added"]]
    md = diff.to_markdown()
    assert md.startswith("# Export diff: no regression (different variant: correctness judged, performance shown only)")
    assert "| variant | attn_dynamic | **attn_static** |" in md
    assert "| TensorScatter | 0 | 4 | +4 |" in md
    assert "| input added | `write_indices` | – | INT64 [batch_size] |" in md
    assert "| input removed | `attention_mask` | INT64 [batch_size, total_sequence_length] | – |" in md
    assert "| status | passed | passed |" in md and "| token mismatches | 0 | 0 |" in md
    assert "| ctx | old | new | delta | p90 old | p90 new |" in md and "Shown, not judged" in md
    assert "genai_config.json | 1.5 KiB | – | removed |" in md


def test_kernel_choice_changes_are_reported(measured, tmp_path):
    old = _copy(measured("attn_static"), tmp_path / "a")
    new = _copy(old, tmp_path / "b")
    _edit(old / "benchmark.json", lambda b: b.update(kernels={"prefill": {"Attention": "flash"}, "decode": {"Attention": "flash"}}))
    # a kernel_log.probe() result is accepted as well
    _edit(new / "benchmark.json", lambda b: b.update(kernels={"kernels": {"prefill": {"Attention": "flash"},
                                                                          "decode": {"Attention": "unfused"}},
                                                              "returncode": 0, "lines": []}))
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert diff.kernels == {"compared": True, "changes": [{"phase": "decode", "op": "Attention", "old": "flash", "new": "unfused"}]}
    assert not diff.regression and "| decode | Attention | flash | unfused |" in diff.to_markdown()


def test_artifacts_from_bytes_and_unvalidated_exports(measured, exported, tmp_path):
    validated = measured("attn_static")
    raw = exported("llama", "attn_static")  # no parity report, no benchmark
    files = {name: (validated / name).read_bytes() for name in ("manifest.json", "parity_report.json", "benchmark.json")}
    from_bytes = ExportArtifacts.from_files(files, label="s3://bucket/x")
    assert from_bytes.label == "s3://bucket/x" and from_bytes.benchmark == ExportArtifacts.from_dir(validated).benchmark
    diff = diff_exports(ExportArtifacts.from_dir(raw), from_bytes)
    assert not diff.regression and diff.parity["old"] is None and diff.decode["contexts"] == []
    assert any("no benchmark for the old export" in note for note in diff.notes)
    md = diff.to_markdown()
    assert "| status | not validated | passed |" in md and "No context measured by both exports." in md
    paths = write_diff(diff, tmp_path / "out")
    assert [p.name for p in paths] == [DIFF_JSON, DIFF_MD]
    data = json.loads(paths[0].read_text())
    assert data["regression"] is False and data["summary"] == "no regression" and data["thresholds"]["latency_pct"] == 10.0
    assert paths[1].read_text() == md


def test_cli_prints_the_table_writes_files_and_exits_by_regression(measured, tmp_path, capsys):
    old = measured("attn_static")
    new = _copy(old, tmp_path / "slow")
    assert main(["diff", str(old), str(new), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Export diff: no regression") and "| nodes |" in out and "| 16 |" in out
    assert (tmp_path / "report" / DIFF_JSON).is_file() and (tmp_path / "report" / DIFF_MD).read_text() == out

    _edit(new / "benchmark.json", lambda b: [row.update(decode_ms_median=row["decode_ms_median"] * 1.5) for row in b["decode"]])
    assert main(["diff", str(old), str(new)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main(["diff", str(old), str(new), "--latency-pct", "60"]) == 0


def test_cli_refuses_a_directory_that_is_not_an_export(measured, tmp_path, capsys):
    assert main(["diff", str(measured("attn_static")), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} has no manifest.json: pass an export directory" in err
    assert main(["diff", str(tmp_path / "missing"), str(tmp_path)]) == 2
    assert "does not exist: pass an export directory" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text("{not json")
    assert main(["diff", str(tmp_path), str(tmp_path)]) == 2
    assert "manifest.json is not valid JSON" in capsys.readouterr().err


def test_a_language_model_alone_against_an_image_text_package_is_shown_not_judged(measured, tmp_path):
    """A bf16 Qwen3.5 export made before stop 57 was its language model alone (manifest language_model_only); its
    re-export is the image-text package: other graphs, so node count and I/O changes are shown, not regressions."""
    old = _copy(measured("attn_static"), tmp_path / "alone")
    new = _copy(old, tmp_path / "image-text")
    _edit(old / "manifest.json", lambda m: m.update(language_model_only="the language model alone (text prompts)"))
    nodes = json.loads((old / "manifest.json").read_text())["node_count"]

    def image_text(manifest):
        manifest["task"] = "image-text-to-text"
        manifest["op_census"]["Identity"] = nodes
        manifest["node_count"] += nodes

    _edit(new / "manifest.json", image_text)
    diff = diff_exports(ExportArtifacts.from_dir(old), ExportArtifacts.from_dir(new))
    assert not diff.comparable and diff.regressions == [] and not diff.node_count["flagged"]
    assert diff.not_comparable == ["task differs (its language model alone -> image-text-to-text)"]
    plain = _copy(measured("attn_static"), tmp_path / "plain")  # a text export's manifest has no task: text generation
    diff = diff_exports(ExportArtifacts.from_dir(plain), ExportArtifacts.from_dir(new))
    assert diff.not_comparable == ["task differs (text generation -> image-text-to-text)"]


def test_steps_a_router_near_tie_explains_are_not_counted_as_matching_tokens():
    """A step whose token differs but that validation's routing replay explains (routing_tie_mismatches) is neither a
    mismatch nor a matching token; a report from before the replay (no such key) counts as it did."""
    from exporter.reports.diff import parity_figures

    parity = {"steps": 24, "mismatches": [], "tie_mismatches": [3], "near_ties": [3, 9], "prefill_max_abs_error": 0.1,
              "logit_range": 14.0}
    before = parity_figures(ExportArtifacts({}, {"status": "passed", "failed_gates": [], "parity": parity}))
    assert before["token_matches"] == 23 and before["mismatches"] == 0
    explained = {**parity, "routing_tie_mismatches": [16], "routing_ties": [{"step": 16}, {"step": 0}]}
    after = parity_figures(ExportArtifacts({}, {"status": "passed", "failed_gates": [], "parity": explained}))
    assert after["token_matches"] == 22 and after["mismatches"] == 0
