"""Phi-3 / Phi-3.5: fused qkv_proj and gate_up_proj tensors; longrope scaling on Phi-3.5-mini."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="phi3", fused_qkv=True, fused_gate_up=True)
