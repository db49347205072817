"""Gemma 4 (text: Gemma4ForCausalLM): Gemma 3's sandwich layer with plain-weight RMSNorms, q / k norms and a
weightless norm on the values, no softmax scale; global layers with their own head size (and with
attention_k_eq_v their values the keys, fewer KV heads) and a proportional rope; the last num_kv_shared_layers
attending over an earlier layer's keys and values; per-layer inputs (PLE) gated into each layer's output, which
its layer_scalar multiplies (config.py _gemma4_fields)."""

from exporter.graph.architectures.base import SANDWICH, Architecture

ARCHITECTURE = Architecture(model_type="gemma4_text", norm_layout=SANDWICH, qk_norm=True)
