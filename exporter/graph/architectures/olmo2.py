"""OLMo 2: norms after attention and after the MLP (none before), q/k norm over the whole projection."""

from exporter.graph.architectures.base import POST_NORM, Architecture

ARCHITECTURE = Architecture(model_type="olmo2", norm_layout=POST_NORM, qk_norm=True, qk_norm_per_head=False)
