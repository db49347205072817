"""Our rope inverse frequencies and tables against transformers' own initializers, bit for bit, for
every rope type the exporter supports (exporter/graph/rope_init.py replaces the transformers import)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from exporter.graph.architectures import ARCHITECTURES
from exporter.graph.config import load_model_config
from exporter.graph.rope import rope_tables
from exporter.graph.rope_init import inv_freq
from exporter.tiny_checkpoint import make_tiny_checkpoint

ROPES = {
    "default-partial": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                 "partial_rotary_factor": 0.75, "head_dim": 32, "hidden_size": 128}),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}),
    "llama3": ("llama", {"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "yarn": ("qwen2", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128}}),
    "yarn-mscale": ("llama", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}}),
    "longrope": ("phi3", {}),  # the tiny phi3 is longrope (short/long factors, original 64)
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_tables_equal_transformers_bit_for_bit(name, tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch, overrides = ROPES[name]
    directory = make_tiny_checkpoint(arch, tmp_path / name)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **overrides}))
    cfg = load_model_config(directory, ARCHITECTURES)
    hf = AutoConfig.from_pretrained(str(directory))
    rope = cfg.rope
    for seq_len in (None, (rope.original_max_position_embeddings or 0) + 1):
        ours, our_scale = inv_freq(rope.rope_type, rope.parameters, rope.rotary_dim, cfg.max_position_embeddings, seq_len)
        if rope.rope_type == "default":
            head_dim = hf.head_dim
            dim = int(head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
            theirs = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            their_scale = 1.0
        else:
            theirs, their_scale = ROPE_INIT_FUNCTIONS[rope.rope_type](hf, "cpu", seq_len=seq_len)
        assert torch.equal(ours.float(), theirs.float()), name
        assert our_scale == pytest.approx(float(their_scale), rel=0, abs=0), name
    tables = rope_tables(cfg, 256)
    assert tables.cos.dtype == np.float32 and np.isfinite(tables.cos).all()


@pytest.mark.parametrize("arch", ["phi3", "qwen2"])  # longrope (two stacked halves) and default
def test_cached_rope_tables_are_the_computed_ones_bit_for_bit(arch, tmp_path, monkeypatch):
    from exporter.graph import rope as rope_module

    cfg = load_model_config(make_tiny_checkpoint(arch, tmp_path / arch), ARCHITECTURES)
    computed = rope_tables(cfg, 96)
    stored = rope_tables(cfg, 96, cache_dir=tmp_path / "rope")
    (path,) = (tmp_path / "rope").glob("rope-*.npz")

    def no_torch(*args):
        raise AssertionError("computed again instead of read back")

    monkeypatch.setattr(rope_module, "_compute", no_torch)
    read = rope_tables(cfg, 96, cache_dir=tmp_path / "rope")
    for tables in (stored, read):
        assert tables.cos.tobytes() == computed.cos.tobytes() and tables.sin.tobytes() == computed.sin.tobytes()
        assert (tables.table_len, tables.switch_at) == (computed.table_len, computed.switch_at)
    with pytest.raises(AssertionError, match="computed again"):
        rope_tables(cfg, 128, cache_dir=tmp_path / "rope")  # another length is another entry
    monkeypatch.undo()
    path.write_bytes(path.read_bytes()[:100])  # torn: recomputed and replaced
    assert rope_tables(cfg, 96, cache_dir=tmp_path / "rope").cos.tobytes() == computed.cos.tobytes()
