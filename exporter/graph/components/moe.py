"""A mixture-of-experts MLP through onnxruntime's fused expert op (com.microsoft MoE; the quantize
pass turns it into QMoE): the router's logits go to the op, which takes the softmax, picks each
token's top k experts and runs only those (docs/moe-design.md has the layouts and what was measured).

- fc1 is ``[experts, 2I, hidden]`` with gate and up rows interleaved (row 2j gate j, 2j + 1 up j,
  ``swiglu_fusion=1``: the only SwiGLU layout the CPU kernels take), fc2 ``[experts, hidden, I]``.
- The op computes softmax over all experts, then the top k, renormalized iff
  ``normalize_routing_weights``: transformers' softmax -> top-k (-> renormalize) of every family here.
- qwen2_moe's shared expert is a dense gated MLP beside the op, scaled by sigmoid(x . gate).
- phimoe: its sparsemixer. For CUDA, where the shape allows, the op's own (``use_sparse_mixer=1``: one
  node); otherwise in the graph (``sparse_mixer``, ~30 small nodes), the op given log weights.
- gpt-oss: a biased router (the op's softmax over all experts then renormalized top k is its softmax
  over the top-k logits), expert biases and the clamped SwiGLU as attributes.
- ernie4_5_moe: softmax scores, experts picked by score + a learned bias (biased_softmax_router), the picked
  scores renormalized by the op; an ungated shared expert.
- deepseek_v2: softmax scores, the picked ones unnormalized and scaled: greedy is the op's own routing
  (normalize_routing_weights 0) times routed_scaling_factor; group_limited_greedy picks in the graph
  (group_limited_router) and scales the op's renormalized output back by the picked scores' sum.
- nemotron_h: ungated relu^2 experts, as the op's SwiGLU with gate = up (each expert's up rows twice,
  interleaved), beta 0 and a steep alpha: up * sigmoid(alpha up) * up is relu(up)^2 to fp32 rounding
  (sigmoid(alpha u) is exactly 0 or 1 in fp32 for |u| > 17 / alpha; below that the difference is under
  u^2 < 3e-10). The CPU kernels have no relu^2, and onnxruntime-gpu 1.31.1's CUDA kernels refuse the op's
  relu2 ("Unsupported MoE activation type"; 1.32's schema lists it for CUDA, not measured here), while this
  form was measured right on both (benchmarks/hybrid_cuda.py relu2_experts_known_answer); its cost is an
  fc1 twice the model's. Grouped sigmoid routing on MoEGroupRouter, then the latent projections and a
  relu^2 shared expert.
- gemma4 (enable_moe_block): experts beside the dense MLP, routed from the residual stream, each picked expert weighted
  by its renormalized softmax score times a learned per-expert scale, GEGLU experts (experts_beside_mlp). onnxruntime's
  MoE computes GEGLU on CUDA only (its CPU kernels refuse it), so the op serves ep cuda and the CPU export computes
  every expert on the tokens routed to it in standard ops.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from exporter.errors import ExportError
from exporter.graph.architectures.base import Architecture
from exporter.graph.components.graph import GraphBuilder, linear, packed
from exporter.graph.components.mlp import gated_mlp, relu2_mlp
from exporter.graph.components.norm import rms_norm
from exporter.graph.config import ModelConfig, MoeConfig
from exporter.packaging.checkpoint import WeightPart

MS_DOMAIN = "com.microsoft"
# nemotron_h's relu^2 experts (above): the SwiGLU alpha that makes the gate a step function.
RELU2_ALPHA = 1e6
# gemma4's experts: GELU-tanh(gate) * up, the op's "geglu" (CUDA kernels only), over fc1 rows [gate | up] as the
# checkpoint stores them (swiglu_fusion 2). The model metadata's moe.activation names it (the expert gate reads it).
GEGLU = "geglu"


@functools.cache
def cuda_geglu() -> bool:
    """Whether this onnxruntime's MoE has the CUDA GEGLU kernel: its schema names "geglu" from 1.32 on; onnxruntime-gpu
    1.31.1, the newest on PyPI, has none (a session with it fails). Where it has none, a cuda export takes the
    standard-op form every other EP takes (experts_beside_mlp), and the re-export an onnxruntime upgrade brings picks
    the fused one up."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    schema = next((s for s in ort_state.get_all_operator_schema() if s.name == "MoE" and s.domain == "com.microsoft"),
                  None)
    attribute = schema.attributes.get("activation_type") if schema is not None else None
    return attribute is not None and GEGLU in attribute.description


def expert_attributes(top_k: int, normalize: bool, alpha: float | None = None, limit: float | None = None,
                      relu2: bool = False, geglu: bool = False) -> dict:
    """The MoE op's attributes for this routing, every one stated (the op's defaults are relu,
    k = 1, no fusion). gpt-oss's clamped SwiGLU is ``alpha`` with beta 1 (its up + 1) and ``limit``;
    ``relu2`` (nemotron_h): relu^2 as a SwiGLU of gate = up (module docstring); ``geglu`` (gemma4): GELU-tanh(gate)
    * up over [gate | up] rows."""
    attrs = {"k": top_k, "activation_type": "swiglu", "swiglu_fusion": 1, "normalize_routing_weights": int(normalize)}
    if geglu:
        attrs.update(activation_type=GEGLU, swiglu_fusion=2)
    elif relu2:
        attrs.update(activation_alpha=RELU2_ALPHA, activation_beta=0.0)
    elif alpha is not None:
        attrs.update(activation_alpha=float(alpha), activation_beta=1.0)
    if limit is not None:
        attrs["swiglu_limit"] = float(limit)
    return attrs


# onnxruntime's CUDA sparse mixer (contrib_ops/cuda/moe, sparse_mixer_top2): two experts, a kernel for
# 8 and for 16 experts only, the threshold a constant 0.01 (Phi-3.5-MoE's router_jitter_noise). The
# CPU kernels accept the attribute and ignore it, and so does CUDA's QMoE (known answer, onnxruntime-gpu
# 1.31.1: plain softmax top 2; h200/moe_cuda_gates_phimoe_sparse_mixer.json), so it is for float
# experts on CUDA only. Measured against transformers' sparsemixer on the H200, fp16, 16 experts: every
# row right, including rows whose logits are all below -1 (h200/moe_sparse_mixer_cuda.json).
CUDA_SPARSE_MIXER_EXPERTS = (8, 16)
CUDA_SPARSE_MIXER_EPS = 0.01
# The model metadata's moe.routing for such an export (validation and the expert gate read it).
ROUTING_CUDA_SPARSE_MIXER = "cuda_sparse_mixer"


def fused_sparse_mixer(moe: MoeConfig | None, ep: str, quantized: bool) -> bool:
    """phimoe's sparsemixer as the op's own (one node) rather than in the graph: float experts on
    CUDA, where the kernel computes exactly this model's routing."""
    return (ep == "cuda" and not quantized and moe is not None and moe.sparse_mixer_eps is not None
            and moe.num_experts in CUDA_SPARSE_MIXER_EXPERTS
            and abs(moe.sparse_mixer_eps - CUDA_SPARSE_MIXER_EPS) <= 1e-9 * CUDA_SPARSE_MIXER_EPS)


def moe_metadata(moe: MoeConfig, fused_mixer: bool) -> dict:
    """The routing the export's expert op is given, as model metadata (the expert gate probes it)."""
    if fused_mixer:
        return {"experts": moe.num_experts, "top_k": 2, "normalize": False, "routing": ROUTING_CUDA_SPARSE_MIXER}
    return {"experts": moe.num_experts, "top_k": moe.top_k, "normalize": moe.op_normalize,
            **({"activation": GEGLU} if moe.beside_dense_mlp else {})}


def experts_op(b: GraphBuilder, x: ir.Value, logits: ir.Value, fc1: ir.Value, fc2: ir.Value, top_k: int,
               normalize: bool, fc1_bias: ir.Value | None = None, fc2_bias: ir.Value | None = None,
               alpha: float | None = None, limit: float | None = None, sparse_mixer: bool = False,
               relu2: bool = False, geglu: bool = False) -> ir.Value:
    """The fused op on [tokens or batch x seq, hidden] and the router's raw logits [tokens, experts]."""
    attrs = expert_attributes(top_k, normalize, alpha, limit, relu2, geglu)
    if sparse_mixer:
        attrs["use_sparse_mixer"] = 1
    return b.op("MoE", [x, logits, fc1, fc1_bias, fc2, fc2_bias], attrs, domain=MS_DOMAIN)


def moe_mlp(b: GraphBuilder, x: ir.Value, arch: Architecture, cfg: ModelConfig, i: int) -> ir.Value:
    """Layer ``i``'s experts (and shared expert) on ``x`` [batch, seq, hidden] -> [batch, seq, hidden]."""
    moe = cfg.moe
    fc1_parts, fc2_parts = arch.expert_parts(i, moe.num_experts, moe.expert_intermediate, has=b.has_weight)
    stem = arch.moe_name(i, "experts")
    fc1 = b.stacked_weight(f"{stem}.fc1_gate_up", fc1_parts, experts=moe.num_experts, interleave=arch.expert_interleave)
    fc2 = b.stacked_weight(f"{stem}.fc2_down", fc2_parts, experts=moe.num_experts)
    if moe.sigmoid_routing:  # lfm2_moe, nemotron_h, glm4_moe, deepseek_v3: the bias picks experts, it does not add to the logits
        logits = b.op("Reshape", [linear(b, x, b.weight(arch.router_name(i))), b.ints(-1, moe.num_experts)])
        routing = sigmoid_router(b, logits, b.weight(arch.moe_name(i, arch.router_bias), dtype=ir.DataType.FLOAT),
                                 moe.top_k, moe.groups, moe.topk_group)
        inner = linear(b, x, b.weight(arch.moe_name(i, "fc1_latent_proj.weight"))) if moe.latent else x
        y = experts_op(b, inner, routing, fc1, fc2, moe.top_k, True, relu2=moe.relu2_experts)
        if moe.latent:
            y = linear(b, y, b.weight(arch.moe_name(i, "fc2_latent_proj.weight")))
        y = b.op("Mul", [y, b.scalar(moe.routed_scaling)]) if moe.routed_scaling != 1.0 else y
        if moe.shared_expert_intermediate:  # nemotron_h's relu^2 / deepseek_v3's SwiGLU shared expert, added ungated
            y = b.op("Add", [y, _ungated_shared_expert(b, x, arch, moe, i)])
        return y
    if moe.input_scaled:  # llama4_text: one expert a token, its input scaled by sigmoid(its logit); a shared MLP
        logits = b.op("Reshape", [linear(b, x, b.weight(arch.router_name(i))), b.ints(-1, moe.num_experts)])
        # [tokens, 1], in fp32: onnxruntime's CUDA EP has no bf16 ReduceMax (measured: the session refuses to build)
        wide = b.op("Cast", [logits], {"to": ir.DataType.FLOAT}) if b.dtype != ir.DataType.FLOAT else logits
        score = b.op("Sigmoid", [b.op("ReduceMax", [wide, b.ints(-1)], {"keepdims": 1})])
        if b.dtype != ir.DataType.FLOAT:
            score = b.op("Cast", [score], {"to": b.dtype})
        scaled = b.op("Mul", [b.op("Reshape", [x, b.ints(-1, cfg.hidden_size)]), score])
        # The op picks the same expert (the top logit) and, renormalizing one weight, gives it 1.
        y = b.op("Reshape", [experts_op(b, scaled, logits, fc1, fc2, 1, True), b.op("Shape", [x])])
        return b.op("Add", [y, _ungated_shared_expert(b, x, arch, moe, i)])
    if moe.biased_softmax:  # ernie4_5_moe: the bias picks experts among the softmax scores, then an ungated shared MLP
        logits = b.op("Reshape", [linear(b, x, b.weight(arch.router_name(i))), b.ints(-1, moe.num_experts)])
        bias = b.op("Reshape", [b.weight(arch.moe_name(i, arch.router_bias), dtype=ir.DataType.FLOAT),
                                b.ints(moe.num_experts)])
        y = experts_op(b, x, biased_softmax_router(b, logits, bias, moe.top_k), fc1, fc2, moe.top_k, True)
        if moe.shared_expert_intermediate:
            y = b.op("Add", [y, _ungated_shared_expert(b, x, arch, moe, i)])
        return y
    if moe.scaled_softmax:  # deepseek_v2: unnormalized softmax scores of the picked experts, scaled; a shared expert
        logits = b.op("Reshape", [linear(b, x, b.weight(arch.router_name(i))), b.ints(-1, moe.num_experts)])
        if moe.group_limited:
            log_weights, total = group_limited_router(b, logits, moe.top_k, moe.groups, moe.topk_group)
            y = experts_op(b, x, log_weights, fc1, fc2, moe.top_k, True)
            y = b.op("Mul", [y, b.op("Reshape", [total, b.op("Concat", [b.op("Shape", [x], {"end": -1}), b.ints(1)],
                                                                        {"axis": 0})])])
        else:  # greedy: the op's softmax over every expert, its top k as they are
            y = experts_op(b, x, logits, fc1, fc2, moe.top_k, False)
        y = b.op("Mul", [y, b.scalar(moe.routed_scaling)]) if moe.routed_scaling != 1.0 else y
        return b.op("Add", [y, _ungated_shared_expert(b, x, arch, moe, i)]) if moe.shared_expert_intermediate else y
    router_bias = b.weight(arch.moe_name(i, arch.router_bias)) if arch.router_bias else None
    logits = b.op("Reshape", [linear(b, x, b.weight(arch.router_name(i)), router_bias), b.ints(-1, moe.num_experts)])
    fc1_bias = fc2_bias = None
    if arch.expert_biases:  # [experts, 2I] already in the interleaved row order, [experts, hidden]
        fc1_bias, fc2_bias = (b.weight(arch.moe_name(i, t)) for t in arch.expert_biases)
    if arch.sparse_mixer and b.fused_sparse_mixer:  # unnormalized w1, w2 as the sparsemixer gives them
        return experts_op(b, x, logits, fc1, fc2, 2, False, fc1_bias, fc2_bias, sparse_mixer=True)
    if arch.sparse_mixer:
        log_weights, total = sparse_mixer(b, logits, moe.num_experts, moe.sparse_mixer_eps)
        if b.dtype != ir.DataType.FLOAT:  # computed in fp32 (CUDA has no bf16 ReduceMax / ArgMax), given back as x's
            log_weights, total = (b.op("Cast", [t], {"to": b.dtype}) for t in (log_weights, total))
        y = experts_op(b, x, log_weights, fc1, fc2, 2, True, fc1_bias, fc2_bias)
        return b.op("Mul", [y, b.op("Reshape", [total, b.op("Concat", [b.op("Shape", [x], {"end": -1}), b.ints(1)],
                                                                    {"axis": 0})])])
    y = experts_op(b, x, logits, fc1, fc2, moe.top_k, moe.normalize, fc1_bias, fc2_bias, moe.swiglu_alpha,
                   moe.swiglu_limit)
    if arch.shared_expert and moe.shared_expert_intermediate:
        names = arch.shared_expert_names(i)
        shared = gated_mlp(b, x, packed(b, [b.weight(names["gate"]), b.weight(names["up"])]), b.weight(names["down"]),
                           moe.shared_expert_intermediate)
        gate = b.op("Sigmoid", [linear(b, x, b.weight(names["gate_scale"]))])
        y = b.op("Add", [y, b.op("Mul", [shared, gate])])
    return y


def _ungated_shared_expert(b: GraphBuilder, x: ir.Value, arch: Architecture, moe: MoeConfig, i: int) -> ir.Value:
    """The shared expert added to the routed ones as it is (deepseek_v3, glm4_moe, ernie4_5_moe, llama4_text: a
    SwiGLU MLP; nemotron_h: relu^2), unlike qwen2_moe's, which a sigmoid gate scales."""
    names = arch.shared_expert_names(i)
    if moe.relu2_experts:
        return relu2_mlp(b, x, b.weight(names["up"]), b.weight(names["down"]))
    return gated_mlp(b, x, packed(b, [b.weight(names["gate"]), b.weight(names["up"])]), b.weight(names["down"]),
                     moe.shared_expert_intermediate)


def experts_beside_mlp(b: GraphBuilder, x: ir.Value, residual: ir.Value, arch: Architecture, cfg: ModelConfig,
                       i: int) -> ir.Value:
    """gemma4's experts (enable_moe_block) of layer ``i`` on ``x``, its residual stream through the experts' own input
    norm [batch, seq, hidden], routed from ``residual`` itself (scaled_top_k_router) -> [batch, seq, hidden], before
    their output norm.

    For ep cuda, where this onnxruntime has its kernel (cuda_geglu), the fused MoE op with GEGLU: it renormalizes what it picks, so it is handed log(p * s) at the picked
    experts (p the softmax score, s the per-expert scale; -inf elsewhere), which it turns into p s / sum(p s), and its
    output is scaled back by sum(p s) / sum(p): transformers' p / sum(p) * s. A log needs s > 0, which every expert of
    such an export must have (refused otherwise). Elsewhere (the CPU MoE kernels have no GEGLU) every expert runs on
    the tokens routed to it (_experts_on_their_tokens)."""
    moe, hidden = cfg.moe, cfg.hidden_size
    gate_up, down = (arch.moe_name(i, t) for t in arch.stacked_experts)
    tokens = b.op("Reshape", [x, b.ints(-1, hidden)])
    probs, picked, scaled, total = scaled_top_k_router(b, residual, arch, cfg, i)
    f32 = ir.DataType.FLOAT
    if b.ep == "cuda" and cuda_geglu():
        _require_positive_scales(b, arch.moe_name(i, arch.router_scales[1]))
        stem, experts = arch.moe_name(i, "experts"), moe.num_experts
        fc1 = b.stacked_weight(f"{stem}.fc1_gate_up", [WeightPart(gate_up, expert=e) for e in range(experts)],
                               experts=experts)  # [experts, 2I, hidden], [gate | up] rows as stored: swiglu_fusion 2
        fc2 = b.stacked_weight(f"{stem}.fc2_down", [WeightPart(down, expert=e) for e in range(experts)],
                               experts=experts)
        y = experts_op(b, tokens, _log_weights_at(b, probs, picked, scaled), fc1, fc2, moe.top_k, True, geglu=True)
        back = b.op("Div", [b.op("ReduceSum", [scaled, b.ints(-1)], {"keepdims": 1}), total])
        y = b.op("Mul", [y, b.op("Cast", [back], {"to": b.dtype}) if b.dtype != f32 else back])
    else:
        weights = b.op("Div", [scaled, total])
        y = _experts_on_their_tokens(b, tokens, picked, b.op("Cast", [weights], {"to": b.dtype}) if b.dtype != f32
                                     else weights, gate_up, down, moe, cfg.hidden_act)
    return b.op("Reshape", [y, b.op("Shape", [x])])


def scaled_top_k_router(b: GraphBuilder, residual: ir.Value, arch: Architecture, cfg: ModelConfig, i: int
                        ) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """gemma4's router (transformers' Gemma4TextRouter), in fp32 from its logits on: logits = proj(rms_norm(residual)
    * scale / sqrt(hidden)) (a weightless RMSNorm), p = softmax(logits), the top k of p picked. Returns (p [tokens,
    experts], the picked experts [tokens, k], each picked p times its expert's per_expert_scale [tokens, k], the picked
    p's sum [tokens, 1]): a picked expert's weight is the third over the fourth."""
    moe, f32 = cfg.moe, ir.DataType.FLOAT
    scale, expert_scale = (b.weight(arch.moe_name(i, t)) for t in arch.router_scales)
    normed = rms_norm(b, residual, b.op("Mul", [scale, b.scalar(cfg.hidden_size ** -0.5)]), cfg.rms_norm_eps)
    logits = b.op("Reshape", [linear(b, normed, b.weight(arch.router_name(i))), b.ints(-1, moe.num_experts)])
    wide = b.op("Cast", [logits], {"to": f32}) if b.dtype != f32 else logits
    probs = b.op("Softmax", [wide], {"axis": -1})
    picked, picked_probs = _pick(b, probs, probs, moe.top_k)
    scales = b.op("Cast", [expert_scale], {"to": f32}) if b.dtype != f32 else expert_scale
    scaled = b.op("Mul", [picked_probs, b.op("Gather", [scales, picked], {"axis": 0})])
    return probs, picked, scaled, b.op("ReduceSum", [picked_probs, b.ints(-1)], {"keepdims": 1})


def _require_positive_scales(b: GraphBuilder, name: str) -> None:
    """The fused op weighs experts through a softmax of log weights: every per-expert scale must be positive."""
    scales = np.asarray(b.checkpoint.array(name), dtype=np.float32)
    if not (scales > 0).all():
        raise ExportError(f"{name} holds {int((scales <= 0).sum())} scales <= 0 (smallest {float(scales.min()):.4g}): "
                          "the fused MoE op of an ep cuda export weighs experts through a softmax, which takes "
                          "positive weights only; export it for ep cpu, whose experts are computed in standard ops")


def _experts_on_their_tokens(b: GraphBuilder, tokens: ir.Value, picked: ir.Value, weights: ir.Value, gate_up: str,
                             down: str, moe: MoeConfig, act: str) -> ir.Value:
    """Each expert's gated MLP on the tokens routed to it, mixed by ``weights`` [tokens, k] (in the model dtype) ->
    [tokens, hidden]: exact, in standard ops, with no control flow.

    The tokens are gathered expert by expert (NonZero of the routing, expert-major) and split into one run of rows per
    expert, each through its own MatMuls, so the work and the weights read are the picked experts' only: k / experts
    of a dense form's (every expert on every token, the unpicked weighted by 0), and a decode step reads k experts'
    weights. The price is five nodes an expert, run on no rows by an expert no token picked (128 experts: about 2 ms
    of kernel launches a layer on 2 CPU cores, measured on tiny widths), and at prefill the routed rows twice
    ([tokens * k, hidden], before and after the experts) and their gather back per token ([tokens, k, hidden]) rather
    than any [tokens, experts, ...] tensor. The experts' weights stay 2-D MatMul weights, one pair per expert, which
    the int4 / int8 pass quantizes as it quantizes every linear (MatMulNBits)."""
    experts, width = moe.num_experts, moe.expert_intermediate
    # [tokens, experts]: 1 where a token picked the expert
    none = b.op("Expand", [b.scalar_i64(0), b.op("Concat", [b.op("Shape", [picked], {"end": 1}), b.ints(experts)],
                                                 {"axis": 0})])
    chosen = b.op("ScatterElements", [none, picked, b.op("Expand", [b.scalar_i64(1), b.op("Shape", [picked])])],
                  {"axis": -1})
    # (expert, token) pairs, expert-major and each expert's tokens in order: the rows every expert runs on
    pairs = b.op("NonZero", [b.op("Transpose", [chosen], {"perm": [1, 0]})])
    routed = b.op("Gather", [tokens, b.op("Gather", [pairs, b.scalar_i64(1)], {"axis": 0})], {"axis": 0})
    counts = b.op("ReduceSum", [chosen, b.ints(0)], {"keepdims": 0})  # [experts]: the tokens each expert runs on
    outputs = []
    for e, own in enumerate(b.op_multi("Split", [routed, counts], {"axis": 0}, num_outputs=experts)):
        fc1 = b.weight(f"{gate_up}.{e}", WeightPart(gate_up, expert=e))  # [2I, hidden]: [gate | up]
        fc2 = b.weight(f"{down}.{e}", WeightPart(down, expert=e))  # [hidden, I]
        outputs.append(gated_mlp(b, own, fc1, fc2, width, act=act))
    # The row of (token, expert) among the outputs: the tokens of the experts before it, plus the token's rank among
    # its expert's tokens.
    before = b.op("CumSum", [counts, b.scalar_i64(0)], {"exclusive": 1})
    rank = b.op("Sub", [b.op("CumSum", [chosen, b.scalar_i64(0)]), b.scalar_i64(1)])
    rows = b.op("GatherElements", [b.op("Add", [rank, before]), picked], {"axis": -1})  # [tokens, k]
    mixed = b.op("Gather", [b.op("Concat", outputs, {"axis": 0}), rows], {"axis": 0})  # [tokens, k, hidden]
    return b.op("ReduceSum", [b.op("Mul", [mixed, b.op("Unsqueeze", [weights, b.ints(-1)])]), b.ints(1)],
                {"keepdims": 0})


def sigmoid_router(b: GraphBuilder, logits: ir.Value, expert_bias: ir.Value, top_k: int, groups: int = 1,
                   topk_group: int = 1) -> ir.Value:
    """lfm2_moe's and nemotron_h's routing for the expert op, one com.microsoft MoEGroupRouter: scores
    s = sigmoid(logits); with ``groups`` > 1 only the ``topk_group`` groups whose two best s + expert_bias
    sum highest compete (nemotron_h); the top k of s + expert_bias picked, log(s) at them and a large
    negative elsewhere. The expert op's softmax of that, renormalized over its top k, is s / sum(picked s):
    transformers' weights (it adds 1e-6 or 1e-20 to the sum)."""
    if b.group_router_op:
        return b.op("MoEGroupRouter", [logits, expert_bias],
                    {"top_k": top_k, "n_group": groups, "topk_group": topk_group, "group_topk": 2}, domain=MS_DOMAIN)
    return _sigmoid_router_in_plain_ops(b, logits, expert_bias, top_k, groups, topk_group)


def _sigmoid_router_in_plain_ops(b: GraphBuilder, logits: ir.Value, expert_bias: ir.Value, top_k: int, groups: int,
                                 topk_group: int) -> ir.Value:
    """MoEGroupRouter's computation in standard ops (fp32), for runtimes without its kernel: onnxruntime-gpu 1.31.1
    (the newest onnxruntime-gpu on PyPI; its CUDA EP has no MoEGroupRouter) and transformers.js's onnxruntime-node
    1.30. A group's score is the sum of its two best biased scores; experts outside the best topk_group groups
    are masked before the top k."""
    f32 = ir.DataType.FLOAT
    wide = b.op("Cast", [logits], {"to": f32}) if b.dtype != f32 else logits
    scores = b.op("Sigmoid", [wide])
    choice = b.op("Add", [scores, expert_bias])
    if groups > 1:
        experts_shape = b.op("Shape", [choice])
        grouped = b.op("Reshape", [choice, b.ints(0, groups, -1)])  # [tokens, groups, experts / groups]
        best_two, _ = b.op_multi("TopK", [grouped, b.ints(2)], {"axis": -1}, num_outputs=2)
        _, kept = b.op_multi("TopK", [b.op("ReduceSum", [best_two, b.ints(-1)], {"keepdims": 0}), b.ints(topk_group)],
                             {"axis": -1}, num_outputs=2)  # [tokens, topk_group]
        group_ids = b.op("Range", [b.scalar_i64(0), b.scalar_i64(groups), b.scalar_i64(1)])
        # [tokens, groups]: whether each group is among the kept ones
        in_kept = b.op("ReduceMax", [b.op("Cast", [b.op("Equal", [b.op("Unsqueeze", [kept, b.ints(-1)]), group_ids])],
                                          {"to": ir.DataType.INT32}), b.ints(1)], {"keepdims": 0})
        mask = b.op("Expand", [b.op("Unsqueeze", [b.op("Cast", [in_kept], {"to": ir.DataType.BOOL}), b.ints(-1)]),
                               b.op("Shape", [grouped])])
        choice = b.op("Where", [b.op("Reshape", [mask, experts_shape]), choice, b.scalar_f32(float("-inf"))])
    return _picked_log_weights(b, scores, choice, top_k)


def group_limited_router(b: GraphBuilder, logits: ir.Value, top_k: int, groups: int,
                         topk_group: int) -> tuple[ir.Value, ir.Value]:
    """deepseek_v2's group_limited_greedy, in fp32: p = softmax(logits); only experts in the ``topk_group`` groups whose
    best p is highest compete; the top k of those picked, each weighted by its p unnormalized. The op renormalizes
    what it is given, so it gets log(p) at the picked experts (-inf elsewhere) and the output is scaled back by the
    picked p's sum: returns (those log weights in the model dtype, the sum [tokens, 1] in it)."""
    f32 = ir.DataType.FLOAT
    wide = b.op("Cast", [logits], {"to": f32}) if b.dtype != f32 else logits
    probs = b.op("Softmax", [wide], {"axis": -1})
    grouped = b.op("Reshape", [probs, b.ints(0, groups, -1)])  # [tokens, groups, experts / groups]
    group_best = b.op("ReduceMax", [grouped, b.ints(-1)], {"keepdims": 1})  # [tokens, groups, 1]
    kept_scores, _ = b.op_multi("TopK", [b.op("Squeeze", [group_best, b.ints(-1)]), b.ints(topk_group)], {"axis": -1},
                                num_outputs=2)
    # A group is kept when its best score reaches the topk_group-th best (ties as transformers' TopK breaks them
    # aside: scores of independent softmax logits do not tie).
    threshold = b.op("Unsqueeze", [b.op("ReduceMin", [kept_scores, b.ints(-1)], {"keepdims": 1}), b.ints(-1)])
    kept = b.op("Expand", [b.op("GreaterOrEqual", [group_best, threshold]), b.op("Shape", [grouped])])
    # transformers masks the dropped groups' scores to 0 before its top k; -inf ranks them last the same way.
    choice = b.op("Reshape", [b.op("Where", [kept, grouped, b.scalar_f32(float("-inf"))]), b.op("Shape", [probs])])
    picked, picked_scores = _pick(b, probs, choice, top_k)
    total = b.op("ReduceSum", [picked_scores, b.ints(-1)], {"keepdims": 1})
    return (_log_weights_at(b, probs, picked, picked_scores),
            b.op("Cast", [total], {"to": b.dtype}) if b.dtype != f32 else total)


def biased_softmax_router(b: GraphBuilder, logits: ir.Value, expert_bias: ir.Value, top_k: int) -> ir.Value:
    """ernie4_5_moe's routing for the expert op, in fp32: p = softmax(logits), the top k of p + expert_bias
    picked, log(p) at them and -inf elsewhere. The op's softmax of that, renormalized over its top k, is
    p / sum(picked p): transformers' weights (its clamp of the sum at 1e-12 never binds for k >= 1)."""
    f32 = ir.DataType.FLOAT
    wide = b.op("Cast", [logits], {"to": f32}) if b.dtype != f32 else logits
    probs = b.op("Softmax", [wide], {"axis": -1})
    return _picked_log_weights(b, probs, b.op("Add", [probs, expert_bias]), top_k)


def _picked_log_weights(b: GraphBuilder, scores: ir.Value, choice: ir.Value, top_k: int) -> ir.Value:
    """The expert op's router input for a routing computed in the graph (fp32 ``scores`` and the ``choice`` values
    that pick, [tokens, experts]): log(score) at the top k of choice, -inf elsewhere, in the model dtype. The op's
    softmax of it, renormalized over its top k, is each picked score over their sum."""
    return _log_weights_at(b, scores, *_pick(b, scores, choice, top_k))


def _pick(b: GraphBuilder, scores: ir.Value, choice: ir.Value, top_k: int) -> tuple[ir.Value, ir.Value]:
    """The top k of ``choice`` per token: (their expert indices, their ``scores``), [tokens, top_k] each."""
    _, picked = b.op_multi("TopK", [choice, b.ints(top_k)], {"axis": -1}, num_outputs=2)
    return picked, b.op("GatherElements", [scores, picked], {"axis": -1})


def _log_weights_at(b: GraphBuilder, scores: ir.Value, picked: ir.Value, picked_scores: ir.Value) -> ir.Value:
    floor = b.op("Expand", [b.scalar_f32(float("-inf")), b.op("Shape", [scores])])
    weights = b.op("ScatterElements", [floor, picked, b.op("Log", [picked_scores])], {"axis": -1})
    return b.op("Cast", [weights], {"to": b.dtype}) if b.dtype != ir.DataType.FLOAT else weights


def sparse_mixer(b: GraphBuilder, logits: ir.Value, experts: int, eps: float) -> tuple[ir.Value, ir.Value]:
    """phimoe's sparsemixer at inference, on the router's logits S [tokens, experts]:

    1. the first expert i1 = argmax S; entries with (max - S) / max(|S|, max) > 2 eps are masked, and
       its weight w1 is the softmax of the rest at i1;
    2. the second i2 = argmax of S without i1, masked by the same rule against the second maximum
       (over the original |S|), its weight w2 that softmax at i2. The two weights are not normalized.

    The fused ops take logits and renormalize their top k, so they are given log w1 and log w2 at
    the chosen experts and -inf elsewhere (their softmax is w / (w1 + w2), renormalizing changes
    nothing) and the output is scaled back by w1 + w2: returns (those logits, w1 + w2 [tokens, 1]), in
    fp32 whatever the model's dtype (the routing decisions as fp32 makes them)."""
    f32 = ir.DataType.FLOAT

    def wide(value):
        return b.op("Cast", [value], {"to": f32}) if b.dtype != f32 else value

    ninf, two_eps, logits = b.scalar_f32(float("-inf")), b.scalar_f32(2 * eps), wide(logits)
    magnitude = b.op("Abs", [logits])
    ids = b.op("Unsqueeze", [b.op("Range", [b.scalar_i64(0), b.scalar_i64(experts), b.scalar_i64(1)]), b.ints(0)])

    def pick(scores):
        top = b.op("ReduceMax", [scores, b.ints(-1)], {"keepdims": 1})
        index = b.op("ArgMax", [scores], {"axis": -1, "keepdims": 1})
        masked = b.op("Greater", [b.op("Div", [b.op("Sub", [top, logits]), b.op("Max", [magnitude, top])]), two_eps])
        probs = b.op("Softmax", [b.op("Where", [masked, ninf, scores])], {"axis": -1})
        chosen = b.op("Equal", [ids, index])  # [tokens, experts], one true per row
        return chosen, b.op("GatherElements", [probs, index], {"axis": -1})

    first, w1 = pick(logits)
    second, w2 = pick(b.op("Where", [first, ninf, logits]))
    log_weights = b.op("Where", [first, b.op("Log", [w1]), b.op("Where", [second, b.op("Log", [w2]), ninf])])
    return log_weights, b.op("Add", [w1, w2])
