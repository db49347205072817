"""The decode benchmark harness on the CPU EP, the kernel-log parser on recorded ORT lines, and the
CUDA-only paths, which skip with their reason when this onnxruntime has no CUDA EP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from exporter.runtime.bench import run_bench
from exporter.runtime.session import Decoder
from exporter.reports.bench_report import markdown, write_report
from exporter.runtime.kernel_log import PHASE_MARK, parse_kernel_lines
from tests.conftest import needs_cuda

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


def test_every_timed_prefill_comes_after_an_untimed_one_of_its_shape(exported, tmp_path, monkeypatch):
    """The first run of a shape pays its set-up; benchmark.json's prefill figures leave it out and
    say how many untimed runs came first."""
    import shutil

    from exporter.runtime.session import Decoder

    export_dir = shutil.copytree(exported("qwen2", "gqa"), tmp_path / "export")
    shapes = []
    real = Decoder.prefill_bound
    monkeypatch.setattr(Decoder, "prefill_bound", lambda self, tokens, caches, buffer:
                        shapes.append(tokens.shape) or real(self, tokens, caches, buffer))
    run_bench(export_dir, "cpu", contexts=[16, 32], steps=2, warmup=1, prefill_lengths=[24])
    assert shapes == [(1, 16), (1, 16), (1, 32), (1, 32), (1, 24), (1, 24)]
    assert json.loads((export_dir / "benchmark.json").read_text())["settings"]["prefill_warmup"] == 1


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_every_cache_contract_gives_the_same_logits(arch, exported):
    """Static in place, GQA shared buffer (mask as wide as the buffer), dynamic past/present."""
    logits = {}
    for variant in ("attn_static", "gqa", "attn_dynamic"):
        harness = Decoder(exported(arch, variant), "cpu")
        caches = harness.new_caches(100)
        harness.prefill_bound(np.random.default_rng(0).integers(3, 250, size=(1, 70)), caches, 100)
        _, last = harness.decode_bound(caches, 70, 100, steps=4, warmup=1)
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
    assert {"transformers eager", "ours attn_static + CUDA graph, buffer = context", "ours gqa, no graph, shared buffer, growing mask",
            "ours attn_dynamic"} <= set(data["configs"])
    for name, per_ctx in data["agreement_vs_attn_dynamic"].items():
        assert all(v["max_abs_diff"] < 1e-2 and v["same_argmax"] for v in per_ctx.values()), name
    checked = data["independent_check"]["configs"]
    assert {"ours attn_static + CUDA graph, buffer = context", "ours gqa, no graph, shared buffer, growing mask"} <= set(checked)
    assert all(len(row["contexts"]) == 2 and all(r["check_ms"] > 0 for r in row["contexts"].values())
               for row in checked.values())
    assert set(data["driving_diagnosis"]["decode_ms_median"]["ours gqa"]) == {
        "graph-enabled session, steps not captured, buffer-wide mask (the old matrix)",
        "own session, buffer-wide mask", "own session, growing mask (onnxruntime-genai without a graph)"}
    text = markdown(data)
    assert "Independent check" in text and ("Recommended variant" in text or "No recommendation" in text)


def test_recommendation_rests_only_on_reproduced_figures():
    """A faster figure the independent harness did not reproduce is not recommended; within 3% is a tie."""
    def config(ms):
        return {"decode": {"128": {"decode_ms_median": ms[0]}, "4096": {"decode_ms_median": ms[1]}}}

    result = {"configs": {"ours gqa + CUDA graph, shared buffer": config([1.00, 1.30]),
                          "ours attn_static + CUDA graph, buffer = context": config([0.90, 1.29]),
                          "onnxruntime-genai builder gqa + CUDA graph, shared buffer": config([1.01, 1.40])},
              "independent_check": {"tool": "decode_check", "contexts": [128, 4096], "configs": {
                  "ours gqa + CUDA graph, shared buffer": {"reproduced": True, "contexts": {}},
                  "ours attn_static + CUDA graph, buffer = context": {"reproduced": False, "contexts": {}},
                  "onnxruntime-genai builder gqa + CUDA graph, shared buffer": {"reproduced": True, "contexts": {}}}}}
    text = markdown(result)
    assert "- 128-4096 tokens: **ours gqa + CUDA graph, shared buffer**" in text
    assert "128: tie (+1.0%)" in text and "4096: 7.1% faster" in text
    result["independent_check"]["configs"]["onnxruntime-genai builder gqa + CUDA graph, shared buffer"]["reproduced"] = False
    assert "none of its figures was reproduced" in markdown(result) and "7.1% faster" not in markdown(result)
    result["independent_check"]["configs"]["ours gqa + CUDA graph, shared buffer"]["reproduced"] = False
    assert "No recommendation" in markdown(result)


def test_bench_cli_refuses_bad_arguments(exported):
    from exporter.cli import main

    assert main(["bench", str(exported("llama", "gqa")), "--ctx", "16,abc"]) == 2
    assert main(["bench", str(exported("llama", "gqa")), "--steps", "0"]) == 2
    assert main(["bench", str(exported("llama", "gqa")), "--batch", "0"]) == 2


@needs_cuda
def test_cuda_graph_replay_matches_uncaptured_steps(exported):
    export_dir = exported("llama", "attn_static", "fp16")
    graph = Decoder(export_dir, "cuda", cuda_graph=True)
    results = []
    for capture in (True, False):
        caches = graph.new_caches(64)
        graph.prefill_bound(np.random.default_rng(0).integers(3, 250, size=(1, 20)), caches, 64)
        results.append(graph.decode_bound(caches, 20, 64, steps=6, warmup=2, capture=capture)[1].ravel())
    assert np.abs(results[0] - results[1]).max() < 1e-2


@needs_cuda
def test_cuda_kernel_probe_names_a_kernel(exported):
    from exporter.runtime.kernel_log import probe

    result = probe(exported("llama", "attn_static", "fp16") / "model.onnx", "cuda", ctx=32)
    assert result["returncode"] == 0 and result["kernels"]["decode"]["Attention"]


def fake_bf16_decoder(directory):
    """A bf16 model with attn_static's graph contract and ops the CPU runs in bf16 (no attention):
    logits[b, s, j] = input_ids[b, s] * j, each cache passed through. It drives the bf16 paths of
    the driver and the bench on the CPU, which has no bf16 attention kernels for a real export."""
    import json as json_

    import onnx_ir as ir

    from exporter import contract

    vocab, layers, slots, kv = 16, 2, 32, 8
    bf16, i64 = ir.DataType.BFLOAT16, ir.DataType.INT64

    def value(name, dtype, dims):
        return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))

    ids = value(contract.INPUT_IDS, i64, ["batch_size", "sequence_length"])
    inputs = [ids, value(contract.POSITION_IDS, i64, ["batch_size", "sequence_length"])]
    nodes, outputs = [], []
    ramp = ir.Value(name="ramp", const_value=ir.tensor(np.arange(vocab, dtype=np.float32)))
    as_float = ir.node("Cast", [ids], {"to": ir.DataType.FLOAT})
    column = ir.node("Unsqueeze", [as_float.outputs[0], ir.Value(name="axes", const_value=ir.tensor(np.array([2])))])
    product = ir.node("Mul", [column.outputs[0], ramp])
    logits_node = ir.node("Cast", [product.outputs[0]], {"to": bf16})
    logits = logits_node.outputs[0]
    logits.name, logits.type, logits.shape = contract.LOGITS, ir.TensorType(bf16), ir.Shape(["batch_size", "sequence_length", vocab])
    nodes += [as_float, column, product, logits_node]
    outputs.append(logits)
    for layer in range(layers):
        k_in, v_in, k_out, v_out = contract.cache_names("attn_static", layer)
        for name_in, name_out in ((k_in, k_out), (v_in, v_out)):
            cache = value(name_in, bf16, ["batch_size", "max_seq_len", kv])
            inputs.append(cache)
            node = ir.node("Identity", [cache])
            node.outputs[0].name, node.outputs[0].type = name_out, ir.TensorType(bf16)
            node.outputs[0].shape = ir.Shape(["batch_size", "max_seq_len", kv])
            nodes.append(node)
            outputs.append(node.outputs[0])
    inputs += [value(contract.WRITE_INDICES, i64, ["batch_size"]), value(contract.NONPAD_KV_SEQLEN, i64, ["batch_size"])]
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=[ramp, nodes[1].inputs[1]], opset_imports={"": 24})
    model = ir.Model(graph, ir_version=11)
    model.metadata_props.update({
        contract.META_VARIANT: "attn_static", contract.META_DTYPE: "bf16", contract.META_EP: "cpu",
        contract.META_CONFIG: json_.dumps({"num_layers": layers, "num_heads": 1, "num_kv_heads": 1, "head_dim": kv,
                                           "vocab_size": vocab, "max_seq_len": slots, "context_length": slots}),
    })
    directory.mkdir(parents=True)
    ir.save(model, directory / contract.MODEL_FILE)
    return directory


def test_bf16_runs_through_the_host_and_device_paths_and_the_bench(tmp_path):
    """What `exportfarm bench` of a bf16 export used to die on (no bf16 in the dtype table)."""
    export_dir = fake_bf16_decoder(tmp_path / "bf16")
    decoder = Decoder(export_dir, "cpu")
    assert decoder.dtype.name == "bf16"
    state = decoder.new_state(batch=2)
    logits = decoder.forward(np.array([[3, 4], [5, 6]]), state)
    assert logits.dtype.name == "bfloat16" and logits.astype(np.float32)[1, 1, 2] == 12.0  # 6 * 2
    caches = decoder.new_caches(16, batch=2)
    decoder.prefill_bound(np.full((2, 4), 2), caches, 16)
    _, last = decoder.decode_bound(caches, 4, 16, steps=3, warmup=1)
    assert last.dtype == np.float32 and list(last[0, 0]) == list(range(16))  # decode feeds token 1
    result = run_bench(export_dir, "cpu", contexts=[4], steps=3, warmup=1, prefill_lengths=[8], batches=[1, 2])
    assert [(c.ctx, c.batch) for c in result.contexts] == [(4, 1), (4, 2)] and result.dtype == "bf16"


def test_a_growing_gqa_mask_over_the_shared_buffer_gives_the_same_logits(exported):
    """onnxruntime-genai without a CUDA graph: the KV buffer is max-length, the mask grows."""
    logits = {}
    for policy in ("buffer", "grow"):
        decoder = Decoder(exported("llama", "gqa"), "cpu", gqa_mask=policy)
        caches = decoder.new_caches(100)
        decoder.prefill_bound(np.random.default_rng(0).integers(3, 250, size=(1, 40)), caches, 100)
        logits[policy] = decoder.decode_bound(caches, 40, 100, steps=5, warmup=1)[1].ravel()
    assert np.abs(logits["buffer"] - logits["grow"]).max() < 1e-4
    with pytest.raises(ValueError, match="captured"):
        Decoder(exported("llama", "gqa"), "cpu", gqa_mask="grow", cuda_graph=True)


@pytest.mark.parametrize("variant", ["attn_static", "gqa", "attn_dynamic"])
def test_bound_batch_rows_match_their_batch_1_runs(variant, exported):
    """The bench's batch > 1 (device binding): each row's logits equal the same prompt run alone.
    GroupQueryAttention's first prompt took batch 1 only while its mask was as wide as the buffer."""
    decoder = Decoder(exported("qwen3", variant), "cpu")
    prompts = np.random.default_rng(1).integers(3, 250, size=(2, 30))
    caches = decoder.new_caches(60, batch=2)
    decoder.prefill_bound(prompts, caches, 60)
    batched = decoder.decode_bound(caches, 30, 60, steps=4, warmup=1)[1]
    for r in range(2):
        alone = decoder.new_caches(60)
        decoder.prefill_bound(prompts[r:r + 1], alone, 60)
        single = decoder.decode_bound(alone, 30, 60, steps=4, warmup=1)[1]
        assert np.abs(batched[r] - single[0]).max() < 1e-4
    result = run_bench(exported("qwen3", variant), "cpu", contexts=[16], steps=3, warmup=1, prefill_lengths=[8],
                       batches=[1, 4])
    assert [(c.ctx, c.batch) for c in result.contexts] == [(16, 1), (16, 4)]


def test_gpu_worker_e2e_script_runs_on_cpu(tmp_path):
    """benchmarks/gpu_worker_e2e.py (the worker's job function over every variant) on the CPU."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_worker_e2e.py", "--ep", "cpu", "--dtypes", "fp16", "--archs", "qwen3",
         "--batches", "1,2", "--steps", "4", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["summary"] == {"jobs": 3, "ready_with_benchmark": 3}
    for job in data["jobs"]:
        assert job["parity"]["status"] == "passed" and {"manifest.json", "model.onnx", "benchmark.json"} <= set(job["published"])
        assert sorted({(row["ctx"], row["batch"]) for row in job["decode"]}) == [(64, 1), (64, 2), (128, 1), (128, 2)]


def test_the_report_of_a_windowed_attn_static_export_names_its_kernel_cost(exported, tmp_path):
    from exporter.reports.bench_report import WINDOW_NOTE

    # Bench copies: the shared fixture exports stay without a benchmark for other tests.
    for arch, variant, noted in (("mistral", "attn_static", True), ("mistral", "gqa", False), ("llama", "attn_static", False)):
        export = shutil.copytree(exported(arch, variant), tmp_path / f"{arch}-{variant}")
        run_bench(export, "cpu", contexts=[16], steps=2, warmup=1, prefill_lengths=[8])
        (tmp_path / f"report-{arch}-{variant}").mkdir()
        _, md = write_report(export / "benchmark.json", tmp_path / f"report-{arch}-{variant}")
        assert (WINDOW_NOTE in md.read_text()) is noted, (arch, variant)


def test_the_dtype_recommendation_weighs_speed_against_the_quality_gate():
    from exporter.reports.bench_report import cpu_markdown, dtype_recommendation

    rows = {
        "ours int4 gqa": {"dtype": "int4", "decode_ms": 7.0, "model_bytes": 86e6,
                          "agreement": 0.92, "kl_mean": 0.19, "ppl_delta": 0.32},
        "ours int8 attn_dynamic": {"dtype": "int8", "decode_ms": 10.0, "model_bytes": 154e6,
                                   "agreement": 1.0, "kl_mean": 0.01, "ppl_delta": 0.005},
        "ours fp32 gqa": {"dtype": "fp32", "decode_ms": 21.0, "model_bytes": 540e6},
    }
    verdict = dtype_recommendation(rows)
    assert verdict["pick"] == "ours int8 attn_dynamic"
    assert list(verdict["passed_over"]) == ["ours int4 gqa"]
    assert verdict["passed_over"]["ours int4 gqa"] == ["perplexity +32.0% > +15%"]
    # Within the int4 limits, the faster int4 is the pick; without quality figures it is never eligible.
    rows["ours int4 gqa"]["ppl_delta"] = 0.10
    assert dtype_recommendation(rows)["pick"] == "ours int4 gqa"
    del rows["ours int4 gqa"]["kl_mean"]
    assert dtype_recommendation(rows)["passed_over"]["ours int4 gqa"] == ["no kl_mean measured"]
    # Tighter thresholds of the caller's rule out int8 too, leaving fp32.
    strict = {"int4": {"agreement_min": 1, "kl_max": 0, "ppl_delta_max": 0},
              "int8": {"agreement_min": 1, "kl_max": 0.001, "ppl_delta_max": 0.001}}
    assert dtype_recommendation(rows, strict)["pick"] == "ours fp32 gqa"

    result = {"model": "m", "command": "python benchmarks/cpu_matrix.py", "results": {
        name: {**{k: v for k, v in row.items() if k != "dtype"}, "prefill_ms": 30.0} for name, row in rows.items()}}
    result["results"]["ours int4 gqa"]["kl_mean"] = 0.19
    result["results"]["genai builder int4"] = {"decode_ms": 9.0, "prefill_ms": 40.0, "model_bytes": 87e6,
                                               "agreement": 0.9, "kl_mean": 0.2, "ppl_delta": 0.2}
    result["failed_exports"] = {"genai builder fp32": "builder exited 1: ...\nKeyError: 'rope_type'"}
    text = cpu_markdown(result)
    assert "- **ours int4 gqa**: 7.00 ms/token, 86 MB" in text
    assert "int4: our fastest (ours int4 gqa) is 0.78x the builder's decode time, KL 0.1900 against its 0.2000" in text
    assert "genai builder fp32 could not be built: KeyError: 'rope_type'" in text


@pytest.mark.parametrize("variant", ["attn_dynamic", "gqa", "attn_static"])
def test_an_image_text_export_is_benchmarked_through_its_embedding_graph_with_its_image_costs(variant, tmp_path):
    """The farm benchmarks every export it publishes: an image-text decoder takes inputs_embeds, so its text decode is
    timed through the embedding graph (no images), and the image costs are added: the vision graph on one image and
    the time to the first token of a one-image prompt (vision, embedding, prefill)."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    source = make_tiny_vlm_checkpoint("gemma3", tmp_path / "ckpt")
    out = export_model(ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant=variant,
                                     static_cache=variant == "attn_static", max_seq_len=64), tmp_path / "export",
                       validate=False).out_dir
    run_bench(out, "cpu", contexts=[16], steps=4, warmup=1, prefill_lengths=[8])
    data = json.loads((out / "benchmark.json").read_text())
    assert [d["ctx"] for d in data["decode"]] == [16] and data["decode"][0]["decode_ms_median"] > 0
    image = data["image"]
    assert image["tokens_per_image"] == 16 and image["prompt_tokens"] == 24
    assert image["encode_ms_median"] > 0 and image["time_to_first_token_ms_median"] > 0  # (no timing race: CI is noisy)
    assert "time to the first token of a 24-token one-image prompt" in markdown(data)


@pytest.mark.parametrize("family, image, variant", [
    ("qwen2_5_vl", "grid t, h, w of patches 1 x 16 x 16", "gqa"),  # tokens follow the image's grid: M-RoPE positions
    # the bench prefills twice on fresh static caches: the second is a new sequence, not the next row of a batch
    ("qwen2_5_vl", "grid t, h, w of patches 1 x 16 x 16", "attn_static"),
    ("qwen3_5", "grid t, h, w of patches 1 x 16 x 16", "gqa"),  # the same, the hybrid decoder's states beside its KV
    ("mistral3", "64 px", "gqa"),  # tokens follow the image's size: pixels padded to it with image_sizes
])
def test_image_text_exports_whose_tokens_follow_the_image_size_are_benchmarked(family, image, variant, tmp_path):
    """A family whose image tokens follow each image's size (Qwen-VL's grids, Pixtral's padded images) is timed on a
    square image of the bench's own size, shrunk to fit the export's max_seq_len: here 72 positions hold 64 image
    tokens (8 x 8) and 8 text tokens."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    source = make_tiny_vlm_checkpoint(family, tmp_path / "ckpt")
    out = export_model(ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant=variant,
                                     static_cache=variant == "attn_static", max_seq_len=73),
                       tmp_path / "export", validate=False).out_dir
    run_bench(out, "cpu", contexts=[16], steps=4, warmup=1, prefill_lengths=[8])
    data = json.loads((out / "benchmark.json").read_text())
    assert data["decode"][0]["decode_ms_median"] > 0
    figures = data["image"]
    assert figures["tokens_per_image"] == 64 and figures["prompt_tokens"] == 72
    assert figures["encode_ms_median"] > 0 and figures["time_to_first_token_ms_median"] > 0
    assert f"Image ({image}, 64 tokens)" in markdown(data)
