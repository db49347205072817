"""SmolLM3: llama's layer, no rotary on every Nth layer (``no_rope_layers``)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="smollm3")
