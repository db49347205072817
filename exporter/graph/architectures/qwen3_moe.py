"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): qwen3's attention (per-head q/k norms) with routed experts
and no shared expert."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="qwen3_moe", qk_norm=True)
