"""ERNIE 4.5 (dense): llama's layer with the rotary pairing adjacent dims (ModelConfig.rotary_interleaved) and
``use_bias`` for every projection; tied embeddings by default."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="ernie4_5")
