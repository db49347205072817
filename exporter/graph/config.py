"""A checkpoint's config.json, read into the few numbers the graph builder needs."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from exporter.errors import ExportError

_TRANSFORMERS_IMPORT = threading.Lock()

# rope types whose frequencies are fixed per position (so a cos/sin table can be baked in).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    rotary_dim: int
    # longrope switches from short to long factors once a sequence outgrows this length.
    original_max_position_embeddings: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture-independent numbers; ``architecture`` names the file that knows the rest."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    hf_config: object = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_raw_config(checkpoint_dir: Path) -> dict:
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise ExportError(f"{checkpoint_dir} has no config.json: point --model at a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{path} is not valid JSON ({err}): re-download the checkpoint") from None


def load_model_config(checkpoint_dir: Path, supported: dict[str, object]) -> ModelConfig:
    """Read config.json through transformers (which normalizes rope and head_dim fields)."""
    raw = read_raw_config(checkpoint_dir)
    model_type = raw.get("model_type")
    if model_type not in supported:
        names = ", ".join(sorted(supported))
        raise ExportError(f"unsupported architecture {model_type!r} in config.json: supported are {names}")
    with _TRANSFORMERS_IMPORT:  # transformers' lazy modules are not safe to import from many threads
        from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(checkpoint_dir))
    rope_params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ExportError(
            f"unsupported rope type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    partial = rope_params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    original_max = rope_params.get("original_max_position_embeddings") or getattr(
        hf, "original_max_position_embeddings", None
    )
    sliding = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        sliding = None
    return ModelConfig(
        architecture=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        rope=RopeConfig(
            rope_type=rope_type,
            theta=float(rope_params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            rotary_dim=int(head_dim * partial),
            original_max_position_embeddings=original_max if rope_type == "longrope" else None,
        ),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=sliding,
        hf_config=hf,
    )
