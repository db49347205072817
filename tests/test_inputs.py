"""Checkpoint shapes a user brings: sharded, bf16, tied embeddings; and bad input, refused clearly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from exporter.packaging.package import sha256_file
from exporter.validation.parity import run_parity
from exporter.runtime.session import Decoder
from tests.conftest import MAX_SEQ_LEN


def test_sharded_checkpoint_exports_the_same_bytes(checkpoint, exported):
    sharded = checkpoint("llama", max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    whole = exported("llama", "gqa")
    split = exported("llama", "gqa", "fp32", (("max_shard_size", "100KB"),))
    assert sha256_file(split / "model.onnx.data") == sha256_file(whole / "model.onnx.data")


def test_sharded_checkpoint_without_index_file(checkpoint, exported, workdir):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    src = workdir / "sharded-no-index"
    shutil.copytree(checkpoint("llama", max_shard_size="100KB"), src)
    (src / "model.safetensors.index.json").unlink()
    # transformers itself cannot load shards without their index, so there is no reference to validate with.
    request = ExportRequest(model=str(src), variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN)
    out = export_model(request, workdir / "no-index-out", validate=False)
    assert (out.out_dir / "manifest.json").is_file()
    assert sha256_file(out.out_dir / "model.onnx.data") == sha256_file(exported("llama", "attn_dynamic") / "model.onnx.data")


def test_bf16_checkpoint_exported_to_fp16(exported, reference):
    kw = (("dtype", "bfloat16"),)
    ref = reference("qwen2", ckpt_kwargs=kw)
    for variant in ("attn_dynamic", "gqa", "attn_static"):
        result = run_parity(Decoder(exported("qwen2", variant, "fp16", kw)), ref, near_tie_margin=0.1)
        assert result.mismatches == [], variant
        assert result.prefill_max_abs_error <= 5e-2 * result.logit_range, variant


def test_tied_embeddings(checkpoint, exported, reference):
    kw = (("tie_word_embeddings", True),)
    assert "lm_head.weight" not in _tensor_names(checkpoint("llama", tie_word_embeddings=True))
    ref = reference("llama", ckpt_kwargs=kw)
    for variant in ("attn_dynamic", "gqa", "attn_static"):
        result = run_parity(Decoder(exported("llama", variant, "fp32", kw)), ref, near_tie_margin=0.0)
        assert result.prefill_max_abs_error <= 1e-4 and result.tokens == ref.tokens, variant


def _tensor_names(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "exporter.cli", "export", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def _assert_refused(proc, out_dir, *expected_words):
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("exportfarm: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]
    for word in expected_words:
        assert word in errors[0], errors[0]
    # Nothing that looks like a finished export is left behind.
    assert not (out_dir / "manifest.json").exists()
    assert not [p for p in out_dir.parent.iterdir() if ".partial-" in p.name]


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path / "out"


def test_unknown_architecture(checkpoint, tmp_path, out_dir):
    src = tmp_path / "gpt2ish"
    shutil.copytree(checkpoint("llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    from exporter.graph.architectures import ARCHITECTURES

    assert {"llama", "qwen3_moe", "lfm2", "qwen3_next", "granitemoehybrid"} <= set(ARCHITECTURES)
    _assert_refused(_cli("--model", str(src), "--out", str(out_dir)), out_dir, "gpt2", ", ".join(sorted(ARCHITECTURES)))


def test_missing_config(checkpoint, tmp_path, out_dir):
    src = tmp_path / "noconfig"
    shutil.copytree(checkpoint("llama"), src)
    (src / "config.json").unlink()
    _assert_refused(_cli("--model", str(src), "--out", str(out_dir)), out_dir, "config.json")


def test_truncated_safetensors(checkpoint, tmp_path, out_dir):
    src = tmp_path / "truncated"
    shutil.copytree(checkpoint("llama"), src)
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    _assert_refused(_cli("--model", str(src), "--out", str(out_dir)), out_dir, "model.safetensors", "re-download")


def test_static_cache_without_max_seq_len(checkpoint, out_dir):
    proc = _cli("--model", str(checkpoint("llama")), "--static-cache", "--out", str(out_dir))
    _assert_refused(proc, out_dir, "--max-seq-len")


def test_max_seq_len_above_positions(checkpoint, out_dir):
    proc = _cli("--model", str(checkpoint("llama")), "--static-cache", "--max-seq-len", "100000", "--out", str(out_dir))
    _assert_refused(proc, out_dir, "max_position_embeddings", "256")


def test_max_seq_len_too_short_to_validate(checkpoint, out_dir):
    proc = _cli("--model", str(checkpoint("llama")), "--static-cache", "--max-seq-len", "24", "--out", str(out_dir))
    _assert_refused(proc, out_dir, "validation needs", "--no-validate")


def test_gqa_bf16_on_cpu(checkpoint, out_dir):
    proc = _cli("--model", str(checkpoint("llama")), "--variant", "gqa", "--dtype", "bf16", "--out", str(out_dir))
    _assert_refused(proc, out_dir, "bf16", "cpu")


def test_unknown_dtype(checkpoint, out_dir):
    _assert_refused(_cli("--model", str(checkpoint("llama")), "--dtype", "fp8", "--out", str(out_dir)), out_dir, "fp8")


def test_hub_id_offline_fails_with_a_message(out_dir):
    proc = _cli("--model", "someorg/some-model@main", "--out", str(out_dir))
    _assert_refused(proc, out_dir, "someorg/some-model", "local checkpoint directory")


def test_existing_export_is_not_overwritten_silently(checkpoint, exported, out_dir):
    shutil.copytree(exported("llama", "attn_dynamic"), out_dir)
    before = (out_dir / "manifest.json").read_text()
    proc = _cli("--model", str(checkpoint("llama")), "--out", str(out_dir))
    assert proc.returncode != 0 and "--overwrite" in proc.stderr
    assert (out_dir / "manifest.json").read_text() == before


def _partial_rotary_phi3(directory, factor: float, hidden: int):
    from exporter.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("phi3", directory, hidden_size=hidden, partial_rotary_factor=factor,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": factor})


def test_partial_rotary_exports_where_ort_can_run_it_and_is_refused_where_not(tmp_path):
    """Phi-4-mini style partial rotary: 0.75 of head_dim 16 rotates 12 dims (rotary_dim / 2 = 6, not
    a multiple of 8): GroupQueryAttention's rotary cannot run it, so gqa is refused at export
    naming the constraint and the variants that work, and those match transformers. 0.5 of
    head_dim 32 (rotary_dim / 2 = 8) runs in every variant."""
    from exporter.errors import ExportError
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.reference import load_reference, reference_greedy

    for factor, hidden, refused in ((0.75, 64, True), (0.5, 128, False)):
        source = _partial_rotary_phi3(tmp_path / f"phi3-{factor}", factor, hidden)
        ref = reference_greedy(load_reference(source), [5, 17, 99, 3, 42, 8, 150, 77, 31, 64, 12, 200], 24)
        for variant in ("attn_dynamic", "gqa", "attn_static"):
            request = ExportRequest(model=str(source), variant=variant, static_cache=variant == "attn_static",
                                    max_seq_len=MAX_SEQ_LEN)
            if variant == "gqa" and refused:
                with pytest.raises(ExportError) as err:
                    export_model(request, tmp_path / f"out-{factor}-{variant}", validate=False)
                message = str(err.value)
                assert "rotary_dim / 2 to be a multiple of 8" in message and "(rotary_dim / 2 = 6)" in message
                assert "--variant attn_dynamic or attn_static" in message
                continue
            out = export_model(request, tmp_path / f"out-{factor}-{variant}", validate=False).out_dir
            result = run_parity(Decoder(out), ref, near_tie_margin=0.0)
            assert result.prefill_max_abs_error <= 1e-4 and result.tokens == ref.tokens, (factor, variant)


@pytest.mark.parametrize("edit,words", [
    ({"max_position_embeddings": 400_000_000}, "max_position_embeddings = 400000000 is outside"),
    ({"vocab_size": 1_000_000_000}, "vocab_size = 1000000000 is outside"),
    ({"hidden_size": "64"}, "hidden_size must be an integer, not '64'"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a number between 0 and 1"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"vocab_size": 300}, "model.embed_tokens.weight is \\[256, 64\\] but config.json implies \\[300, 64\\]"),
    ({"intermediate_size": 96}, "mlp.gate_proj.weight is \\[128, 64\\] but config.json implies \\[96, 64\\]"),
    ({"num_hidden_layers": 3}, "config.json says 3 layers, the checkpoint holds layers 0..1"),
    ({"max_position_embeddings": 1 << 22}, "without max_seq_len the export's rotary tables would hold them all"),
])
def test_config_values_are_typed_bounded_and_held_to_the_weights(checkpoint, tmp_path, edit, words):
    """A config.json that is wrong, hostile or at odds with its tensors is refused by name before
    anything is sized by it (a 4e8-position rope table, a 1e9-row vocabulary on a 256-row embedding)."""
    from exporter.errors import ExportError
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    source = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **edit}))
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic")
    with pytest.raises(ExportError, match=words):
        export_model(request, tmp_path / "out", validate=False)
    if "max_position_embeddings" in edit and edit["max_position_embeddings"] == 1 << 22:
        bounded = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic", max_seq_len=64)
        assert export_model(bounded, tmp_path / "bounded", validate=False).out_dir.is_dir()
