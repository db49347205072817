"""Rotary cos/sin tables, from exporter.graph.rope_init (transformers' rope arithmetic, bit for bit).

The tables are baked into the graph as initializers indexed by position. longrope switches from
short to long factors once ``max(position_ids) + 1`` exceeds the pretraining length; instead of an
``If`` node (which blocks CUDA graph capture) both tables are stacked, short then long, and the
graph offsets its position indices by ``table_len`` to select the long half.

They are computed in torch, as transformers computes them, and torch costs an export more than a
second to import; with a cache directory, tables are kept by everything that decides their bits
(rope parameters, table length, torch version, machine), so every later export of a checkpoint
(other variants, other dtypes) or of any model with the same rope reads them back instead.
"""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

import numpy as np

from exporter.cache import cache_key, read_npz, write_npz
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


def _table(inv_freq, scaling: float, cos: np.ndarray, sin: np.ndarray) -> None:
    """Fill ``cos`` and ``sin`` ([positions, rotary_dim / 2] float32) with the same arithmetic as the
    transformers rotary module: fp32 outer product, then cos / sin, then scale. In place, in the
    tables themselves: the angles, cosines and scaled copies each took a table's size beside them
    (2^20 positions of a 256-wide head: 0.5 GiB each)."""
    import torch

    cos_, sin_ = torch.from_numpy(cos), torch.from_numpy(sin)
    torch.outer(torch.arange(cos.shape[0], dtype=torch.float32), inv_freq, out=sin_)  # the angles
    torch.cos(sin_, out=cos_).mul_(scaling)
    sin_.sin_().mul_(scaling)


def rope_tables(config: ModelConfig, table_len: int, rope: RopeConfig | None = None,
                cache_dir: Path | None = None) -> RopeTables:
    """cos/sin of ``rope`` (default: the model's) for positions [0, table_len), both halves for longrope;
    read from ``cache_dir`` when computed there before, and stored there when not."""
    rope = rope or config.rope
    if cache_dir is None:
        return _compute(config, table_len, rope)
    path = Path(cache_dir) / f"rope-{_cache_key(config, table_len, rope)}.npz"
    tables = _load(path, table_len)
    if tables is None:
        tables = _compute(config, table_len, rope)
        _store(path, tables)
    return tables


def _cache_key(config: ModelConfig, table_len: int, rope: RopeConfig) -> str:
    from exporter.versions import package_version

    return cache_key({"rope_type": rope.rope_type, "parameters": rope.parameters, "rotary_dim": rope.rotary_dim,
                      **({"architecture": config.architecture} if config.architecture == "phimoe" else {}),
                      "original_max_position_embeddings": rope.original_max_position_embeddings,
                      "max_position_embeddings": config.max_position_embeddings, "table_len": table_len,
                      # torch's float32 cos/sin kernels decide the last bits; they differ by version and CPU.
                      "torch": package_version("torch"), "machine": platform.machine(), "cpu": _cpu_flags()})


def _cpu_flags() -> str:
    """The CPU's feature flags (torch picks its vector kernels by them), or "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _load(path: Path, table_len: int) -> RopeTables | None:
    data = read_npz(path)
    if data is None or not {"cos", "sin", "switch_at", "table_len"} <= set(data):
        return None  # absent, torn or foreign: computed again and replaced
    cos, sin = data["cos"], data["sin"]
    switch_at = int(data["switch_at"])
    if int(data["table_len"]) != table_len or cos.dtype != np.float32 or cos.shape != sin.shape:
        return None
    return RopeTables(cos, sin, table_len, None if switch_at < 0 else switch_at)


def _store(path: Path, tables: RopeTables) -> None:
    write_npz(path, cos=tables.cos, sin=tables.sin, table_len=tables.table_len,
              switch_at=-1 if tables.switch_at is None else tables.switch_at)


def _compute(config: ModelConfig, table_len: int, rope: RopeConfig) -> RopeTables:
    longrope = rope.rope_type == "longrope"
    shape = ((2 if longrope else 1) * table_len, rope.rotary_dim // 2)
    cos, sin = np.empty(shape, np.float32), np.empty(shape, np.float32)
    if not longrope:
        _table(*_inv_freq(config, rope, None), cos, sin)
        return RopeTables(cos, sin, table_len, None)
    original = rope.original_max_position_embeddings
    short_freq, scaling = _inv_freq(config, rope, None)
    long_freq, _ = _inv_freq(config, rope, original + 1)
    short_scale = long_scale = scaling
    if config.architecture == "phimoe":
        # transformers' PhimoeRotaryEmbedding scales by short_mscale / long_mscale, chosen by the same
        # length test, and computes its frequencies without a length: the short factors at any length.
        long_freq, short_scale, long_scale = short_freq, rope.parameters["short_mscale"], rope.parameters["long_mscale"]
    _table(short_freq, short_scale, cos[:table_len], sin[:table_len])  # short, then long: one table each
    _table(long_freq, long_scale, cos[table_len:], sin[table_len:])
    return RopeTables(cos, sin, table_len, original)
