"""Llama (2, 3, 3.1, 3.2): the reference layout; attention_bias / mlp_bias come from config."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="llama")
