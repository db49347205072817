"""The compat target (exporter/graph/target.py): an attn_dynamic export for older onnxruntime, IR 10 and
default opset <= 21 with onnxruntime's contrib norm / rotary / attention, computes transformers' logits
for a left-padded batch with a past, and transformers.js 3.x (onnxruntime-node 1.21), which refuses the
default IR 11 / opset 24 export, generates transformers' greedy tokens from it. What the target cannot
express is refused by name."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from exporter import contract
from exporter.errors import ExportError
from exporter.graph.target import COMPAT, ORT_DEFAULT_DOMAIN_OPS, check_compat
from exporter.packaging.hf_layout import TRANSFORMERSJS_REFUSES, write_hf_layout
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.tiny_checkpoint import (ARCH_CONFIGS, HYBRID_ARCHITECTURES, MOE_ARCHITECTURES, NEW_ARCHITECTURES,
                                     NEW_MOE_ARCHITECTURES, make_tiny_checkpoint)
from exporter.validation.gates.parity import PREFILL_TOLERANCE
from quantized_reference import dequantized_checkpoint

DENSE = [a for a in ARCH_CONFIGS if a not in (*MOE_ARCHITECTURES, *HYBRID_ARCHITECTURES, *NEW_MOE_ARCHITECTURES)]
# transformers.js 3 has no model class for most 2025-26 families ("Unsupported model type"); ernie4_5 and
# ministral3 it has. Nor does the hf layout take what it refuses for transformers.js 4 (gemma4's per-layer caches).
TRANSFORMERSJS3 = [a for a in DENSE if (a not in NEW_ARCHITECTURES or a in ("ernie4_5", "ministral3"))
                   and a not in TRANSFORMERSJS_REFUSES]
CLIENT = Path(__file__).resolve().parents[1] / "clients" / "transformersjs3"
DECODE_TOKENS = [[17, 99, 140], [230, 4, 61]]  # fed one per step after the prompt, with the past
NEW_TOKENS = 8  # transformers.js greedy generation


@pytest.fixture(scope="module")
def compat_exported(workdir, checkpoint):
    """compat_exported(arch, dtype) -> a farm export with compat=True (exported once per arguments)."""

    @functools.cache
    def make(arch: str, dtype: str = "fp32") -> Path:
        quant = {"quant": {"accuracy_level": 0}} if dtype == "int4" else {}  # fp32 math: exact to its dequantized weights
        request = ExportRequest(model=str(checkpoint(arch)), dtype=dtype, ep="cpu", variant="attn_dynamic", compat=True,
                                **quant)
        return export_model(request, workdir / "compat" / f"{arch}-{dtype}", validate=False).out_dir

    return make


@pytest.fixture(scope="module")
def transformersjs3() -> Path:
    """clients/transformersjs3 with its pinned @huggingface/transformers 3.x installed (npm ci, once)."""
    npm = shutil.which("npm")
    assert npm and shutil.which("node"), "the transformers.js tests need Node.js and npm on PATH (.ci/run installs them)"
    lock = (CLIENT / "package-lock.json").read_text()
    marker = CLIENT / "node_modules" / ".installed-lock"
    if not marker.is_file() or marker.read_text() != lock:
        # onnxruntime-node 1.21's install script fetches CUDA binaries unless told to skip (its variable
        # is ONNXRUNTIME_NODE_INSTALL_CUDA); the CPU ones ship in the package.
        env = dict(os.environ, ONNXRUNTIME_NODE_INSTALL_CUDA="skip", ONNXRUNTIME_NODE_INSTALL="skip")
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"npm ci exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
        marker.write_text(lock)
    return CLIENT / "generate.mjs"


def left_padded(arch: str) -> tuple[np.ndarray, np.ndarray]:
    """Two prompt rows, the first left-padded by 3 (as transformers' tokenizer pads a batch for generation)."""
    rng = np.random.default_rng(len(arch))
    short, long = rng.integers(3, 250, size=6), rng.integers(3, 250, size=9)
    ids = np.array([[0, 0, 0, *short], long], np.int64)
    return ids, (np.arange(9)[None, :] >= np.array([[3], [0]])).astype(np.int64)


def export_logits(model_path: Path, ids: np.ndarray, mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The export's logits, as a client drives it: the prompt, then one token per step fed back with the
    caches it returned; [rows, prompt + steps, vocab]."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    past = {i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), contract.numpy_of_ort(i.type))
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    step_ids, step_positions, logits = ids, positions, []
    for step in range(tokens.shape[1] + 1):
        feeds = {contract.INPUT_IDS: step_ids, contract.ATTENTION_MASK: mask, contract.POSITION_IDS: step_positions}
        results = dict(zip(outputs, session.run(None, {**feeds, **past})))
        logits.append(results[contract.LOGITS].astype(np.float32))
        past = {contract.input_for_output(name): value for name, value in results.items() if name != contract.LOGITS}
        if step < tokens.shape[1]:
            step_ids = tokens[:, step:step + 1]
            mask = np.concatenate([mask, np.ones_like(step_ids)], axis=1)
            step_positions = step_positions[:, -1:] + 1
    return np.concatenate(logits, axis=1)


def reference_logits(checkpoint: Path, ids: np.ndarray, mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits of the whole sequence (prompt + the step tokens) in one forward, fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    full = np.concatenate([ids, tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    positions = np.clip(full_mask.cumsum(-1) - 1, 0, None)  # as generate() gives them: a padded row's from its first token
    with torch.no_grad():
        return model(input_ids=torch.tensor(full), attention_mask=torch.tensor(full_mask),
                     position_ids=torch.tensor(positions)).logits.numpy()


def check_against_reference(got: np.ndarray, want: np.ndarray, mask: np.ndarray, dtype: str) -> None:
    """Every real (not padding) position's logits within the parity gate's tolerance of the reference's range."""
    real = np.concatenate([mask, np.ones((mask.shape[0], got.shape[1] - mask.shape[1]), mask.dtype)], axis=1) == 1
    limit = PREFILL_TOLERANCE[dtype] * float(want[real].max() - want[real].min())
    worst = float(np.abs(got[real] - want[real]).max())
    assert worst <= limit, f"logits {worst:.3g} from transformers' (allowed {limit:.3g})"


def assert_loads_in_older_onnxruntime(model_path: Path) -> None:
    """IR 10, default opset <= 21, no default-domain op newer than the opset (onnxruntime's own by name)."""
    model = onnx.load(str(model_path), load_external_data=False)
    opsets = {o.domain or "": o.version for o in model.opset_import}
    assert model.ir_version == COMPAT.ir_version == 10
    assert opsets[""] == COMPAT.opset <= 21 and opsets["com.microsoft"] == 1
    default_ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    assert {op for op in default_ops - set(ORT_DEFAULT_DOMAIN_OPS) if not onnx.defs.has(op, opsets[""], "")} == set()
    assert default_ops.isdisjoint({"RMSNormalization", "RotaryEmbedding", "Attention", "TensorScatter"})


@pytest.mark.parametrize("arch", DENSE)
def test_a_compat_export_loads_in_older_onnxruntime_and_matches_transformers_with_padding_and_a_past(
        arch, compat_exported, checkpoint):
    export_dir = compat_exported(arch)
    assert_loads_in_older_onnxruntime(export_dir / contract.MODEL_FILE)
    ops = {(n.domain, n.op_type) for n in onnx.load(str(export_dir / contract.MODEL_FILE), load_external_data=False).graph.node}
    assert ("com.microsoft", "MultiHeadAttention") in ops or ("", "Softmax") in ops  # gemma2's soft-capped scores
    ids, mask = left_padded(arch)
    tokens = np.array(DECODE_TOKENS, np.int64)
    got = export_logits(export_dir / contract.MODEL_FILE, ids, mask, tokens)
    check_against_reference(got, reference_logits(checkpoint(arch), ids, mask, tokens), mask, "fp32")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: the MatMul / Softmax path, soft-capped in fp32
def test_an_fp16_compat_export_matches_transformers_fp32(arch, compat_exported, checkpoint):
    export_dir = compat_exported(arch, "fp16")
    assert_loads_in_older_onnxruntime(export_dir / contract.MODEL_FILE)
    ids, mask = left_padded(arch)
    tokens = np.array(DECODE_TOKENS, np.int64)
    got = export_logits(export_dir / contract.MODEL_FILE, ids, mask, tokens)
    check_against_reference(got, reference_logits(checkpoint(arch), ids, mask, tokens), mask, "fp16")


def test_an_int4_compat_export_keeps_matmulnbits_and_matches_its_dequantized_weights(compat_exported, checkpoint,
                                                                                     tmp_path):
    export_dir = compat_exported("qwen3", "int4")
    assert_loads_in_older_onnxruntime(export_dir / contract.MODEL_FILE)
    graph = onnx.load(str(export_dir / contract.MODEL_FILE), load_external_data=False).graph
    assert any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in graph.node)
    reference, _ = dequantized_checkpoint(checkpoint("qwen3"), export_dir, tmp_path / "dequantized")
    ids, mask = left_padded("qwen3")
    tokens = np.array(DECODE_TOKENS, np.int64)
    got = export_logits(export_dir / contract.MODEL_FILE, ids, mask, tokens)
    check_against_reference(got, reference_logits(reference, ids, mask, tokens), mask, "fp32")


def test_the_validation_gates_accept_a_compat_export_and_check_its_target(checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint("llama")), dtype="fp32", ep="cpu", variant="attn_dynamic", compat=True)
    report = export_model(request, tmp_path / "export").report
    assert report.passed, report.summary()
    checks = {g.check: g for g in report.gates}
    assert checks["compat: IR <= 10, default opset <= 21, no newer op"].measured == {"ir_version": 10, "opset": 20}
    assert checks["attention op census"].measured == {"com.microsoft::MultiHeadAttention or Softmax": 2}
    assert checks["attn_dynamic (compat) attention known answer on cpu (fp32)"].passed


@pytest.mark.parametrize("variant, dtype, extra, reason", [
    ("attn_static", "fp32", {"static_cache": True, "max_seq_len": 64}, "TensorScatter"),
    ("gqa", "fp16", {}, "GroupQueryAttention"),
    ("attn_dynamic", "bf16", {}, "no bf16"),
])
def test_compat_refuses_what_older_onnxruntime_cannot_run(variant, dtype, extra, reason, checkpoint, tmp_path):
    with pytest.raises(ExportError, match=reason):
        check_compat(variant, dtype, "cpu")
    request = ExportRequest(model=str(checkpoint("llama")), dtype=dtype, ep="cpu", variant=variant, compat=True, **extra)
    with pytest.raises(ExportError, match=f"{reason}.*use .*without"):
        export_model(request, tmp_path / "export", validate=False)
    assert not (tmp_path / "export").exists()


def test_compat_refuses_a_mixture_of_experts(checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint("mixtral")), dtype="fp32", ep="cpu", variant="attn_dynamic", compat=True)
    with pytest.raises(ExportError, match="mixtral is a mixture of experts.*export it without compat"):
        export_model(request, tmp_path / "export", validate=False)


def test_compat_refuses_a_hybrid_saying_why(checkpoint, tmp_path):
    request = ExportRequest(model=str(checkpoint("lfm2")), dtype="fp32", ep="cpu", variant="attn_dynamic", compat=True)
    with pytest.raises(ExportError, match="lfm2 has recurrent layers.*CausalConvWithState.*export it without compat"):
        export_model(request, tmp_path / "export", validate=False)


def js3_generate(script: Path, layout: Path, ids: np.ndarray, mask: np.ndarray,
                 dtype: str = "fp32") -> subprocess.CompletedProcess:
    request = layout.parent / f"{layout.name}-request.json"
    request.write_text(json.dumps({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                                   "max_new_tokens": NEW_TOKENS}))
    return subprocess.run(["node", str(script), str(layout), dtype, str(request)], capture_output=True, text=True,
                          timeout=300)


def check_js3_tokens(proc: subprocess.CompletedProcess, checkpoint: Path, ids: np.ndarray, mask: np.ndarray) -> None:
    """transformers.js 3's greedy tokens are transformers' for every row."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["sequences"]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    want = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    for row in range(len(ids)):
        assert got[row][ids.shape[1]:] == want[row][ids.shape[1]:], f"row {row}: transformers.js 3 {got[row]} vs {want[row]}"


@pytest.mark.parametrize("arch", TRANSFORMERSJS3)
def test_transformersjs3_generates_transformers_greedy_tokens_from_a_compat_export(
        arch, compat_exported, checkpoint, transformersjs3, tmp_path):
    layout = tmp_path / "repo"
    write_hf_layout(compat_exported(arch), layout, checkpoint(arch))
    ids, mask = left_padded(arch)
    check_js3_tokens(js3_generate(transformersjs3, layout, ids, mask), checkpoint(arch), ids, mask)


@pytest.mark.xfail(strict=True, reason="transformers.js 3 on a Node without Float16Array (20 here) keeps fp16 logits "
                   "as Uint16Array and its greedy pick reads those raw bits: wrong tokens from right logits (onnxruntime "
                   "1.21 on the same file gives transformers' logits, transformers.js 4 its tokens)")
def test_transformersjs3_runs_an_fp16_compat_export_to_transformers_fp32_tokens(compat_exported, checkpoint,
                                                                                transformersjs3, tmp_path):
    layout = tmp_path / "repo"
    assert write_hf_layout(compat_exported("llama", "fp16"), layout, checkpoint("llama"))["layout"]["model_file"] == \
        "onnx/model_fp16.onnx"
    # transformers.js 3 feeds the empty past as float32 unless config.json names the cache dtype per
    # transformers.js dtype (4 reads it from the session): the layout writes it.
    assert json.loads((layout / "config.json").read_text())["transformers.js_config"]["kv_cache_dtype"] == \
        {"fp16": "float16"}
    ids, mask = left_padded("llama")
    check_js3_tokens(js3_generate(transformersjs3, layout, ids, mask, "fp16"), checkpoint("llama"), ids, mask)


def test_transformersjs3_refuses_the_default_export_which_is_why_compat_exists(exported, checkpoint, transformersjs3,
                                                                             tmp_path):
    layout = tmp_path / "repo"
    write_hf_layout(exported("llama", "attn_dynamic"), layout, checkpoint("llama"))
    proc = js3_generate(transformersjs3, layout, *left_padded("llama"))
    assert proc.returncode != 0
    assert "Unsupported model IR version: 11, max supported IR version: 10" in proc.stderr


def test_partial_rotary_reaches_the_contrib_op_as_rotary_embedding_dim(transformersjs3, tmp_path):
    """Phi-4-mini style: 0.75 of head_dim 16 rotated (12 dims), in onnxruntime 1.32 and in 1.21 (transformers.js 3)."""
    source = make_tiny_checkpoint("phi3", tmp_path / "phi3-partial", hidden_size=64, partial_rotary_factor=0.75,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.75})
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic", compat=True)
    export_dir = export_model(request, tmp_path / "export", validate=False).out_dir
    graph = onnx.load(str(export_dir / contract.MODEL_FILE), load_external_data=False).graph
    rotary = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert rotary and all(n.domain == "com.microsoft" for n in rotary)
    assert {onnx.helper.get_attribute_value(a) for n in rotary for a in n.attribute if a.name == "rotary_embedding_dim"} == {12}
    ids, mask = left_padded("phi3")
    tokens = np.array(DECODE_TOKENS, np.int64)
    got = export_logits(export_dir / contract.MODEL_FILE, ids, mask, tokens)
    check_against_reference(got, reference_logits(source, ids, mask, tokens), mask, "fp32")
    layout = tmp_path / "repo"
    write_hf_layout(export_dir, layout, source)
    check_js3_tokens(js3_generate(transformersjs3, layout, ids, mask), source, ids, mask)


@pytest.mark.parametrize("options, words", [({"compat": True}, "older onnxruntime"), ({"layout": "hf"}, "transformers.js")])
def test_chosen_bf16_activations_are_refused_before_any_work_for_compat_and_the_hf_layout(options, words):
    request = ExportRequest(model="tiny", dtype="int4", ep="cuda", quant={"activations": "bf16"}, **options)
    with pytest.raises(ExportError, match=f"bf16 cannot be .*{words}.*set quant activations fp16"):
        request.resolved_variant()


def test_transformersjs3_runs_an_int4_compat_export_as_q4_to_its_dequantized_weights_tokens(
        compat_exported, checkpoint, transformersjs3, tmp_path):
    """What the README tells transformers.js 3 users to run besides fp32: q4 (MatMulNBits, fp32
    activations at accuracy level 0, so exact to the export's own dequantized weights)."""
    export_dir = compat_exported("qwen3", "int4")
    layout = tmp_path / "repo"
    assert write_hf_layout(export_dir, layout, checkpoint("qwen3"))["layout"]["model_file"] == "onnx/model_q4.onnx"
    reference, _ = dequantized_checkpoint(checkpoint("qwen3"), export_dir, tmp_path / "dequantized")
    ids, mask = left_padded("qwen3")
    check_js3_tokens(js3_generate(transformersjs3, layout, ids, mask, "q4"), reference, ids, mask)
