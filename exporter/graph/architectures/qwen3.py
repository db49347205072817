"""Qwen3: per-head RMSNorm on queries and keys before rotary (q_norm, k_norm)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="qwen3", qk_norm=True)
