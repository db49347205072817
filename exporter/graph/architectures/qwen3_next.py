"""Qwen3-Next (80B-A3B): gated DeltaNet layers (linear_attention) between gated attention layers (an
output gate from q_proj, per-head q / k norms, partial rotary), every RMSNorm but the gated one scaling
by 1 + w, and qwen2_moe's experts with a shared expert. Its DeltaNet input projections are stored
interleaved per key head (in_proj_qkvz, in_proj_ba)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="qwen3_next", qk_norm=True, norm_offset=1.0, shared_expert=True,
                            deltanet_layout="interleaved")
