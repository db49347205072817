"""Granite: llama's layer with embedding, residual and attention multipliers and a logits divisor
(all read from config.json into ModelConfig)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="granite")
