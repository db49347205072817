"""Mistral: llama's layout; a sliding window only matters past its length (checked at request)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="mistral")
