"""Rotary cos/sin tables, from exporter.graph.rope_init (transformers' rope arithmetic, bit for bit).

The tables are baked into the graph as initializers indexed by position. longrope switches from
short to long factors once ``max(position_ids) + 1`` exceeds the pretraining length; instead of an
``If`` node (which blocks CUDA graph capture) both tables are stacked, short then long, and the
graph offsets its position indices by ``table_len`` to select the long half.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from exporter.graph.config import ModelConfig, RopeConfig


@dataclasses.dataclass(frozen=True)
class RopeTables:
    cos: np.ndarray  # [rows, rotary_dim / 2] float32
    sin: np.ndarray
    table_len: int  # positions per half; rows == 2 * table_len when ``switch_at`` is set
    switch_at: int | None  # longrope: total length above which the long half applies


def _inv_freq(config: ModelConfig, rope: RopeConfig, seq_len: int | None) -> tuple[np.ndarray, float]:
    import torch

    from exporter.graph.rope_init import inv_freq

    with torch.no_grad():
        freq, scaling = inv_freq(rope.rope_type, rope.parameters, rope.rotary_dim, config.max_position_embeddings, seq_len)
    return freq.float(), float(scaling)


def _table(inv_freq, scaling: float, length: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    # Same arithmetic as the transformers rotary module: fp32 outer product, then cos/sin, then scale.
    positions = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return (freqs.cos() * scaling).numpy(), (freqs.sin() * scaling).numpy()


def rope_tables(config: ModelConfig, table_len: int, rope: RopeConfig | None = None) -> RopeTables:
    """cos/sin of ``rope`` (default: the model's) for positions [0, table_len), both halves for longrope."""
    rope = rope or config.rope
    if rope.rope_type != "longrope":
        inv_freq, scaling = _inv_freq(config, rope, None)
        cos, sin = _table(inv_freq, scaling, table_len)
        return RopeTables(cos, sin, table_len, None)
    original = rope.original_max_position_embeddings
    short_freq, scaling = _inv_freq(config, rope, None)
    long_freq, _ = _inv_freq(config, rope, original + 1)
    short_cos, short_sin = _table(short_freq, scaling, table_len)
    long_cos, long_sin = _table(long_freq, scaling, table_len)
    return RopeTables(
        np.concatenate([short_cos, long_cos]), np.concatenate([short_sin, long_sin]), table_len, original
    )
