"""Gemma 3 (text): Gemma 2's layer plus per-head q/k norms, its own rope for local (sliding) and
global layers, and no soft-capping by default."""

from exporter.graph.architectures.base import SANDWICH, Architecture

ARCHITECTURE = Architecture(model_type="gemma3_text", norm_layout=SANDWICH, norm_offset=1.0, qk_norm=True)
