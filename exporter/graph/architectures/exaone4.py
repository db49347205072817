"""EXAONE 4.0: norms after attention and MLP (OLMo 2's layout) with per-head q / k norms, sliding-window layers
and, when there are any, global layers without rotary (NoPE)."""

from exporter.graph.architectures.base import POST_NORM, Architecture

ARCHITECTURE = Architecture(model_type="exaone4", norm_layout=POST_NORM, qk_norm=True)
