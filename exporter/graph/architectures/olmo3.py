"""OLMo 3: OLMo 2's layer (norms after attention and MLP, q / k norms over the whole projection) with three
sliding-window layers to one global (layer_types) and a rope per layer type."""

from exporter.graph.architectures.base import POST_NORM, Architecture

ARCHITECTURE = Architecture(model_type="olmo3", norm_layout=POST_NORM, qk_norm=True, qk_norm_per_head=False)
