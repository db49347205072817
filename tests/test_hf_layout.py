"""The hf layout (exporter/packaging/hf_layout.py) run by its real consumers: exports of every dense
architecture, laid out as a Hugging Face model repository, generate transformers' greedy tokens in
transformers.js 4 under Node (onnxruntime-node) and in optimum's ORTModelForCausalLM (its own virtual
environment: it pins transformers < 4.58), for batch 1 and a left-padded batch of two rows. Each client
runs once per model (Node) or once for all of them (optimum: importing it costs more than generating)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from exporter.errors import ExportError
from exporter.packaging.hf_layout import write_hf_layout
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.packaging.hf_layout import LATENT_TYPES, OPTIMUM_CONSUMER, TRANSFORMERSJS_CONSUMER, TRANSFORMERSJS_REFUSES
from exporter.tiny_checkpoint import ARCH_CONFIGS, HYBRID_ARCHITECTURES, MOE_ARCHITECTURES, NEW_ARCHITECTURES
from quantized_reference import dequantized_checkpoint

CLIENTS = Path(__file__).resolve().parents[1] / "clients"
CLIENT = CLIENTS / "transformersjs"
DENSE = [a for a in ARCH_CONFIGS if a not in MOE_ARCHITECTURES]
# optimum's ORTModelForCausalLM feeds KV caches only, never a hybrid's recurrent states ("Input past_conv.0
# is required by model but not provided"): hybrids are transformers.js's alone. The families the hf layout
# refuses (TRANSFORMERSJS_REFUSES) are checked for that below.
# deepseek_v3 runs in transformers.js but not optimum (its latent cache), from an export with layout hf (its routing in
# standard ops): its own test below.
TRANSFORMERSJS = [a for a in DENSE if a not in HYBRID_ARCHITECTURES and a not in TRANSFORMERSJS_REFUSES
                  and a not in LATENT_TYPES]
# optimum pins transformers 4.57, which has no ministral3 ("does not recognize this architecture").
OPTIMUM = [a for a in TRANSFORMERSJS if a != "ministral3"]
REFUSED_NEW = [a for a in NEW_ARCHITECTURES if a in TRANSFORMERSJS_REFUSES]
NEW_TOKENS = 12
FP16 = ["llama", "qwen3", "gemma2"]


@pytest.fixture(scope="session")
def transformersjs() -> Path:
    """clients/transformersjs with its pinned @huggingface/transformers installed (npm ci, once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "the transformers.js tests need Node.js and npm on PATH (.ci/run installs them)"
    lock = (CLIENT / "package-lock.json").read_text()
    marker = CLIENT / "node_modules" / ".installed-lock"
    if not marker.is_file() or marker.read_text() != lock:
        # onnxruntime-node's install script fetches CUDA binaries from nuget; the CPU ones ship in the package.
        env = dict(os.environ, ONNXRUNTIME_NODE_INSTALL="skip")
        run_or_say([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, env=env)
        marker.write_text(lock)
    return CLIENT / "generate.mjs"


def run_or_say(command: list[str], **kwargs) -> None:
    """Run an install step; on failure, fail with the tool's own last words."""
    proc = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"


@pytest.fixture(scope="session")
def optimum() -> tuple[Path, Path]:
    """(python, generate.py) of clients/optimum's environment, built once from its requirements.txt."""
    env_dir = CLIENTS / "optimum" / ".venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / ".installed"
    requirements = CLIENTS / "optimum" / "requirements.txt"
    if not marker.is_file() or marker.read_text() != requirements.read_text():
        run_or_say([sys.executable, "-m", "venv", "--clear", str(env_dir)])
        # torch alone first: on this project's machines pip then takes the local CPU build of that
        # release (as `make install` does), not PyPI's CUDA one.
        torch_pin = next(line for line in requirements.read_text().splitlines() if line.startswith("torch=="))
        for args in ([torch_pin], ["-r", str(requirements)]):
            run_or_say([str(python), "-m", "pip", "install", "-q", *args])
        marker.write_text(requirements.read_text())
    return python, CLIENTS / "optimum" / "generate.py"


@pytest.fixture(scope="session")
def laid_out(exported, checkpoint, workdir):
    """laid_out(arch, dtype) -> the attn_dynamic export of ``arch`` in the hf layout (made once): fp32 laid
    out from the farm export, fp16 exported straight into the layout (``layout="hf"``)."""

    @functools.cache
    def make(arch: str, dtype: str = "fp32") -> Path:
        out = workdir / "hf-layout" / f"{arch}-{dtype}"
        if dtype == "fp32" and arch not in HYBRID_ARCHITECTURES:  # a hybrid's hf layout is built for it (LinearAttention)
            write_hf_layout(exported(arch, "attn_dynamic"), out, checkpoint(arch))
            return out
        request = ExportRequest(model=str(checkpoint(arch)), dtype=dtype, ep="cpu", variant="attn_dynamic",
                                max_seq_len=64, layout="hf")
        return export_model(request, out, validate=False).out_dir

    return lambda arch, dtype="fp32": make(arch, dtype)  # one cache entry however it is called


@pytest.fixture(scope="session")
def optimum_tokens(optimum, laid_out) -> dict[tuple[str, str], list[list[int]]]:
    """{(arch, dtype, rows): sequences} from one optimum process over every repository its tests check:
    the left-padded batch of two for each, and batch 1 for the fp32 ones."""
    python, script = optimum
    wanted = [(arch, "fp32", rows) for arch in OPTIMUM for rows in (2, 1)] + [(arch, "fp16", 2) for arch in FP16]
    args = []
    for arch, dtype, rows in wanted:
        layout = laid_out(arch, dtype)
        args += [str(layout), str(write_request(layout, *(prompts(arch) if rows == 2 else batch_of_one(arch))))]
    proc = subprocess.run([str(python), str(script), *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["repo"] for line in lines] == args[::2], proc.stdout[-2000:]
    return {key: line["sequences"] for key, line in zip(wanted, lines)}


def prompts(arch: str) -> tuple[list[list[int]], list[list[int]]]:
    """Two rows, the first left-padded by 3 (as transformers' tokenizer pads a batch for generation)."""
    rng = np.random.default_rng(len(arch))
    long = [int(t) for t in rng.integers(3, 250, size=9)]
    short = [int(t) for t in rng.integers(3, 250, size=6)]
    return [[0, 0, 0, *short], long], [[0, 0, 0, *[1] * 6], [1] * 9]


def write_request(layout: Path, ids, mask) -> Path:
    request = layout.parent / f"{layout.name}-request-{len(ids)}.json"
    request.write_text(json.dumps({"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW_TOKENS}))
    return request


def client_generate(command: list[str], layout: Path, ids, mask) -> list[list[int]]:
    """Run a client script on ``layout``: the request as a JSON file, the sequences from its last line."""
    proc = subprocess.run([*command, str(write_request(layout, ids, mask))], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["sequences"]


def js_generate(script: Path, layout: Path, dtype: str, ids, mask) -> list[list[int]]:
    return client_generate(["node", str(script), str(layout), dtype], layout, ids, mask)


def js_generate_batches(script: Path, layout: Path, dtype: str, batches) -> list[list[list[int]]]:
    """One Node process, one loaded model, a generate call per (ids, mask) batch."""
    requests = [str(write_request(layout, ids, mask)) for ids, mask in batches]
    proc = subprocess.run(["node", str(script), str(layout), dtype, *requests], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line)["sequences"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(batches), proc.stdout[-2000:]
    return lines


def batch_of_one(arch: str) -> tuple[list[list[int]], list[list[int]]]:
    """The batch's unpadded row alone: batch 1, the shape a single-prompt user sends."""
    ids, mask = prompts(arch)
    return ids[1:], mask[1:]


@functools.cache
def hf_generate(checkpoint: Path, ids: str, mask: str) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(input_ids=torch.tensor(json.loads(ids)), attention_mask=torch.tensor(json.loads(mask)),
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out.tolist()


def check_rows(got, want, ids, client: str = "transformers.js"):
    assert len(got) == len(want) == len(ids), f"{client} gave {len(got)} rows for {len(ids)}"
    for row, (g, w) in enumerate(zip(got, want)):
        assert g[len(ids[row]):] == w[len(ids[row]):], f"row {row}: {client} {g} vs transformers {w}"


@pytest.mark.parametrize("arch", TRANSFORMERSJS)
def test_an_attn_dynamic_export_in_the_hf_layout_generates_transformers_tokens_in_transformersjs(
        arch, exported, checkpoint, laid_out, transformersjs):
    export_dir = exported(arch, "attn_dynamic")
    layout = laid_out(arch)
    manifest = json.loads((layout / "manifest.json").read_text())
    assert manifest["layout"]["model_file"] == "onnx/model.onnx"
    # A copy, not a hard link: onnx's checker refuses external data with several links (the source
    # export's structure gate would fail afterwards).
    copied = layout / "onnx" / "model.onnx_data"
    assert copied.read_bytes() == (export_dir / "model.onnx.data").read_bytes()
    assert copied.stat().st_nlink == (export_dir / "model.onnx.data").stat().st_nlink == 1
    config = json.loads((layout / "config.json").read_text())
    assert config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1}
    batches = [prompts(arch), batch_of_one(arch)]
    for (ids, mask), got in zip(batches, js_generate_batches(transformersjs, layout, "fp32", batches)):
        check_rows(got, hf_generate(checkpoint(arch), json.dumps(ids), json.dumps(mask)), ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_int4_export_runs_in_both_clients_with_its_dequantized_weights_tokens(
        arch, checkpoint, transformersjs, optimum, tmp_path):
    source = checkpoint(arch)
    request = ExportRequest(model=str(source), dtype="int4", ep="cpu", variant="attn_dynamic", max_seq_len=64,
                            quant={"accuracy_level": 0})  # fp32 activations: exact to the dequantized weights
    export_dir = export_model(request, tmp_path / "export", validate=False).out_dir
    layout = tmp_path / "repo"
    manifest = write_hf_layout(export_dir, layout, source)
    assert manifest["layout"]["model_file"] == "onnx/model_q4.onnx"
    assert json.loads((layout / "config.json").read_text())["transformers.js_config"]["dtype"] == "q4"
    reference, _ = dequantized_checkpoint(source, export_dir, tmp_path / "dequantized")
    ids, mask = prompts(arch)
    want = hf_generate(reference, json.dumps(ids), json.dumps(mask))
    check_rows(js_generate(transformersjs, layout, "q4", ids, mask), want, ids)
    python, script = optimum
    check_rows(client_generate([str(python), str(script), str(layout)], layout, ids, mask), want, ids, "optimum")


def test_the_hf_layout_refuses_what_its_consumers_cannot_run(exported, checkpoint, tmp_path):
    # Every manifest says how a batch is padded; the gqa one is why the layout refuses it.
    gqa_manifest = json.loads((exported("llama", "gqa") / "manifest.json").read_text())
    assert gqa_manifest["padding"]["batch"] == "right padding only"
    with pytest.raises(ExportError, match="expects right padding.*left-pad"):
        write_hf_layout(exported("llama", "gqa"), tmp_path / "a", checkpoint("llama"))
    with pytest.raises(ExportError, match="neither transformers.js nor optimum drives attn_static"):
        write_hf_layout(exported("llama", "attn_static"), tmp_path / "b", checkpoint("llama"))
    with pytest.raises(ExportError, match="no config.json"):
        write_hf_layout(exported("llama", "attn_dynamic"), tmp_path / "c", tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(ExportError, match="not an empty directory"):
        write_hf_layout(exported("llama", "attn_dynamic"), tmp_path / "d", checkpoint("llama"))
    with pytest.raises(ExportError, match="not a farm export"):
        write_hf_layout(tmp_path / "d", tmp_path / "e", checkpoint("llama"))


def test_the_hf_layout_publishes_no_checkpoint_file_that_leads_outside_it_or_is_not_a_regular_file(
        exported, checkpoint, tmp_path):
    """Every file the layout takes from the checkpoint passes the checkpoint's guard: a
    generation_config.json linked to /proc/self/environ would publish the worker's environment to
    anyone who may read the export. Such a file is refused by name, and nothing is laid out; a link
    inside the checkpoint is carried as the file it leads to."""
    source = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"S3_SECRET_KEY": "hunter2"}))
    os.mkfifo(source / "pipe")
    cases = [  # (file, made how, why refused)
        ("generation_config.json", lambda p: p.symlink_to("/proc/self/environ"), "leads outside the checkpoint"),
        ("config.json", lambda p: p.symlink_to(outside), "leads outside the checkpoint"),
        ("chat_template.jinja", lambda p: p.symlink_to(outside), "leads outside the checkpoint"),
        ("o200k_base.tiktoken", lambda p: p.symlink_to(outside), "leads outside the checkpoint"),
        ("merges.txt", lambda p: p.symlink_to(source / "pipe"), "is not a regular file"),
        ("tokenizer.model", os.mkfifo, "is not a regular file"),
    ]
    for name, make, why in cases:
        kept = source / f"{name}.kept"
        if (source / name).exists():
            (source / name).rename(kept)
        make(source / name)
        with pytest.raises(ExportError, match=f"{name} in ckpt {why}"):
            write_hf_layout(exported("llama", "attn_dynamic"), tmp_path / "out", source)
        assert not (tmp_path / "out").exists(), name
        (source / name).unlink()
        if kept.exists():
            kept.rename(source / name)
    (source / "generation_config.json").rename(source / "defaults.json")
    (source / "generation_config.json").symlink_to("defaults.json")
    manifest = write_hf_layout(exported("llama", "attn_dynamic"), tmp_path / "out", source)
    assert "generation_config.json" in manifest["files"]
    assert (tmp_path / "out" / "generation_config.json").read_text() == (source / "defaults.json").read_text()


def test_the_cli_exports_validates_and_lays_out_in_one_command(checkpoint, transformersjs, tmp_path, capsys):
    from exporter.cli import main

    source = checkpoint("qwen2")
    out = tmp_path / "repo"
    # No --variant: the hf layout's default is attn_dynamic; the gates run on the farm layout first.
    assert main(["export", "--model", str(source), "--out", str(out), "--max-seq-len", "64", "--layout", "hf"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "ready" and manifest["variant"] == "attn_dynamic"
    assert manifest["layout"]["kind"] == "hf" and not (out / "model.onnx").exists()
    assert manifest["padding"]["batch"] == "left or right padding"
    assert {"parity_report.json", "config.json", "onnx/model.onnx", "onnx/model.onnx_data"} <= set(manifest["files"])
    ids, mask = prompts("qwen2")
    check_rows(js_generate(transformersjs, out, "fp32", ids, mask),
               hf_generate(source, json.dumps(ids), json.dumps(mask)), ids)

    # A request the layout cannot hold is refused before any work, with the reason and what to do.
    assert main(["export", "--model", str(source), "--out", str(tmp_path / "gqa"), "--variant", "gqa",
                 "--layout", "hf"]) == 2
    assert "expects right padding" in capsys.readouterr().err and not (tmp_path / "gqa").exists()
    assert main(["export", "--model", str(source), "--out", str(tmp_path / "bf16"), "--dtype", "bf16",
                 "--layout", "hf"]) == 2
    assert "no file name for bf16" in capsys.readouterr().err

    # An existing farm export is laid out by `exportfarm layout hf` (checkpoint from its manifest).
    farm = tmp_path / "farm"
    assert main(["export", "--model", str(source), "--out", str(farm), "--variant", "attn_dynamic",
                 "--no-validate"]) == 0
    assert main(["layout", "hf", str(farm), "--out", str(tmp_path / "repo2")]) == 0
    assert (tmp_path / "repo2" / "onnx" / "model.onnx_data").is_file()
    assert main(["layout", "hf", str(tmp_path / "repo2"), "--out", str(tmp_path / "repo3")]) == 2
    assert "already in the hf layout" in capsys.readouterr().err


@pytest.mark.parametrize("arch", OPTIMUM)
def test_an_attn_dynamic_export_in_the_hf_layout_generates_transformers_tokens_in_optimum(
        arch, checkpoint, optimum_tokens):
    for rows, (ids, mask) in ((2, prompts(arch)), (1, batch_of_one(arch))):
        check_rows(optimum_tokens[arch, "fp32", rows], hf_generate(checkpoint(arch), json.dumps(ids), json.dumps(mask)),
                   ids, "optimum")


@pytest.mark.parametrize("arch", FP16)
def test_an_fp16_export_in_the_hf_layout_generates_transformers_fp32_tokens_in_both_clients(
        arch, checkpoint, laid_out, transformersjs, optimum_tokens):
    """fp16 weights and activations on the CPU EP; on these tiny models no step is near enough a tie
    for fp16 rounding to flip it, so the tokens are fp32 transformers' exactly."""
    layout = laid_out(arch, "fp16")
    assert (layout / "onnx" / "model_fp16.onnx").is_file()
    ids, mask = prompts(arch)
    want = hf_generate(checkpoint(arch), json.dumps(ids), json.dumps(mask))
    check_rows(js_generate(transformersjs, layout, "fp16", ids, mask), want, ids)
    check_rows(optimum_tokens[arch, "fp16", 2], want, ids, "optimum")


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2"])
def test_a_hybrid_in_the_hf_layout_generates_transformers_tokens_in_transformersjs(arch, checkpoint, laid_out,
                                                                                   transformersjs):
    """transformers.js 4.3 feeds past_conv.i / past_recurrent.i (zeros from the model's input metadata) and
    carries present_* back; the recurrence runs on LinearAttention (its onnxruntime-node 1.30 has no
    GatedDeltaNet kernel); a left-padded batch of two and a batch of one, against transformers' generate."""
    layout = laid_out(arch)
    graph = onnx.load(str(layout / "onnx" / "model.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "GatedDeltaNet" not in ops and "CausalConvWithState" in ops
    batches = [prompts(arch), batch_of_one(arch)]
    for (ids, mask), got in zip(batches, js_generate_batches(transformersjs, layout, "fp32", batches)):
        check_rows(got, hf_generate(checkpoint(arch), json.dumps(ids), json.dumps(mask)), ids)


@pytest.mark.parametrize("arch, message", [
    ("qwen3_5_text", "no hf layout for a qwen3_5_text.*M-RoPE.*onnxruntime-genai runs it"),
    # the image-text checkpoint is exported as transformers.js's image-text classes load it
    # (tests/test_hf_layout_vlm_qwen.py), which needs its processor
    ("qwen3_5", "has no processor_config.json or preprocessor_config.json.*AutoProcessor"),
])
def test_qwen3_5_is_refused_for_the_hf_layout_saying_why(arch, message, checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint(arch)), ep="cpu", variant="attn_dynamic", layout="hf")
    with pytest.raises(ExportError, match=message):
        export_model(request, tmp_path / "repo", validate=False)
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("arch", REFUSED_NEW)
def test_the_new_families_transformersjs_cannot_run_are_refused_for_the_hf_layout_saying_why(arch, checkpoint, tmp_path):
    """transformers.js 4.3 has no model class for glm4_moe, seed_oss, exaone4, ernie4_5_moe, deepseek_v2,
    glm4_moe_lite (measured: "Unsupported model type")."""
    request = ExportRequest(model=str(checkpoint(arch)), ep="cpu", variant="attn_dynamic", layout="hf")
    with pytest.raises(ExportError, match=f"no hf layout for a {arch} model: .*onnxruntime-genai runs it"):
        export_model(request, tmp_path / "repo", validate=False)
    assert not (tmp_path / "repo").exists()


def test_deepseek_v3s_latent_cache_runs_in_transformersjs_and_optimum_is_not_offered(checkpoint, exported,
                                                                                        transformersjs, tmp_path):
    """The hand-built deepseek_v3 caches the latent as one KV head of kv_lora_rank + qk_rope_head_dim: transformers.js
    4.3 sizes each empty past from the graph's declared dims and generates transformers' tokens (a left-padded batch
    and batch 1); optimum sizes them per head from config.json, so the layout names transformers.js alone, saying why.
    Its routing runs in standard ops there (onnxruntime-node 1.30 has no MoEGroupRouter): a farm export routed on
    MoEGroupRouter is refused for the layout, saying to export with layout hf."""
    with pytest.raises(ExportError, match="MoEGroupRouter.*onnxruntime-node 1.30.*export it with layout hf"):
        write_hf_layout(exported("deepseek_v3", "attn_dynamic"), tmp_path / "refused", checkpoint("deepseek_v3"))
    assert not (tmp_path / "refused").exists()
    layout = export_model(ExportRequest(model=str(checkpoint("deepseek_v3")), ep="cpu", variant="attn_dynamic",
                                        max_seq_len=64, layout="hf"), tmp_path / "hf", validate=False).out_dir
    entry = json.loads((layout / "manifest.json").read_text())["layout"]
    assert entry["consumers"] == [TRANSFORMERSJS_CONSUMER]
    assert "latent as one KV head" in entry["not_for"][OPTIMUM_CONSUMER]
    batches = [prompts("deepseek_v3"), batch_of_one("deepseek_v3")]
    for (ids, mask), got in zip(batches, js_generate_batches(transformersjs, layout, "fp32", batches)):
        check_rows(got, hf_generate(checkpoint("deepseek_v3"), json.dumps(ids), json.dumps(mask)), ids)


@pytest.mark.parametrize("arch", ["granitemoehybrid", "nemotron_h", "falcon_h1"])
def test_a_mamba2_hybrid_is_refused_for_the_hf_layout_saying_why(arch, checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint(arch)), ep="cpu", variant="attn_dynamic", layout="hf")
    with pytest.raises(ExportError, match=f"no hf layout for a {arch} model: .*legacy layer types.*onnxruntime-genai runs it"):
        export_model(request, tmp_path / "repo", validate=False)
    assert not (tmp_path / "repo").exists()


def test_a_farm_export_on_gateddeltanet_is_refused_for_the_hf_layout_saying_how(exported, checkpoint, tmp_path):
    with pytest.raises(ExportError, match="GatedDeltaNet.*export it with layout hf"):
        write_hf_layout(exported("qwen3_5_text", "attn_dynamic"), tmp_path / "repo", checkpoint("qwen3_5_text"))


def test_a_worker_links_the_weights_instead_of_copying_them(exported, checkpoint, tmp_path):
    """weights="link" (a worker publishing the laid-out folder, which nothing checks with onnx's checker):
    the same inode, no second copy on disk; an unknown mode is refused."""
    source = shutil.copytree(exported("qwen2", "attn_dynamic"), tmp_path / "export")
    manifest = write_hf_layout(source, tmp_path / "repo", checkpoint("qwen2"), weights="link")
    linked = tmp_path / "repo" / manifest["layout"]["data_file"]
    assert linked.stat().st_ino == (source / "model.onnx.data").stat().st_ino and linked.stat().st_nlink == 2
    assert manifest["files"][manifest["layout"]["data_file"]] == manifest["layout"]["from_export"]["files"]["model.onnx.data"]
    with pytest.raises(ValueError, match="weights must be one of"):
        write_hf_layout(source, tmp_path / "repo2", checkpoint("qwen2"), weights="symlink")


def test_file_names_follow_transformersjs_dtypes_and_a_failed_layout_leaves_nothing(exported, checkpoint, tmp_path):
    from exporter.packaging.hf_layout import hf_file_names

    def manifest(dtype, logits):
        return {"request": {"dtype": dtype, "variant": "attn_dynamic"}, "variant": "attn_dynamic",
                "graph": {"outputs": [{"name": "logits", "dtype": logits}]}}

    assert hf_file_names(manifest("int4", "FLOAT16")) == ("onnx/model_q4f16.onnx", "onnx/model_q4f16.onnx_data", "q4f16")
    assert hf_file_names(manifest("int8", "FLOAT")) == ("onnx/model_int8.onnx", "onnx/model_int8.onnx_data", "int8")
    with pytest.raises(ExportError, match="no file name for int4 weights with bfloat16 activations"):
        hf_file_names(manifest("int4", "BFLOAT16"))
    # A farm export whose graph keeps its weights under another name: refused, and no folder is left.
    source = exported("llama", "attn_dynamic")
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    (broken / "model.onnx.data").rename(broken / "weights.bin")
    (broken / "model.onnx.data").symlink_to(broken / "weights.bin")
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    graph = onnx.load(str(broken / "model.onnx"), load_external_data=False)
    for tensor in _get_all_tensors(graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "weights.bin"
    onnx.save(graph, str(broken / "model.onnx"))
    with pytest.raises(ExportError, match="keeps weights in 'weights.bin'"):
        write_hf_layout(broken, tmp_path / "out", checkpoint("llama"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_the_worker_layout_stage_redoes_itself_over_what_a_killed_attempt_left(exported, checkpoint, tmp_path):
    """workers/job.py's layout stage as an attempt that resumes on the same worker runs it: over a
    half-written folder and an unrecorded finished one a killed attempt left, it lays the farm export
    out again, weights hard-linked, and never changes the farm folder; run twice, it ends the same."""
    from exporter.packaging.resolve import resolve_source
    from workers.job import Job, JobRecord, layout

    work = tmp_path / "work"
    farm = shutil.copytree(exported("qwen2", "attn_dynamic"), work / "export")
    before = {p.name: p.read_bytes() for p in farm.iterdir() if p.is_file()}
    manifest = json.loads((farm / "manifest.json").read_text())
    source = resolve_source(str(checkpoint("qwen2"))).to_dict()
    job = Job(settings=None, lease=None, keeper=None, store=None, work=work)
    (work / ".export-hf.hf-partial-0123abcd" / "onnx").mkdir(parents=True)  # killed while writing
    (work / "export-hf").mkdir()
    (work / "export-hf" / "stale").write_text("a finished layout whose stage was not recorded")
    for _ in range(2):  # the second run: killed after laying out, before the record was saved
        # the record as record.json holds it: saved after bench / diff, so with the farm manifest
        record = JobRecord("e1", {**manifest["request"], "layout": "hf"}, "r", None, {}, source=source,
                           manifest=json.loads(json.dumps(manifest)), done=["resolve", "build", "validate", "bench", "diff"])
        layout(job, record)
        assert job.publish_dir(record) == work / "export-hf"
        assert sorted(p.name for p in work.iterdir()) == ["export", "export-hf"]
        assert record.manifest["layout"]["kind"] == "hf" and not (work / "export-hf" / "stale").exists()
        data = work / "export-hf" / record.manifest["layout"]["data_file"]
        assert data.stat().st_ino == (farm / "model.onnx.data").stat().st_ino and data.stat().st_nlink == 2
        assert {p.name: p.read_bytes() for p in farm.iterdir() if p.is_file() and p.name != "manifest.json"} == \
            {n: b for n, b in before.items() if n != "manifest.json"}
