"""Qwen2-MoE / Qwen1.5-MoE: qwen2's attention (q/k/v biases); experts routed by softmax top k
(renormalized iff norm_topk_prob) plus a shared expert scaled by sigmoid(x . shared_expert_gate);
layers in mlp_only_layers or off decoder_sparse_step keep a dense MLP."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="qwen2_moe", qkv_bias=True, shared_expert=True)
