"""The decode benchmark harness on the CPU EP, the kernel-log parser on recorded ORT lines, and the
CUDA-only paths, which skip with their reason when this onnxruntime has no CUDA EP."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from exporter.bench import DecodeHarness, run_bench
from exporter.bench_report import markdown, write_report
from exporter.kernel_log import PHASE_MARK, parse_kernel_lines

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a CUDA device (CUDAExecutionProvider)")

# Lines ORT 1.31.1 printed on an H200 (benchmarks/results/h200/*.json, "kernels" -> "lines").
RECORDED = f"""{PHASE_MARK}prefill
2026-11-30 11:24:02.960787505 [V:onnxruntime:Default, attention.cc:1799 ComputeInternal] ONNX Attention: using Flash Attention (batch=1, q_seq=512, total_seq=516, past=no)
\x1b[36mOperator=Attention Node=node_Attention_12 DataType=fp16 SdpaKernel=FLASH_ATTENTION\x1b[0m
Operator=GroupQueryAttention Node=node_GroupQueryAttention_13 DataType=fp16 SdpaKernel=CUDNN_FLASH_ATTENTION EffectiveKvLengthBound=516
{PHASE_MARK}decode
2026-11-30 11:24:08.304908127 [V:onnxruntime:Default, attention.cc:1851 ComputeInternal] ONNX Attention: using Memory Efficient Attention (batch=1, q_seq=1, total_seq=513, past=yes, mask=yes)
Operator=GroupQueryAttention Node=/model/layers.0/attn/GroupQueryAttention DataType=fp16 SdpaKernel=XQA
{PHASE_MARK}done
"""


def test_kernel_log_parser_on_recorded_lines():
    kernels = parse_kernel_lines(RECORDED)
    assert kernels == {
        "prefill": {"Attention": "flash", "GroupQueryAttention": "cudnn_sdpa"},
        "decode": {"Attention": "memory_efficient", "GroupQueryAttention": "xqa"},
    }


def test_kernel_log_parser_names_the_unfused_path():
    text = f"{PHASE_MARK}decode\n[V:onnxruntime:Default] Attention: using unified unfused path (is_gqa=1, head_size=64, softcap=0)\n"
    assert parse_kernel_lines(text) == {"decode": {"Attention": "unfused"}}


def test_cpu_harness_writes_a_valid_report(exported, tmp_path):
    import shutil

    export_dir = shutil.copytree(exported("llama", "attn_static"), tmp_path / "export")  # the fixture stays pristine
    result = run_bench(export_dir, "cpu", contexts=[16, 64], steps=8, warmup=2, prefill_lengths=[32])
    data = json.loads((export_dir / "benchmark.json").read_text())
    assert data["variant"] == "attn_static" and data["settings"]["io_binding"] and data["settings"]["cache_mode"] == "static"
    assert [d["ctx"] for d in data["decode"]] == [16, 64]
    for row in data["decode"]:
        assert 0 < row["decode_ms_median"] <= row["decode_ms_p90"] and row["steps"] == 8
    assert float(data["prefill_tokens_per_s"]["32"]) > 0
    png, md = write_report(export_dir / "benchmark.json", tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| attn_static (cpu) |" in md.read_text() and result.contexts[0].ctx == 16


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_every_cache_contract_gives_the_same_logits(arch, exported):
    """Static in place, GQA shared buffer (mask as wide as the buffer), dynamic past/present."""
    logits = {}
    for variant in ("attn_static", "gqa", "attn_dynamic"):
        harness = DecodeHarness(exported(arch, variant) / "model.onnx", "cpu")
        caches = harness.new_caches(100)
        harness.prefill(np.random.default_rng(0).integers(3, 250, size=(1, 70)), caches, 100)
        _, last = harness.decode(caches, 70, 100, steps=4, warmup=1)
        logits[variant] = last.ravel()
    assert np.abs(logits["attn_static"] - logits["attn_dynamic"]).max() < 1e-4
    assert np.abs(logits["gqa"] - logits["attn_dynamic"]).max() < 1e-4


def test_gpu_matrix_script_runs_on_cpu(tmp_path):
    """The GPU matrix script end to end on a tiny model (no genai, no profiles)."""
    out = tmp_path / "matrix.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_matrix.py", "--model", "llama-3.2-1b", "--tiny", "--ep", "cpu", "--ctx", "16,32",
         "--steps", "4", "--warmup", "1", "--hf-steps", "2", "--skip", "genai,profile,kernels", "--work", str(tmp_path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert "errors" not in data
    assert {"transformers eager", "ours attn_static + CUDA graph, buffer = context", "ours gqa, no graph, shared buffer",
            "ours attn_dynamic"} <= set(data["configs"])
    for name, per_ctx in data["agreement_vs_attn_dynamic"].items():
        assert all(v["max_abs_diff"] < 1e-2 and v["same_argmax"] for v in per_ctx.values()), name
    assert "Recommended variant" in markdown(data)


def test_bench_cli_refuses_bad_arguments(exported):
    from exporter.cli import main

    assert main(["bench", str(exported("llama", "gqa")), "--ctx", "16,abc"]) == 2
    assert main(["bench", str(exported("llama", "gqa")), "--steps", "0"]) == 2


@needs_cuda
def test_cuda_graph_replay_matches_uncaptured_steps(exported):
    export_dir = exported("llama", "attn_static", "fp16")
    graph = DecodeHarness(export_dir / "model.onnx", "cuda", cuda_graph=True)
    results = []
    for capture in (True, False):
        caches = graph.new_caches(64)
        graph.prefill(np.random.default_rng(0).integers(3, 250, size=(1, 20)), caches, 64)
        results.append(graph.decode(caches, 20, 64, steps=6, warmup=2, capture=capture)[1].ravel())
    assert np.abs(results[0] - results[1]).max() < 1e-2


@needs_cuda
def test_cuda_kernel_probe_names_a_kernel(exported):
    from exporter.kernel_log import probe

    result = probe(exported("llama", "attn_static", "fp16") / "model.onnx", "cuda", ctx=32)
    assert result["returncode"] == 0 and result["kernels"]["decode"]["Attention"]
