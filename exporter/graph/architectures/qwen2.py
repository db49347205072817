"""Qwen2 / Qwen2.5: llama's layout with biases on the q, k and v projections."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="qwen2", qkv_bias=True)
