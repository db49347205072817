"""One decoder layer in the architecture's norm layout (pre, sandwich or post), residual adds fused
into the norm that follows them where there is one."""

from __future__ import annotations

import dataclasses

import numpy as np

import onnx_ir as ir

from exporter.graph.architectures.base import PARALLEL_BLOCK, POST_NORM, SANDWICH, Architecture
from exporter.graph.components.attention import (
    AttentionWeights,
    SharedKV,
    StepInputs,
    attention_compat,
    attention_dynamic,
    attention_gqa,
    attention_sharing_kv,
    attention_static,
)
from exporter.graph.components.gated_deltanet import DELTANET_GATES, DeltaNetWeights, gated_deltanet
from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.latent_attention import LatentWeights, latent_attention
from exporter.graph.components.mamba2 import Mamba2Weights, mamba2
from exporter.graph.components.mlp import gated_mlp, relu2_mlp, xielu
from exporter.graph.components.moe import experts_beside_mlp, moe_mlp
from exporter.graph.components.norm import residual_rms_norm, rms_norm
from exporter.graph.components.per_layer_input import per_layer_update
from exporter.graph.components.short_conv import ShortConvWeights, short_conv
from exporter.graph.config import GATE_ONLY, GATED_DELTANET, MAMBA2, MOE_BLOCK, ModelConfig
from exporter.packaging.checkpoint import WeightPart
from exporter.errors import ExportError
from exporter.request import Variant

ATTENTION = {
    Variant.ATTN_DYNAMIC: attention_dynamic,
    Variant.ATTN_STATIC: attention_static,
    Variant.GQA: attention_gqa,
}


def _packed_weight(b: GraphBuilder, parts) -> ir.Value:
    return packed(b, [b.weight(p.name, p) for p in parts])


def _optional(b: GraphBuilder, name: str) -> ir.Value | None:
    return b.weight(name) if b.has_weight(name) else None


def norm_weight(b: GraphBuilder, arch: Architecture, name: str) -> ir.Value:
    """An RMSNorm weight as the op multiplies by it (gemma's 1 + w folded in)."""
    return b.weight(name, arch.norm_part(name))


def norm_bias(b: GraphBuilder, arch: Architecture, name: str) -> ir.Value | None:
    """A LayerNorm's bias (phimoe), beside its weight; zeros for a LayerNorm without one (cohere2: the ops take the
    mean-removing form with a bias); None for an RMSNorm."""
    if not arch.layer_norm:
        return None
    if not arch.layer_norm_bias:
        width = b.checkpoint.shape(name)[0]
        return b.constant(np.zeros(width, dtype=b.dtype.numpy()), f"layer_norm.zero_bias.{width}")
    return b.weight(name.removesuffix(".weight") + ".bias")


def norm(b: GraphBuilder, arch: Architecture, x: ir.Value, name: str, eps: float) -> ir.Value:
    """The architecture's norm (RMSNorm, or phimoe's LayerNorm with its bias) named ``name``, of ``x``."""
    return rms_norm(b, x, norm_weight(b, arch, name), eps, norm_bias(b, arch, name))


def residual_norm(b: GraphBuilder, arch: Architecture, residual: ir.Value, update: ir.Value, name: str, eps: float):
    """``residual + update`` and the architecture's norm of it (named ``name``): (normed, sum)."""
    return residual_rms_norm(b, residual, update, norm_weight(b, arch, name), eps, norm_bias(b, arch, name))


def _scaled(b: GraphBuilder, x: ir.Value, scale: float | None) -> ir.Value:
    return b.op("Mul", [x, b.scalar(scale)]) if scale is not None and scale != 1.0 else x


def _gated_qkv_parts(arch: Architecture, cfg: ModelConfig, i: int) -> list[WeightPart]:
    """[q | k | v | gate] rows of a gated attention (qwen3_next / qwen3_5): q_proj holds each head's
    query then its gate, head after head; they are regrouped as all queries, then all gates."""
    q, k, v = arch.qkv_parts(i)
    d = cfg.head_dim
    heads = range(cfg.num_heads)
    return ([WeightPart(q.name, rows=(2 * h * d, 2 * h * d + d)) for h in heads] + [k, v]
            + [WeightPart(q.name, rows=(2 * h * d + d, 2 * h * d + 2 * d)) for h in heads])


def projected_parts(arch: Architecture, cfg: ModelConfig, i: int, suffix: str = "weight") -> list[WeightPart]:
    """What layer ``i`` projects: q, k and v; q and k where its values are its keys; q alone where it attends over
    another layer's keys and values (gemma4)."""
    parts = arch.qkv_parts(i, suffix)
    if cfg.kv_source(i) != i:
        return parts[:1]
    return parts[:2] if cfg.value_is_key(i) else parts


def attention_weights(b: GraphBuilder, arch: Architecture, cfg: ModelConfig, i: int) -> AttentionWeights:
    names = arch.names(i)
    if cfg.attention_output_gate:
        if cfg.attention_bias:
            raise ExportError(f"{cfg.architecture} with attention_bias is not supported: no such checkpoint is known")
        return AttentionWeights(
            qkv=b.packed_weight(f"{arch.layer_prefix(i)}.self_attn.qkv_gate_proj.weight", _gated_qkv_parts(arch, cfg, i)),
            o=b.weight(f"{names['o']}.weight"),
            q_norm=norm_weight(b, arch, names["q_norm"]), k_norm=norm_weight(b, arch, names["k_norm"]),
            output_gate=True,
        )
    qk_norm = arch.qk_norm or bool(arch.qk_norm_key and getattr(cfg.hf_config, arch.qk_norm_key, False))
    unit = None
    if cfg.weightless_qk_norm and cfg.uses_rope(i):  # llama4_text: an RMSNorm without a weight, on rotary layers
        unit = b.constant(np.ones(cfg.head_dim, dtype=b.dtype.numpy()), f"qk_norm.unit.{cfg.head_dim}")
    qkv_bias = None
    if arch.qkv_bias or cfg.attention_bias:
        bias_parts = projected_parts(arch, cfg, i, "bias")
        if all(b.has_weight(p.name) for p in bias_parts):
            qkv_bias = _packed_weight(b, bias_parts)
    own_kv = cfg.kv_source(i) == i
    return AttentionWeights(
        qkv=_packed_weight(b, projected_parts(arch, cfg, i)),
        o=b.weight(f"{names['o']}.weight"),
        qkv_bias=qkv_bias,
        o_bias=_optional(b, f"{names['o']}.bias") if cfg.attention_bias else None,
        q_norm=norm_weight(b, arch, names["q_norm"]) if qk_norm else unit,
        k_norm=(norm_weight(b, arch, names["k_norm"]) if qk_norm else unit) if own_kv else None,
        qk_norm_per_head=arch.qk_norm_per_head,
        sinks=b.weight(f"{arch.layer_prefix(i)}.self_attn.{arch.attention_sinks}") if arch.attention_sinks else None,
        value_is_key=cfg.value_is_key(i),
        v_norm=(b.constant(np.ones(cfg.head_dim, dtype=b.dtype.numpy()), f"v_norm.unit.{cfg.head_dim}")
                if cfg.value_norm and own_kv else None),
    )


def latent_weights(b: GraphBuilder, arch: Architecture, cfg: ModelConfig, i: int) -> LatentWeights:
    """deepseek_v3's attention tensors (components/latent_attention.py): q_a_proj and kv_a_proj_with_mqa packed into
    one projection of the input, kv_b_proj's key and value rows stacked per head."""
    lat, attn = cfg.latent, f"{arch.layer_prefix(i)}.self_attn"
    downs = ([f"{attn}.q_a_proj"] if lat.q_rank else []) + [f"{attn}.kv_a_proj_with_mqa"]
    down_bias = None
    if cfg.attention_bias:
        down_bias = b.packed_weight(f"{attn}.q_kv_a_proj.bias", [WeightPart(f"{d}.bias") for d in downs])
    kv_b, width = f"{attn}.kv_b_proj.weight", lat.nope_dim + lat.value_dim

    def per_head(name: str, start: int, length: int) -> ir.Value:
        return b.stacked_weight(f"{attn}.kv_b_proj.{name}", [WeightPart(kv_b, rows=(h * width + start, h * width + start + length))
                                                           for h in range(cfg.num_heads)], experts=cfg.num_heads)

    return LatentWeights(
        down=b.packed_weight(f"{attn}.q_kv_a_proj.weight", [WeightPart(f"{d}.weight") for d in downs]),
        kv_norm=norm_weight(b, arch, f"{attn}.kv_a_layernorm.weight"),
        absorb_k=per_head("absorb_k", 0, lat.nope_dim), expand_v=per_head("expand_v", lat.nope_dim, lat.value_dim),
        o=b.weight(f"{attn}.o_proj.weight"),
        q_up=b.weight(f"{attn}.q_b_proj.weight" if lat.q_rank else f"{attn}.q_proj.weight"),
        q_norm=norm_weight(b, arch, f"{attn}.q_a_layernorm.weight") if lat.q_rank else None,
        down_bias=down_bias, o_bias=_optional(b, f"{attn}.o_proj.bias") if cfg.attention_bias else None,
    )


def ungated_mlp(b: GraphBuilder, h: ir.Value, arch: Architecture, cfg: ModelConfig, i: int) -> ir.Value:
    """down(act(up(h))): apertus's xIELU, its four scalars read from the checkpoint (mlp.act_fn.*)."""
    up, = arch.gate_up_parts(i)
    down = b.weight(f"{arch.names(i)['down']}.weight")
    if cfg.hidden_act != "xielu":
        raise ExportError(f"an ungated {cfg.hidden_act} MLP is not built: no such {cfg.architecture} checkpoint is known")
    act = f"{arch.layer_prefix(i)}.mlp.act_fn"
    alpha_p, alpha_n, beta, eps = (float(np.asarray(b.checkpoint.array(f"{act}.{t}"), dtype=np.float64).reshape(-1)[0])
                                   for t in ("alpha_p", "alpha_n", "beta", "eps"))
    softplus = lambda v: float(np.logaddexp(0.0, v))  # noqa: E731
    return linear(b, xielu(b, linear(b, h, b.weight(up.name)), softplus(alpha_p), beta + softplus(alpha_n), beta, eps),
                  down)


def _mup_vector(b: GraphBuilder, cfg: ModelConfig) -> ir.Value | None:
    """falcon_h1's Mamba2 projection scales, one per output row: z, x (inner each), B, C (groups x d_state
    each), dt (heads); None for the other families."""
    if "ssm" not in cfg.multipliers or all(m == 1.0 for m in cfg.multipliers["ssm"]):
        return None
    rc = cfg.recurrent
    widths = (rc.value_heads * rc.value_dim,) * 2 + (rc.key_heads * rc.key_dim,) * 2 + (rc.value_heads,)
    vector = np.concatenate([np.full(n, m, np.float32) for n, m in zip(widths, cfg.multipliers["ssm"])])
    return b.constant(vector.astype(b.dtype.numpy()), "falcon_h1_mup_vector")


def _parallel_mixers(b: GraphBuilder, h: ir.Value, arch: Architecture, cfg: ModelConfig, i: int, variant: Variant,
                     step: StepInputs, cache: tuple[ir.Value, ...]) -> tuple[ir.Value, tuple[ir.Value, ...]]:
    """falcon_h1's layer ``i``: attention and Mamba2 on the same normed ``h``, each with its muP multipliers,
    added; ``cache`` (key, value, conv, ssm) in, the same out."""
    m = cfg.multipliers
    weights = attention_weights(b, arch, cfg, i)
    if m.get("key", 1.0) != 1.0:
        scale = np.concatenate([np.ones(cfg.q_size, np.float32), np.full(cfg.kv_size, m["key"], np.float32),
                                np.ones(cfg.kv_size, np.float32)])
        weights = dataclasses.replace(weights, qkv_scale=b.constant(scale.astype(b.dtype.numpy()), "falcon_h1_key_scale"))
    attn_out, key_out, value_out = ATTENTION[variant](b, _scaled(b, h, m.get("attention_in")), weights, cfg, step,
                                                      *cache[:2])
    ssm_out, states = recurrent_mixer(b, _scaled(b, h, m.get("ssm_in")), arch, cfg, i, step, cache[2:])
    out = b.op("Add", [_scaled(b, attn_out, m.get("attention_out")), _scaled(b, ssm_out, m.get("ssm_out"))])
    return out, (key_out, value_out, *states)


def recurrent_mixer(b: GraphBuilder, h: ir.Value, arch: Architecture, cfg: ModelConfig, i: int, step: StepInputs,
                    states: tuple[ir.Value, ...]) -> tuple[ir.Value, tuple[ir.Value, ...]]:
    """A hybrid's recurrent layer ``i`` on ``h``: (its output, its states after the step)."""
    rc, name = cfg.recurrent, lambda t: arch.recurrent_name(i, t)  # noqa: E731
    if rc.kind == GATED_DELTANET:
        f32 = ir.DataType.FLOAT
        qkvz, ba = arch.deltanet_in_parts(i, rc.key_heads, rc.value_heads, rc.key_dim, rc.value_dim)
        weights = DeltaNetWeights(
            in_proj=b.packed_weight(name("in_proj_qkvz.weight"), qkvz),
            gates=b.packed_weight(name(DELTANET_GATES), ba),
            conv=b.weight(name("conv1d.weight")), a_log=b.weight(name("A_log"), dtype=f32),
            dt_bias=b.weight(name("dt_bias"), dtype=f32), norm=b.weight(name("norm.weight")),
            out=b.weight(name("out_proj.weight")))
        out, conv_state, recurrent_state = gated_deltanet(b, h, weights, cfg, step.token_mask, *states)
        return out, (conv_state, recurrent_state)
    if rc.kind == MAMBA2:
        f32, proj_bias = ir.DataType.FLOAT, lambda t: _optional(b, name(t))  # noqa: E731 (falcon_h1: in and out apart)
        weights = Mamba2Weights(
            in_proj=b.weight(name("in_proj.weight")), conv=b.weight(name("conv1d.weight")),
            conv_bias=b.weight(name("conv1d.bias")) if rc.conv_bias else None,
            a_log=b.weight(name("A_log"), dtype=f32), dt_bias=b.weight(name("dt_bias"), dtype=f32),
            d=b.weight(name("D")),
            norm=b.weight(name("norm.weight")) if rc.gated_norm != GATE_ONLY else None, out=b.weight(name("out_proj.weight")),
            in_bias=proj_bias("in_proj.bias"), out_bias=proj_bias("out_proj.bias"), in_scale=_mup_vector(b, cfg))
        out, conv_state, ssm_state = mamba2(b, h, weights, cfg, step.token_mask, *states)
        return out, (conv_state, ssm_state)
    biased = (lambda t: b.weight(name(t))) if rc.conv_bias else (lambda t: None)  # noqa: E731
    weights = ShortConvWeights(in_proj=b.weight(name("in_proj.weight")), conv=b.weight(name("conv.weight")),
                               out=b.weight(name("out_proj.weight")), in_bias=biased("in_proj.bias"),
                               conv_bias=biased("conv.bias"), out_bias=biased("out_proj.bias"))
    out, conv_state = short_conv(b, h, weights, cfg, step.token_mask, *states)
    return out, (conv_state,)


def _single_mixer(b: GraphBuilder, h: ir.Value, arch: Architecture, cfg: ModelConfig, i: int, variant: Variant,
                  step: StepInputs, cache: tuple[ir.Value, ...]) -> tuple[ir.Value, tuple[ir.Value, ...]]:
    """nemotron_h's block ``i``: its one mixer on the normed ``h``: (output, caches out: none for an MLP or
    experts block)."""
    if cfg.is_recurrent(i):
        return recurrent_mixer(b, h, arch, cfg, i, step, cache)
    if cfg.is_attention(i):
        out, key_out, value_out = ATTENTION[variant](b, h, attention_weights(b, arch, cfg, i), cfg, step, *cache)
        return out, (key_out, value_out)
    if cfg.layer_types[i] == MOE_BLOCK:
        return moe_mlp(b, h, arch, cfg, i), ()
    up, = arch.gate_up_parts(i)
    return relu2_mlp(b, h, b.weight(up.name), b.weight(f"{arch.names(i)['down']}.weight")), ()


def decoder_layer(
    b: GraphBuilder,
    h: ir.Value,
    x: ir.Value,
    arch: Architecture,
    cfg: ModelConfig,
    i: int,
    variant: Variant,
    step: StepInputs,
    cache: tuple[ir.Value, ...],
    shared_kv: dict[int, SharedKV] | None = None,
) -> tuple[ir.Value, ir.Value, tuple[ir.Value, ...]]:
    """One layer on ``h`` (the normed input; the residual itself for the post-norm layout) and
    the residual stream ``x``; ``cache``: its KV cache (key, value), or a recurrent layer's states;
    ``shared_kv``: where a model whose layers share keys and values (gemma4) keeps each layer's for the later ones.

    Returns (the MLP branch, residual after attention, caches out). The last residual add is left
    to the caller, which fuses it with the next norm (the next layer's input norm, or the final norm).
    """
    names = arch.names(i)
    eps = cfg.rms_norm_eps
    if cfg.single_mixer:
        out, cache_out = _single_mixer(b, h, arch, cfg, i, variant, step, cache)
        return out, x, cache_out
    if cfg.is_recurrent(i) and cfg.is_attention(i):
        attn_out, cache_out = _parallel_mixers(b, h, arch, cfg, i, variant, step, cache)
    elif cfg.is_recurrent(i):
        attn_out, cache_out = recurrent_mixer(b, h, arch, cfg, i, step, cache)
    elif cfg.latent is not None:
        if b.target.contrib_ops:
            raise ExportError("multi-head latent attention (deepseek_v3) is not built for the compat target (older "
                              "onnxruntime): export it without compat")
        attn_out, key_out, value_out = latent_attention(b, h, latent_weights(b, arch, cfg, i), cfg, variant, step, *cache)
        cache_out = (key_out, value_out)
    elif cfg.layer_attention:  # gemma4: attention shapes by layer, the last layers reading earlier layers' K/V
        source = cfg.kv_source(i)
        attn_out, shared_kv[i] = attention_sharing_kv(b, h, attention_weights(b, arch, cfg, i), cfg, variant, step,
                                                      cache, shared_kv[source] if source != i else None)
        cache_out = (shared_kv[i].key, shared_kv[i].value) if source == i else ()
    else:
        attend = attention_compat if b.target.contrib_ops else ATTENTION[variant]  # compat: attn_dynamic only
        attn_out, key_out, value_out = attend(b, h, attention_weights(b, arch, cfg, i), cfg, step, *cache)
        cache_out = (key_out, value_out)
    if arch.norm_layout == SANDWICH:
        attn_out = norm(b, arch, attn_out, names["post_attention_norm"], eps)
        h, x = residual_norm(b, arch, x, attn_out, names["pre_feedforward_norm"], eps)
    elif arch.norm_layout == POST_NORM:
        attn_out = norm(b, arch, attn_out, names["post_attention_norm"], eps)
        x = b.op("Add", [x, _scaled(b, attn_out, cfg.residual_scale)])
        h = x
    elif arch.norm_layout == PARALLEL_BLOCK:  # the MLP reads the same normed input as attention
        x = b.op("Add", [x, attn_out])
    else:
        h, x = residual_norm(b, arch, x, _scaled(b, attn_out, cfg.residual_scale), names["post_attention_norm"], eps)
    experts_beside = cfg.moe is not None and cfg.moe.sparse_layers[i] and cfg.moe.beside_dense_mlp
    if cfg.moe is not None and cfg.moe.sparse_layers[i] and not experts_beside:
        mlp_out = moe_mlp(b, h, arch, cfg, i)
        if arch.shared_mlp:  # granitemoehybrid: a dense MLP beside the experts, added
            mlp_out = b.op("Add", [mlp_out, gated_mlp(b, h, _packed_weight(b, arch.gate_up_parts(i)),
                                                      b.weight(f"{names['down']}.weight"), cfg.intermediate_size)])
    elif arch.ungated_mlp:
        mlp_out = ungated_mlp(b, h, arch, cfg, i)
    else:
        gate_up_bias = _packed_weight(b, arch.gate_up_parts(i, "bias")) if cfg.mlp_bias else None
        down_bias = _optional(b, f"{names['down']}.bias") if cfg.mlp_bias else None
        mlp_out = gated_mlp(
            b, h, _packed_weight(b, arch.gate_up_parts(i)), b.weight(f"{names['down']}.weight"),
            cfg.intermediate_size, gate_up_bias, down_bias, cfg.hidden_act, cfg.multipliers.get("mlp_gate"),
        )
        mlp_out = _scaled(b, mlp_out, cfg.multipliers.get("mlp_down"))
    if experts_beside:  # gemma4: the experts on the residual stream beside the dense MLP, each branch normed, summed
        experts = experts_beside_mlp(b, norm(b, arch, x, names["pre_feedforward_norm_2"], eps), x, arch, cfg, i)
        mlp_out = b.op("Add", [norm(b, arch, mlp_out, names["post_feedforward_norm_1"], eps),
                               norm(b, arch, experts, names["post_feedforward_norm_2"], eps)])
    if arch.norm_layout in (SANDWICH, POST_NORM):
        mlp_out = norm(b, arch, mlp_out, names["post_feedforward_norm"], eps)
    return _scaled(b, mlp_out, cfg.residual_scale), x, cache_out


def _layer_scalar(b: GraphBuilder, arch: Architecture, i: int) -> ir.Value | None:
    """gemma4's layer_scalar, which multiplies the layer's output (None where there is none, or it is 1)."""
    name = arch.names(i).get("layer_scalar")
    if not name or not b.has_weight(name) or np.all(np.asarray(b.checkpoint.array(name), dtype=np.float32) == 1.0):
        return None
    return b.weight(name)


def end_layer(b: GraphBuilder, arch: Architecture, cfg: ModelConfig, i: int, x: ir.Value, mlp_out: ir.Value,
              next_norm: str, per_layer: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """The residual add that ends layer ``i`` and the norm ``next_norm`` after it (the next layer's input norm, or
    the final norm): (normed, residual). One fused kernel, unless gemma4's per-layer input branch (``per_layer``:
    components/per_layer_input.py) and its layer scalar come between them."""
    eps, scalar = cfg.rms_norm_eps, _layer_scalar(b, arch, i)
    if per_layer is None and scalar is None:
        return residual_norm(b, arch, x, mlp_out, next_norm, eps)
    x = b.op("Add", [x, mlp_out])
    if per_layer is not None:
        update = per_layer_update(b, arch, cfg, i, x, per_layer)
        if scalar is None:
            return residual_norm(b, arch, x, update, next_norm, eps)
        x = b.op("Add", [x, update])
    x = b.op("Mul", [x, scalar])
    return norm(b, arch, x, next_norm, eps), x
