"""Ministral 3 / Mistral 3 text (ministral3): Mistral's layer with yarn and Llama 4's long-context query scale,
1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)) (ModelConfig.position_query_scale)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="ministral3")
