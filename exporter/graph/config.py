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
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    rotary_dim: int
    # longrope switches from short to long factors once a sequence outgrows this length.
    original_max_position_embeddings: int | None = None
    # Models with a rope per layer type (gemma3: local and global) name theirs.
    layer_type: str | None = None


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
    # Per layer: full_attention or sliding_attention (a window of sliding_window tokens, itself included).
    layer_types: tuple[str, ...] = ()
    # Per layer: whether rotary applies (smollm3 leaves it out on every Nth layer).
    rope_layers: tuple[bool, ...] = ()
    # Per layer type, when the rope differs between them (gemma3); else every layer uses ``rope``.
    rope_by_layer_type: dict = dataclasses.field(default_factory=dict)
    hidden_act: str = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None  # gemma2: tanh(scores / cap) * cap
    final_softcap: float | None = None
    embedding_scale: float | None = None  # gemma: sqrt(hidden); granite: embedding_multiplier
    residual_scale: float | None = None  # granite: residual_multiplier on every branch
    logits_divisor: float | None = None  # granite: logits_scaling

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.rope_by_layer_type.get(self.layer_types[layer], self.rope) if self.rope_by_layer_type else self.rope

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
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    params = dict(getattr(hf, "rope_parameters", None) or {})
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    if per_type:  # gemma3: {"sliding_attention": {...}, "full_attention": {...}}
        ropes = {t: _rope(hf, p, head_dim, t) for t, p in params.items()}
        rope = ropes.get(FULL) or next(iter(ropes.values()))
    else:
        ropes, rope = {}, _rope(hf, params, head_dim, None)
    if any(r.rope_type == "longrope" for r in ropes.values()):
        raise ExportError("longrope with a rope per layer type is not supported: no such model is known to the exporter")
    sliding = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        sliding = None
    if not layer_types or len(layer_types) != hf.num_hidden_layers:
        layer_types = ((SLIDING if sliding else FULL),) * hf.num_hidden_layers
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise ExportError(f"unsupported layer types {unknown} in config.json: supported are {FULL}, {SLIDING}")
    if sliding is None:
        layer_types = (FULL,) * hf.num_hidden_layers
    no_rope = getattr(hf, "no_rope_layers", None)  # smollm3: 1 = rotary, 0 = none
    rope_layers = tuple(bool(v) for v in no_rope) if no_rope else ()
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ExportError(f"unsupported MLP activation {act!r}: supported are {', '.join(SUPPORTED_ACTIVATIONS)}")
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    attention_scale = getattr(hf, "attention_multiplier", None) or (scalar ** -0.5 if scalar else None)
    embedding_scale = getattr(hf, "embedding_multiplier", None)
    if model_type in ("gemma2", "gemma3_text"):
        embedding_scale = hf.hidden_size ** 0.5
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
        rope=rope,
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=sliding,
        hf_config=hf,
        layer_types=layer_types,
        rope_layers=rope_layers,
        rope_by_layer_type=ropes,
        hidden_act=act,
        attention_scale=attention_scale,
        attention_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
        embedding_scale=embedding_scale,
        residual_scale=getattr(hf, "residual_multiplier", None),
        logits_divisor=getattr(hf, "logits_scaling", None),
    )


def _rope(hf, params: dict, head_dim: int, layer_type: str | None) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ExportError(
            f"unsupported rope type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    original_max = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", None)
    return RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rotary_dim=int(head_dim * partial),
        original_max_position_embeddings=original_max if rope_type == "longrope" else None,
        layer_type=layer_type,
    )
