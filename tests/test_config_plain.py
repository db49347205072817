"""config.json read without transformers (exporter.graph.config.plain_config) gives the very
ModelConfig transformers' AutoConfig gives, for every architecture it covers and for the config
shapes seen on the hub (legacy rope_theta + rope_scaling, windows on and off); anything it cannot
vouch for falls back to AutoConfig."""

from __future__ import annotations

import json

import pytest

from exporter.graph.architectures import ARCHITECTURES
from exporter.graph.config import PLAIN_TYPES, _model_config, _transformers_config, plain_config, read_raw_config
from exporter.tiny_checkpoint import make_tiny_checkpoint

CASES = {
    "llama": ("llama", {}),
    "llama-legacy-llama3": ("llama", {"rope_parameters": None, "rope_theta": 500000.0, "max_position_embeddings": 1024,
                                      "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-no-head-dim": ("llama", {"head_dim": None}),
    "mistral": ("mistral", {}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                               "layer_types": None}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3-legacy-longrope": ("phi3", {}),  # rewritten below from its own rope_parameters
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_config_equals_transformers(name, tmp_path):
    arch, overrides = CASES[name]
    directory = make_tiny_checkpoint(arch, tmp_path / name)
    path = directory / "config.json"
    raw = {**json.loads(path.read_text()), **overrides}
    if name == "phi3-legacy-longrope":
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None or k in ("sliding_window",)}))
    plain = plain_config(read_raw_config(directory))
    assert plain is not None, name
    ours = _model_config(plain, arch)
    theirs = _model_config(_transformers_config(directory), arch)
    assert ours == theirs, name  # every field but the config object itself, rope parameters included


def test_every_plain_architecture_is_covered():
    assert {arch for arch, _ in CASES.values()} == set(PLAIN_TYPES)
    assert set(PLAIN_TYPES) < set(ARCHITECTURES)


@pytest.mark.parametrize("arch,drop,add", [
    ("mistral", "sliding_window", {}), ("qwen2", "use_sliding_window", {}), ("llama", "tie_word_embeddings", {}),
    ("gemma2", None, {}), ("qwen2", "num_key_value_heads", {}), ("mistral", "num_key_value_heads", {}),
    ("qwen3", "head_dim", {}), ("phi3", "original_max_position_embeddings", {}),
    ("llama", None, {"original_max_position_embeddings": 16}),
    ("llama", None, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
def test_what_plain_config_cannot_vouch_for_goes_to_transformers(arch, drop, add, tmp_path):
    """Each of these differs between a plain reading and transformers' class defaults (or is
    ambiguous), so the exporter asks transformers."""
    directory = make_tiny_checkpoint(arch, tmp_path / arch)
    raw = {**json.loads((directory / "config.json").read_text()), **add}
    if drop:
        raw.pop(drop, None)
    assert plain_config(raw) is None


def test_an_export_of_a_complete_config_never_imports_transformers(tmp_path):
    import subprocess
    import sys

    source = make_tiny_checkpoint("qwen2", tmp_path / "ckpt")
    code = ("import sys\nfrom exporter.pipeline import export_model\nfrom exporter.request import ExportRequest\n"
            f"export_model(ExportRequest(model={str(source)!r}, dtype='fp16', ep='cpu', variant='gqa'), "
            f"{str(tmp_path / 'out')!r}, validate=False)\n"
            "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
