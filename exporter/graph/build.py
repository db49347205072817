"""Stage 2: config.json + lazy weights -> an onnx-ir model of the requested variant."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx_ir as ir

from exporter import __version__, contract
from exporter.graph.architectures import ARCHITECTURES
from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import Checkpoint
from exporter.graph.components.decoder import projected_parts
from exporter.graph.components.gated_deltanet import GATED_DELTANET_OP, LINEAR_ATTENTION
from exporter.graph.components.graph import GraphBuilder
from exporter.graph.components.moe import fused_sparse_mixer, moe_metadata
from exporter.graph.components.rotary import mrope_section
from exporter.graph.config import GATED_DELTANET, MAMBA2, ModelConfig, load_model_config
from exporter.graph.language_model import image_text_type, language_model
from exporter.errors import ExportError
from exporter.request import EP, DType, ExportRequest, Variant
from exporter.packaging.resolve import ResolvedSource
from exporter.graph.target import check_compat, check_compat_model, target_for
from exporter.graph.task import build_graph

IR_DTYPES = {DType.FP32: ir.DataType.FLOAT, DType.FP16: ir.DataType.FLOAT16, DType.BF16: ir.DataType.BFLOAT16}
# Graph-wide metadata the runtime drivers read back (model.onnx is self-describing).


@dataclasses.dataclass
class BuildResult:
    model: ir.Model
    config: ModelConfig
    architecture: Architecture
    variant: Variant
    checkpoint: Checkpoint
    activations: DType  # what the graph computes in (activation_range.choose_activations on the checkpoint)


# The most positions an export's rotary tables cover without a max_seq_len asking for them (a table
# row per position: 1M positions of head_dim 128 are 512 MB of fp32 cos / sin).
ROPE_TABLE_POSITIONS = 1 << 20
# onnxruntime-gpu 1.31's QMoE (moe_quantization.cc): "int weight-only quantization requires hidden_size
# [and inter_size] to be a multiple of 64 (the interleaved-weight K tile)", checked at run time only.
CUDA_QMOE_TILE = 64


def check_request_against_config(request: ExportRequest, variant: Variant, cfg: ModelConfig,
                                 activations: DType | None = None) -> None:
    """Refuse what this checkpoint cannot do, before any graph is built (``activations``: what the
    graph computes in on this checkpoint; None: what the request alone says)."""
    if request.max_seq_len is None and cfg.max_position_embeddings > ROPE_TABLE_POSITIONS:
        raise ExportError(
            f"the model allows {cfg.max_position_embeddings} positions, and without max_seq_len the export's rotary "
            f"tables would hold them all (more than {ROPE_TABLE_POSITIONS}): set max_seq_len (CLI --max-seq-len) to "
            "the longest context the export must serve")
    if request.max_seq_len is not None and request.max_seq_len > cfg.max_position_embeddings:
        raise ExportError(
            f"max_seq_len {request.max_seq_len} is above the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}: use max_seq_len {cfg.max_position_embeddings} or less"
        )
    arch = ARCHITECTURES[cfg.architecture]
    if request.compat:
        check_compat(variant.value, request.dtype.value, request.ep.value)
        check_compat_model(cfg.architecture, cfg.moe is not None, bool(arch.attention_sinks),
                           (activations or request.activations).value, cfg.recurrent is not None)
    beyond = [i for i in (request.quant.int8_layers if request.quant else ()) if i >= cfg.num_layers]
    if beyond:
        raise ExportError(f"quant int8_layers names layers {beyond}, but the model has {cfg.num_layers} "
                          f"(0..{cfg.num_layers - 1})")
    if cfg.moe and request.dtype.quantized and request.ep is EP.CUDA:
        widths = {"hidden_size": cfg.hidden_size, "expert width": cfg.moe.expert_intermediate}
        odd = {k: v for k, v in widths.items() if v % CUDA_QMOE_TILE}
        if odd:
            raise ExportError(
                f"onnxruntime's CUDA QMoE kernels take experts whose hidden and expert widths are multiples of "
                f"{CUDA_QMOE_TILE}; this model's {', '.join(f'{k} is {v}' for k, v in odd.items())}: export it in fp16 / "
                "bf16 (the float MoE op), or quantized for ep cpu")
    if arch.attention_sinks and variant is not Variant.GQA:
        raise ExportError(
            f"{cfg.architecture} adds a learned sink to every attention softmax, which only GroupQueryAttention takes "
            f"(its head_sink input); opset-24 Attention has none, so {variant.value} cannot express this model: use "
            "--variant gqa")
    if variant is Variant.GQA:
        for i in range(cfg.num_layers):
            if not cfg.uses_rope(i):
                continue
            half = cfg.layer_rope(i).rotary_dim // 2
            if half % 8 or half > cfg.for_layer(i).head_dim // 2:
                raise ExportError(
                    f"GroupQueryAttention's fused rotary needs rotary_dim / 2 to be a multiple of 8 and at most "
                    f"head_dim / 2; layer {i} of this model rotates {2 * half} of {cfg.for_layer(i).head_dim} dims "
                    f"(rotary_dim / 2 = {half}): use --variant attn_dynamic or attn_static, which apply rotary "
                    "with RotaryEmbedding"
                )


def check_shapes(cfg: ModelConfig, arch: Architecture, checkpoint: Checkpoint) -> None:
    """The checkpoint's tensors have the shapes config.json implies (embedding [vocab, hidden], the
    projections of every layer, no layer past num_hidden_layers): a config that disagrees with its
    weights is refused by name before a graph is built on it (vocab_size 1e9 over a 256-row embedding
    once "succeeded")."""
    import re

    def expect(name: str, shape: tuple[int, ...]) -> None:
        if name in checkpoint and tuple(checkpoint.shape(name)) != shape:
            raise ExportError(f"{name} is {list(checkpoint.shape(name))} but config.json implies {list(shape)}: the "
                              "config and the weights disagree; fix config.json or use the weights it belongs to")

    if arch.embed_tokens not in checkpoint:
        raise ExportError(f"the checkpoint has no {arch.embed_tokens}: not a {cfg.architecture} checkpoint")
    expect(arch.embed_tokens, (cfg.vocab_size, cfg.hidden_size))
    expect(arch.lm_head, (cfg.vocab_size, cfg.hidden_size))
    layer_name = re.compile(re.escape(arch.layer_prefix(0).removesuffix("0")) + r"(\d+)\.")
    layers = {int(m.group(1)) for n in checkpoint.names() if (m := layer_name.match(n))}
    if layers and (max(layers) + 1 != cfg.num_layers or len(layers) != cfg.num_layers):
        raise ExportError(f"config.json says {cfg.num_layers} layers, the checkpoint holds layers "
                          f"{min(layers)}..{max(layers)} ({len(layers)}): the config and the weights disagree")
    if cfg.per_layer_input:  # gemma4's per-layer inputs
        width = cfg.num_layers * cfg.per_layer_input.width
        expect(arch.per_layer_embed, (cfg.per_layer_input.vocab, width))
        expect(arch.per_layer_model_projection, (width, cfg.hidden_size))
    for i in range(cfg.num_layers):
        own = cfg.for_layer(i)  # gemma4: head sizes, KV heads and MLP widths by layer
        if cfg.per_layer_input:
            expect(arch.names(i)["per_layer_gate"], (cfg.per_layer_input.width, cfg.hidden_size))
            expect(arch.names(i)["per_layer_projection"], (cfg.hidden_size, cfg.per_layer_input.width))
        if cfg.is_recurrent(i):
            _check_recurrent(cfg, arch, i, expect)
        if cfg.is_attention(i):
            _check_attention(own, arch, i, expect, own.q_size, own.kv_size)
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            _check_experts(cfg, arch, checkpoint, i, expect)
            if not cfg.moe.beside_dense_mlp:  # gemma4: the dense MLP below runs beside the experts
                continue
            for name in arch.router_scales:  # gemma4's router.scale [hidden], router.per_expert_scale [experts]
                expect(arch.moe_name(i, name), (cfg.hidden_size,) if name.endswith(".scale") else (cfg.moe.num_experts,))
        if cfg.single_mixer:  # nemotron_h: a block is its one mixer; an MLP block's is ungated
            if cfg.is_feed_forward(i):
                expect(arch.gate_up_parts(i)[0].name, (cfg.intermediate_size, cfg.hidden_size))
                expect(f"{arch.names(i)['down']}.weight", (cfg.hidden_size, cfg.intermediate_size))
            continue
        gate_up = arch.gate_up_parts(i)
        fused = len(gate_up) == 1 and not arch.ungated_mlp  # one gate_up_proj (phi3), not an ungated up_proj (apertus)
        for part in gate_up:
            expect(part.name, (own.intermediate_size * (2 if fused else 1), cfg.hidden_size))
        expect(f"{arch.names(i)['down']}.weight", (cfg.hidden_size, own.intermediate_size))


def _check_recurrent(cfg: ModelConfig, arch: Architecture, i: int, expect) -> None:
    """A recurrent layer's tensors have the shapes its config implies (the convolution's channels and
    taps, gated DeltaNet's heads)."""
    rc, name, hidden = cfg.recurrent, lambda t: arch.recurrent_name(i, t), cfg.hidden_size  # noqa: E731
    if rc.kind == GATED_DELTANET:
        expect(name("conv1d.weight"), (rc.channels, 1, rc.conv_kernel))
        for t in ("A_log", "dt_bias"):
            expect(name(t), (rc.value_heads,))
        expect(name("norm.weight"), (rc.value_dim,))
        expect(name("out_proj.weight"), (hidden, rc.value_heads * rc.value_dim))
        values = rc.value_heads * rc.value_dim
        expect(name("in_proj_qkv.weight"), (rc.channels, hidden))
        expect(name("in_proj_z.weight"), (values, hidden))
        expect(name("in_proj_qkvz.weight"), (rc.channels + values, hidden))
        expect(name("in_proj_ba.weight"), (2 * rc.value_heads, hidden))
        if rc.value_heads % rc.key_heads:
            raise ExportError(f"linear_num_value_heads {rc.value_heads} is not a multiple of linear_num_key_heads "
                              f"{rc.key_heads}: fix config.json")
    elif rc.kind == MAMBA2:
        inner = rc.value_heads * rc.value_dim
        expect(name("in_proj.weight"), (inner + rc.channels + rc.value_heads, hidden))
        expect(name("conv1d.weight"), (rc.channels, 1, rc.conv_kernel))
        for t in ("A_log", "dt_bias", "D"):
            expect(name(t), (rc.value_heads,))
        expect(name("norm.weight"), (inner,))
        expect(name("out_proj.weight"), (hidden, inner))
    else:
        expect(name("in_proj.weight"), (3 * hidden, hidden))
        expect(name("conv.weight"), (hidden, 1, rc.conv_kernel))
        expect(name("out_proj.weight"), (hidden, hidden))


def _check_latent_attention(cfg: ModelConfig, arch: Architecture, i: int, expect) -> None:
    """deepseek_v3's projections have the ranks and head sizes config.json gives (components/latent_attention.py)."""
    lat, attn, hidden, heads = cfg.latent, f"{arch.layer_prefix(i)}.self_attn", cfg.hidden_size, cfg.num_heads
    q_width = heads * (lat.nope_dim + lat.rope_dim)
    if lat.q_rank:
        expect(f"{attn}.q_a_proj.weight", (lat.q_rank, hidden))
        expect(f"{attn}.q_a_layernorm.weight", (lat.q_rank,))
        expect(f"{attn}.q_b_proj.weight", (q_width, lat.q_rank))
    else:
        expect(f"{attn}.q_proj.weight", (q_width, hidden))
    expect(f"{attn}.kv_a_proj_with_mqa.weight", (lat.kv_rank + lat.rope_dim, hidden))
    expect(f"{attn}.kv_a_layernorm.weight", (lat.kv_rank,))
    expect(f"{attn}.kv_b_proj.weight", (heads * (lat.nope_dim + lat.value_dim), lat.kv_rank))
    expect(f"{attn}.o_proj.weight", (hidden, heads * lat.value_dim))


def _check_attention(cfg: ModelConfig, arch: Architecture, i: int, expect, q: int, kv: int) -> None:
    if cfg.latent is not None:
        return _check_latent_attention(cfg, arch, i, expect)
    parts = projected_parts(arch, cfg, i)
    rows_of = (q, kv, kv) if arch.fused_qkv else (q, kv, kv)[:len(parts)]  # gemma4: q alone, or q and k
    if cfg.attention_output_gate:  # q_proj holds each head's query and its gate
        expect(parts[0].name, (2 * q, cfg.hidden_size))
        parts, rows_of = parts[1:], (kv, kv)
    if len(parts) == len(rows_of):
        for part, rows in zip(parts, rows_of):
            expect(part.name, (rows, cfg.hidden_size))
    else:
        expect(parts[0].name, (q + 2 * kv, cfg.hidden_size))
    expect(f"{arch.names(i)['o']}.weight", (cfg.hidden_size, q))


def _check_experts(cfg: ModelConfig, arch: Architecture, checkpoint: Checkpoint, i: int, expect) -> None:
    """A sparse layer's router routes to config.json's expert count and every expert has the widths
    it implies (a config that disagrees would stack the wrong experts, or fail deep in a read)."""
    moe, hidden = cfg.moe, cfg.hidden_size
    router = arch.router_name(i)
    if router not in checkpoint:
        raise ExportError(f"the checkpoint has no {router}: not a {cfg.architecture} checkpoint, or config.json's "
                          "mlp_only_layers / decoder_sparse_step do not describe it")
    if checkpoint.shape(router)[0] != moe.num_experts:
        raise ExportError(f"config.json says {moe.num_experts} experts, but {router} routes to "
                          f"{checkpoint.shape(router)[0]}: the config and the weights disagree")
    expect(router, (moe.num_experts, hidden))
    fc1, fc2 = arch.expert_parts(i, moe.num_experts, moe.expert_intermediate, has=checkpoint.__contains__)
    if fc1[0].mxfp4_scales:  # gpt-oss's MXFP4: [experts, out, in / 32, 16] codes, [experts, out, in / 32] scales
        for part, (rows, cols) in ((fc1[0], (2 * moe.expert_intermediate, hidden)), (fc2[0], (hidden, moe.expert_intermediate))):
            if cols % 32:
                raise ExportError(f"{part.name}: MXFP4 blocks hold 32 values, and {cols} is not a multiple of 32")
            expect(part.name, (moe.num_experts, rows, cols // 32, 16))
            expect(part.mxfp4_scales, (moe.num_experts, rows, cols // 32))
        return
    if arch.stacked_experts and arch.experts_transposed:  # gpt-oss, llama4_text: [experts, in, out]
        expect(fc1[0].name, (moe.num_experts, hidden, 2 * moe.expert_intermediate))
        expect(fc2[0].name, (moe.num_experts, moe.expert_intermediate, hidden))
        return
    if arch.stacked_experts:
        expect(fc1[0].name, (moe.num_experts, 2 * moe.expert_intermediate, hidden))
        expect(fc2[0].name, (moe.num_experts, hidden, moe.expert_intermediate))
        return
    width = moe.latent or hidden  # nemotron_h's experts may run at a latent width
    for part in fc1:
        if part.name not in checkpoint:
            raise ExportError(f"the checkpoint has no {part.name}: config.json says {moe.num_experts} experts")
        expect(part.name, (moe.expert_intermediate, width))
    for part in fc2:
        expect(part.name, (width, moe.expert_intermediate))
    if moe.latent:
        expect(arch.moe_name(i, "fc1_latent_proj.weight"), (moe.latent, hidden))
        expect(arch.moe_name(i, "fc2_latent_proj.weight"), (hidden, moe.latent))
    if moe.relu2_experts and moe.shared_expert_intermediate:
        names = arch.shared_expert_names(i)
        expect(names["up"], (moe.shared_expert_intermediate, hidden))
        expect(names["down"], (hidden, moe.shared_expert_intermediate))
    if arch.shared_expert and moe.shared_expert_intermediate:
        names, width = arch.shared_expert_names(i), moe.shared_expert_intermediate
        expect(names["gate"], (width, hidden))
        expect(names["up"], (width, hidden))
        expect(names["down"], (hidden, width))
        expect(names["gate_scale"], (1, hidden))


def check_prequantized(request: ExportRequest, cfg: ModelConfig, checkpoint: Checkpoint, activations: DType) -> None:
    """A GPTQ / AWQ checkpoint exports to a float dtype (its linears dequantized) or, keeping its codes,
    to the quantized dtype of its own width, in activations that hold its fp16 scales exactly."""
    fmt = checkpoint.prequantized
    if fmt is None or not request.dtype.quantized:
        return
    if request.dtype.bits != fmt.bits:
        raise ExportError(f"the checkpoint is {fmt.label}: export int{fmt.bits} to keep its codes, or fp16 / fp32 to "
                          f"dequantize them; int{request.dtype.bits} would quantize them again")
    holds = {ir.DataType.FLOAT16: DType.FP16, ir.DataType.BFLOAT16: DType.BF16}.get(checkpoint.packed_scales_dtype)
    if activations not in (DType.FP32, holds):
        raise ExportError(f"the checkpoint's {fmt.method} scales are {holds.value if holds else 'fp32'}, which "
                          f"{activations.value} activations would round: set quant activations "
                          f"{holds.value if holds else 'fp32 (export for cpu)'} (CLI --quant-activations)")
    if cfg.moe is not None:
        raise ExportError(f"the experts of a {fmt.method} checkpoint are not imported into QMoE: export it in fp16 / "
                          "fp32 (dequantized), or quantize its float checkpoint with dtype int4")
    if request.quant and request.quant.int8_layers:
        raise ExportError(f"quant int8_layers gives layers more bits than the checkpoint's {fmt.label} codes hold: "
                          "drop int8_layers")


def build_model(request: ExportRequest, source: ResolvedSource, on_layer=None, rope_cache: Path | None = None,
                activations: DType | None = None) -> BuildResult:
    """config.json + lazy weights -> the variant's graph; ``rope_cache`` keeps rope tables between exports;
    ``activations``: what the graph computes in (the pipeline's choice; default what the request says)."""
    variant = request.resolved_variant()
    activations = activations or request.activations
    # An image-text checkpoint: the decoder is its language model, taking inputs_embeds (graph/language_model.py)
    language = language_model(source.path) if image_text_type(source.path) else None
    cfg = language.config if language else load_model_config(source.path, ARCHITECTURES)
    check_request_against_config(request, variant, cfg, activations)
    arch = language.architecture if language else ARCHITECTURES[cfg.architecture]
    checkpoint = Checkpoint(source.path)
    check_shapes(cfg, arch, checkpoint)
    check_prequantized(request, cfg, checkpoint, activations)
    target = target_for(request.compat)
    fused_mixer = fused_sparse_mixer(cfg.moe, request.ep.value, request.dtype.quantized)
    builder = GraphBuilder(checkpoint, IR_DTYPES[activations], rope_cache, target, fused_mixer, request.ep.value)
    if request.layout == "hf":  # transformers.js's onnxruntime-node has no GatedDeltaNet / MoEGroupRouter kernel
        builder.deltanet_op = LINEAR_ATTENTION
        builder.group_router_op = False
    table_len = request.max_seq_len or cfg.max_position_embeddings
    graph = build_graph(builder, arch, cfg, variant, table_len, request.max_seq_len, on_layer,
                        inputs_embeds=language is not None, deepstack=language.deepstack if language else 0)
    model = ir.Model(graph, ir_version=target.ir_version, producer_name="exportfarm", producer_version=__version__)
    model.metadata_props.update(
        {
            contract.META_VARIANT: variant.value,
            contract.META_DTYPE: request.dtype.value,
            contract.META_EP: request.ep.value,
            contract.META_CONFIG: json.dumps(
                {
                    "architecture": cfg.architecture,
                    "num_layers": cfg.num_layers,
                    "num_heads": cfg.num_heads,
                    "num_kv_heads": cfg.num_kv_heads,
                    **contract.head_dim_entries(cfg.head_dim, cfg.value_head_dim),
                    "vocab_size": cfg.vocab_size,
                    "max_seq_len": request.max_seq_len,
                    "context_length": table_len,
                    "sliding_window": cfg.sliding_window,
                    "sliding_layers": [i for i in range(cfg.num_layers) if cfg.window(i)],
                    **({"kv_shared_layers": [i for i in cfg.attention_layers if not cfg.has_cache(i)]}
                       if cfg.layer_attention else {}),
                    "activations": activations.value,
                    **({"image_text": language.model_type} if language else {}),
                    # qwen3_vl: inputs_embeds hidden x (1 + deepstack) wide (contract.image_text_width)
                    **({"deepstack": language.deepstack} if language and language.deepstack else {}),
                    # M-RoPE: position_ids [3, batch, seq] (docs/graph-contracts.md "M-RoPE")
                    **({"mrope_section": list(mrope_section(cfg.rope))} if language and mrope_section(cfg.rope) else {}),
                    **({"recurrent": {"kind": cfg.recurrent.kind,
                                      "ops": ["CausalConvWithState"] + (
                                          [builder.deltanet_op] if cfg.recurrent.kind == GATED_DELTANET else
                                          [GATED_DELTANET_OP] if cfg.recurrent.kind == MAMBA2 else []),
                                      "layers": [i for i in range(cfg.num_layers) if cfg.is_recurrent(i)],
                                      # the layers that attend (not nemotron_h's MLP / experts blocks; falcon_h1's
                                      # layers attend and carry states)
                                      "attention_layers": list(cfg.attention_layers),
                                      **({"feed_forward_layers": [i for i in range(cfg.num_layers)
                                                                  if cfg.is_feed_forward(i)]}
                                         if cfg.single_mixer else {})}}
                       if cfg.recurrent else {}),
                    **({"moe": moe_metadata(cfg.moe, fused_mixer)} if cfg.moe else {}),
                    **({"quant": request.quant.to_dict()} if request.quant else {}),
                }
            ),
        }
    )
    if request.compat:
        model.metadata_props[contract.META_TARGET] = target.name
    return BuildResult(model, cfg, arch, variant, checkpoint, activations)
