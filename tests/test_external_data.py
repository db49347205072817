"""model.onnx.data written in one pass and hashed as it goes: the same bytes onnx-ir writes."""

from __future__ import annotations

import hashlib

import onnx
import onnx_ir as ir
import pytest

from exporter.contract import DATA_FILE, MODEL_FILE
from exporter.graph.build import build_model
from exporter.graph.fold import fold_model
from exporter.packaging import checkpoint as ckpt
from exporter.packaging.external_data import write_model_files
from exporter.packaging.resolve import resolve_source
from exporter.request import ExportRequest


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int4"])
def test_the_files_equal_onnx_irs_and_the_hash_is_the_files(checkpoint, dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "BLOCK_BYTES", 4096)  # many blocks per tensor, transposed ones included
    request = ExportRequest(model=str(checkpoint("qwen2")), dtype=dtype, variant="gqa")
    built = build_model(request, resolve_source(request.model))
    fold_model(built.model, request, built.config.num_layers)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    written = write_model_files(built.model, ours)
    ir.save(built.model, theirs / MODEL_FILE, external_data=DATA_FILE)
    data = (ours / DATA_FILE).read_bytes()
    assert data == (theirs / DATA_FILE).read_bytes()
    assert (ours / MODEL_FILE).read_bytes() == (theirs / MODEL_FILE).read_bytes()
    assert written.sha256 == hashlib.sha256(data).hexdigest() and written.size == len(data)
    onnx.checker.check_model(str(ours / MODEL_FILE), full_check=False)
    # The model is handed back with its lazy weights, so it can be written again.
    assert all(not isinstance(v.const_value, ir.ExternalTensor) for v in built.model.graph.initializers.values())


def test_a_failed_write_stops_the_writer_and_raises(checkpoint, tmp_path, monkeypatch):
    request = ExportRequest(model=str(checkpoint("qwen2")), dtype="fp16", variant="gqa")
    built = build_model(request, resolve_source(request.model))

    def broken(self):
        raise OSError("disk full")
        yield  # a generator, as chunks() is

    monkeypatch.setattr(ckpt.CheckpointTensor, "chunks", broken)
    with pytest.raises(OSError, match="disk full"):
        write_model_files(built.model, tmp_path)
    assert not (tmp_path / MODEL_FILE).exists()


def test_an_export_whose_rope_tables_are_cached_imports_no_torch(checkpoint, tmp_path):
    """Importing torch costs an export more than a second: a bf16 -> fp16 export reads, casts,
    transposes and writes in numpy, and only the first export of a rope configuration computes the
    tables in torch."""
    import json
    import os
    import subprocess
    import sys

    source = checkpoint("qwen2", dtype="bfloat16")
    code = (
        "import sys\nfrom exporter.cli import main\n"
        f"assert main(['export', '--model', {str(source)!r}, '--dtype', 'fp16', '--variant', 'gqa', "
        f"'--out', sys.argv[1], '--no-validate']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "EXPORTFARM_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / f"out{i}")], env=env, capture_output=True,
                           text=True, check=True).stdout.split()[-1] for i in range(2)]
    assert runs == ["True", "False"]  # computed once, then read back
    first, second = (json.loads((tmp_path / f"out{i}" / "manifest.json").read_text()) for i in range(2))
    assert first["files"][DATA_FILE] == second["files"][DATA_FILE]  # the same bytes either way


def test_checkpoint_files_are_read_only_inside_the_checkpoint(checkpoint, tmp_path):
    """A tokenizer.json linked to a secret outside the checkpoint would be copied into the package and
    published; a shard named outside the directory would be read: both are refused by name. Links
    inside the checkpoint, and a model directory that is itself a link, still work."""
    import json
    import shutil

    from exporter.errors import ExportError
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.packaging.source_files import checkpoint_file
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    secret = tmp_path / "environ"
    secret.write_text("S3_SECRET_KEY=hunter2\n")
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), source)
    (source / "tokenizer.json").symlink_to(secret)
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic", max_seq_len=64)
    with pytest.raises(ExportError, match="tokenizer.json in ckpt leads outside the checkpoint"):
        export_model(request, tmp_path / "out", validate=False)
    assert not (tmp_path / "out").exists()
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").symlink_to(source / "config.json")  # inside: fine
    assert checkpoint_file(source, "tokenizer.json") == source / "tokenizer.json"
    (source / "tokenizer.json").unlink()

    [shard] = source.glob("*.safetensors")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(shard, outside / shard.name)
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": f"../elsewhere/{shard.name}"}}))
    (source / shard.name).symlink_to(outside / shard.name)
    with pytest.raises(ExportError, match="leads outside the checkpoint|not a file name inside"):
        Checkpoint(source)
    with pytest.raises(ExportError, match="not a file name inside the checkpoint"):
        checkpoint_file(source, f"../elsewhere/{shard.name}")
    link = tmp_path / "linked-model"
    link.symlink_to(checkpoint("llama"))
    assert Checkpoint(link.resolve()).names()  # the model directory itself may be a link
