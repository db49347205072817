"""Mistral: llama's layout; a sliding window only matters past its length (checked at request)."""

from exporter.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="mistral")
