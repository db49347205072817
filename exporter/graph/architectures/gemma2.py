"""Gemma 2: sandwich norms scaling by (1 + weight), tanh-GELU MLP, embeddings scaled by
sqrt(hidden), query_pre_attn_scalar, attention-logit and final-logit soft-capping, and sliding-window
layers alternating with full ones (``layer_types``)."""

from exporter.graph.architectures.base import SANDWICH, Architecture

ARCHITECTURE = Architecture(model_type="gemma2", norm_layout=SANDWICH, norm_offset=1.0)
