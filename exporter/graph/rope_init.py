"""Rotary inverse frequencies for every rope type the exporter supports, without transformers.

The same arithmetic as transformers' rope initializers (``modeling_rope_utils``), in torch float32
so the tables are bit-identical (tests/test_rope_init.py compares every type against transformers
on the same configs). Importing transformers costs an export more than a second; config.json and
these formulas are all the rope tables need.
"""

from __future__ import annotations

import math

from exporter.errors import ExportError


def _base_freq(theta: float, dim: int):
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _need(params: dict, key: str, rope_type: str):
    if params.get(key) is None:
        raise ExportError(f"rope type {rope_type} needs {key!r} in the config's rope parameters: the checkpoint's "
                          "config.json is incomplete")
    return params[key]


def inv_freq(rope_type: str, params: dict, dim: int, max_position_embeddings: int, seq_len: int | None = None):
    """(inverse frequencies [dim / 2] float32, attention scaling) for ``rope_type``."""
    import torch

    theta = float(_need(params, "rope_theta", rope_type))
    if rope_type == "default":
        return _base_freq(theta, dim), 1.0
    if rope_type == "linear":
        return _base_freq(theta, dim) / _need(params, "factor", rope_type), 1.0
    if rope_type == "llama3":
        freq = _base_freq(theta, dim)
        factor = _need(params, "factor", rope_type)
        low, high = _need(params, "low_freq_factor", rope_type), _need(params, "high_freq_factor", rope_type)
        old_len = _need(params, "original_max_position_embeddings", rope_type)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "proportional":  # gemma4: ``dim`` the whole head, its angles past the rotated share 0
        angles = int(float(params.get("partial_rotary_factor") or 1.0) * dim // 2)
        turned = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        return torch.cat((turned, torch.zeros(dim // 2 - angles))) / params.get("factor", 1.0), 1.0
    if rope_type == "yarn":
        return _yarn(params, theta, dim, max_position_embeddings)
    if rope_type == "longrope":
        original = _need(params, "original_max_position_embeddings", rope_type)
        factor = params.get("factor") or max_position_embeddings / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = params["long_factor"] if seq_len and seq_len > original else params["short_factor"]
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape), float(attention)
    raise ExportError(f"unsupported rope type {rope_type!r}")


def _yarn(params: dict, theta: float, dim: int, max_position_embeddings: int):
    import torch

    original = _need(params, "original_max_position_embeddings", "yarn")
    factor = params.get("factor") or max_position_embeddings / original

    def mscale_of(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all)) if mscale and mscale_all \
            else mscale_of(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    freq = (1.0 / (factor * pos)) * (1 - extrapolation_weight) + (1.0 / pos) * extrapolation_weight
    return freq, float(attention)
