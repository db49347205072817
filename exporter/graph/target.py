"""Which ONNX an export is written as: the current target (IR 11, opset 24, the standard fused ops) or
the compat target for older onnxruntime (IR 10, opset 20, onnxruntime's contrib ops).

transformers.js 3.x runs onnxruntime-node 1.21 / onnxruntime-web 1.22, which refuse IR 11 and know no
opset-23/24 op. The compat graph computes the same model through ops those runtimes have:

- RMSNorm: SimplifiedLayerNormalization (onnxruntime registers it in the default domain); the fused
  residual norm is com.microsoft SkipSimplifiedLayerNormalization on both targets.
- rotary: com.microsoft RotaryEmbedding (inputs x, position_ids, cos_cache, sin_cache).
- attention (attn_dynamic only): the caches concatenated in the graph, K/V repeated to the query heads
  (MultiHeadAttention has no grouped-query form) and com.microsoft MultiHeadAttention with the
  causal + padding mask as an additive attention_bias; soft-capped scores (gemma2), which that op
  cannot take, as MatMul / Softmax.

Opset 20 is the lowest default-domain opset every op either target emits exists at (Gelu is 20; the
reductions' axes inputs 18); MatMulNBits stays for int4 / int8.
"""

from __future__ import annotations

import dataclasses

from exporter.contract import META_PREFIX, META_TARGET
from exporter.errors import ExportError


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    ir_version: int
    opset: int  # the default domain's
    contrib_ops: bool  # True: onnxruntime's contrib norm / rotary / attention instead of opset 23-24's


CURRENT = Target("current", ir_version=11, opset=24, contrib_ops=False)
COMPAT = Target("compat", ir_version=10, opset=20, contrib_ops=True)
# The newest default-domain opset the runtimes compat is for take (onnxruntime 1.21); the structure gate's bound.
COMPAT_MAX_OPSET = 21
# Default-domain ops onnxruntime registers itself (checkers that know only onnx's schemas must be told).
ORT_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization",)


def target_for(compat: bool) -> Target:
    return COMPAT if compat else CURRENT


def is_compat(metadata: dict) -> bool:
    """Whether an export's metadata (exporter.runtime.session.read_metadata's) marks the compat target."""
    return metadata.get(META_TARGET.removeprefix(META_PREFIX)) == COMPAT.name


def check_compat(variant: str, dtype: str, ep: str) -> None:
    """Refuse what the compat target cannot express, from the request alone (the checkpoint's own
    refusals, mixtures of experts and attention sinks, come at build: ``check_compat_model``)."""
    if variant == "attn_static":
        raise ExportError(
            "attn_static cannot be exported for older onnxruntime (compat): its fixed caches are written with "
            "TensorScatter and read by Attention's nonpad_kv_seqlen, both opset 24 only; use --variant attn_dynamic "
            "with compat, or attn_static without it")
    if variant == "gqa":
        raise ExportError(
            "gqa is not offered for older onnxruntime (compat): GroupQueryAttention reads each row's length from the "
            "mask assuming right padding (transformers.js and optimum left-pad) and its inputs changed across "
            "onnxruntime releases; use --variant attn_dynamic with compat, or gqa without it")
    if dtype == "bf16":
        raise ExportError(
            "bf16 cannot be exported for older onnxruntime (compat): its CPU and WebAssembly kernels have no bf16 "
            "norm, rotary or attention; use dtype fp32 or fp16 with compat, or bf16 without it")


def check_compat_model(architecture: str, moe: bool, attention_sinks: bool, activations: str,
                       recurrent: bool = False) -> None:
    """The compat refusals that depend on the checkpoint: what it is and what it computes in."""
    if recurrent:
        raise ExportError(
            f"{architecture} has recurrent layers, whose fused ops (com.microsoft CausalConvWithState, GatedDeltaNet / "
            "LinearAttention) older onnxruntime does not have: export it without compat (onnxruntime 1.31+)")
    if moe:
        raise ExportError(
            f"{architecture} is a mixture of experts, and the expert ops the export uses (com.microsoft MoE / QMoE "
            "with fused SwiGLU) have no CPU kernel in older onnxruntime: export it without compat (onnxruntime 1.23+)")
    if attention_sinks:
        raise ExportError(
            f"{architecture} adds a learned sink to every attention softmax, which only GroupQueryAttention's head_sink "
            "(onnxruntime 1.23+) takes: export it without compat, with --variant gqa")
    if activations == "bf16":
        raise ExportError(
            "this quantized cuda export would compute in bf16, which older onnxruntime "
            "cannot run (compat): set quant activations fp16, or export without compat")
