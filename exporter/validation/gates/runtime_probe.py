"""Runtime probe: a known-answer run of the export's own attention pattern on the target EP.

The probe graph is built by the same attention core an export's layers use
(``exporter.graph.components.attention.static_core`` / ``dynamic_core`` / ``gqa_core``, and the
task's mask and length helpers), so it runs exactly the ops, attributes (``q_num_heads`` /
``kv_num_heads``, ``is_causal``, the scatter axis) and layouts (BSNH caches for attn_static) that
ship, at a tiny size: 2 query heads over 1 KV head of 16, one decode step over a cache whose valid
slots 0 and 1 hold values 1 and 3 while this step adds a third with value 5.

With an all-zero query every visible key scores the same, so the right answer is the mean of the
three values, 3. An ORT that aligns causality top-left (attn_static's classic failure) lets the
query see slot 0 only, 1; anything else is some other bug. The EP must run the graph itself: CPU
fallback is disabled, so a silent fall back to CPU is caught too.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import onnx_ir as ir

from exporter.contract import DTYPES
from exporter.graph.components.attention import StepInputs, compat_core, dynamic_core, gqa_core, static_core
from exporter.graph.components.graph import GraphBuilder
from exporter.graph.components.rotary import Rotary
from exporter.graph.target import COMPAT, CURRENT
from exporter.graph.task import attention_bias, causal_padding_mask, gqa_lengths
from exporter.request import Variant
from exporter.runtime.session import PROVIDER_NAMES, run_bound
from exporter.validation.gates import GateResult

EXPECTED = 3.0
TOP_LEFT_ANSWER = 1.0
CACHED_VALUES = (1.0, 3.0)  # slots written by earlier steps
NEW_VALUE = 5.0  # this step's key/value
SLOTS = 4  # static buffer
NONPAD_AFTER_SCATTER = 3  # tokens cached after this step's scatter (slots 0, 1 and the new slot 2)


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """The few config fields the attention cores read."""

    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 16
    attention_scale: float | None = None
    attention_softcap: float | None = None


SHAPE = ProbeShape()


class ProbeOutcome(str, enum.Enum):
    SUPPORTED = "supported"
    WRONG_RESULT = "wrong-result"
    MISSING = "missing"  # the EP is not available in this onnxruntime
    ERROR = "error"  # the EP is there but could not build or run the pattern


def _input(name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))


def probe_graph(variant: Variant, dtype: str, packed_qkv: bool = False,
                compat: bool = False) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """The probe model for ``variant`` in ``dtype`` and its feeds (one decode step after two tokens);
    ``packed_qkv``: GroupQueryAttention fed one packed QKV input, as exports without q/k norm are;
    ``compat``: attn_dynamic as the compat target builds it (graph/target.py)."""
    variant, entry = Variant(variant), DTYPES[dtype]
    h, kv, d = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    target = COMPAT if compat else CURRENT
    b = GraphBuilder(None, entry.ir, target=target)
    i64 = ir.DataType.INT64
    q, k, v = _input("q", entry.ir, [1, 1, h * d]), _input("k", entry.ir, [1, 1, kv * d]), _input("v", entry.ir, [1, 1, kv * d])
    zeros = lambda *shape: np.zeros(shape, entry.numpy)  # noqa: E731
    feeds = {"q": zeros(1, 1, h * d), "k": zeros(1, 1, kv * d), "v": np.full((1, 1, kv * d), NEW_VALUE, entry.numpy)}
    step = StepInputs(rotary=Rotary(None, None, d, d))
    if variant is Variant.ATTN_STATIC:
        caches = [_input(n, entry.ir, [1, SLOTS, kv * d]) for n in ("key_cache", "value_cache")]
        step.write_indices, step.nonpad_kv_seqlen = _input("write_indices", i64, [1]), _input("nonpad_kv_seqlen", i64, [1])
        y, _, _ = static_core(b, q, k, v, SHAPE, step, *caches)
        inputs = [q, k, v, *caches, step.write_indices, step.nonpad_kv_seqlen]
        value_cache = zeros(1, SLOTS, kv * d)
        value_cache[0, 0], value_cache[0, 1] = CACHED_VALUES
        feeds.update(key_cache=zeros(1, SLOTS, kv * d), value_cache=value_cache,
                     write_indices=np.array([2], np.int64), nonpad_kv_seqlen=np.array([NONPAD_AFTER_SCATTER], np.int64))
    else:
        past = [_input(n, entry.ir, [1, kv, 2, d]) for n in ("past_key", "past_value")]
        mask = _input("attention_mask", i64, [1, 3])
        past_value = zeros(1, kv, 2, d)
        past_value[:, :, 0], past_value[:, :, 1] = CACHED_VALUES
        feeds.update(past_key=zeros(1, kv, 2, d), past_value=past_value, attention_mask=np.ones((1, 3), np.int64))
        if variant is Variant.GQA:
            gqa_lengths(b, mask, step)
            # Rotary inside the op, as exports do; cos 1 / sin 0 is no rotation, so the answer stays 3.
            step.rotary.cos = b.constant(np.ones((8, d // 2), entry.numpy), "probe_cos")
            step.rotary.sin = b.constant(np.zeros((8, d // 2), entry.numpy), "probe_sin")
            if packed_qkv:
                qkv = _input("qkv", entry.ir, [1, 1, (h + 2 * kv) * d])
                y, _, _ = gqa_core(b, qkv, None, None, SHAPE, step, *past)
                inputs = [qkv, *past, mask]
                feeds["qkv"] = np.concatenate([feeds.pop("q"), feeds.pop("k"), feeds.pop("v")], axis=-1)
            else:
                y, _, _ = gqa_core(b, q, k, v, SHAPE, step, *past)
                inputs = [q, k, v, *past, mask]
        else:
            input_ids = _input("input_ids", i64, [1, 1])
            step.attn_mask = causal_padding_mask(b, input_ids, mask)
            if compat:
                step.attn_mask = attention_bias(b, step.attn_mask, h)
            y, _, _ = (compat_core if compat else dynamic_core)(b, q, k, v, SHAPE, step, *past)
            inputs = [q, k, v, *past, mask, input_ids]
            feeds["input_ids"] = np.zeros((1, 1), np.int64)
    y.name, y.type, y.shape = "y", ir.TensorType(entry.ir), ir.Shape([1, 1, h * d])
    graph = ir.Graph(inputs, [y], nodes=b.tape.nodes, initializers=b.tape.initializers,
                     opset_imports={"": target.opset, "com.microsoft": 1}, name=f"probe_{variant.value}")
    return ir.Model(graph, ir_version=target.ir_version), feeds


def probe(variant: Variant, ep: str, dtype: str, packed_qkv: bool = False, compat: bool = False) -> tuple[ProbeOutcome, str]:
    """Classify ``ep`` for ``variant``'s attention pattern in ``dtype``, with a sentence saying why."""
    import onnxruntime as ort

    provider = PROVIDER_NAMES[ep]
    if provider not in ort.get_available_providers():
        return ProbeOutcome.MISSING, f"{provider} is not in this onnxruntime ({ort.__version__}) build"
    model, feeds = probe_graph(variant, dtype, packed_qkv, compat)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if ep != "cpu":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        if ep == "cuda" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        from exporter.runtime.device import cuda_provider

        chosen = cuda_provider() if ep == "cuda" else provider  # the device this worker is bound to
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=[chosen])
        out = np.empty((1, 1, SHAPE.num_heads * SHAPE.head_dim), DTYPES[dtype].numpy)
        got = run_bound(session, feeds, {"y": out})["y"].astype(np.float32)
    except Exception as err:  # any failure to build or run is a classification, not a crash
        return ProbeOutcome.ERROR, f"{provider} could not run the {Variant(variant).value} attention pattern in {dtype}: {err}"
    return classify_probe_output(got)


def classify_probe_output(got: np.ndarray) -> tuple[ProbeOutcome, str]:
    if np.allclose(got, EXPECTED, atol=1e-2):
        return ProbeOutcome.SUPPORTED, f"one decode step gave {EXPECTED} as expected"
    what = "top-left causal alignment" if np.allclose(got, TOP_LEFT_ANSWER, atol=1e-2) else "an unexpected value"
    return ProbeOutcome.WRONG_RESULT, f"expected {EXPECTED}, got {float(got.flat[0]):.4g} ({what})"


def runtime_gate(variant: str, ep: str, dtype: str, packed_qkv: bool = False, compat: bool = False) -> GateResult:
    """The probe of the export's own attention pattern as a gate, for every variant (and the compat target)."""
    outcome, message = probe(Variant(variant), ep, dtype, packed_qkv, compat)
    return GateResult(
        gate="runtime", check=f"{variant}{' (compat)' if compat else ''} attention known answer on {ep} ({dtype})",
        passed=outcome is ProbeOutcome.SUPPORTED, measured=outcome.value, threshold=ProbeOutcome.SUPPORTED.value,
        message=message,
    )


# The experts' known answer: 4 experts, hidden and expert width 64, every input 1. Expert e's gate
# rows are all GATES[e] / 64 and its up rows 1 / 64, so its SwiGLU gives GATES[e] * sigmoid(GATES[e]);
# its down rows are 1 / 64, so every output element is that value. The router logits pick experts 0
# and 1; their mix is the softmax over all four, renormalized over the two or not. Every weight is
# one value per quantization block: int4 and int8 hold it exactly.
EXPERT_GATES = (1.0, 2.0, 3.0, 4.0)
EXPERT_LOGITS = (2.0, 1.0, 0.0, -1.0)
EXPERT_WIDTH = 64  # CUDA's QMoE takes widths in multiples of 64


# The same experts for CUDA's sparse mixer (8 experts, the kernel's smallest): experts 0 and 1 lie within
# its threshold (2 x 0.01 of the max) and the rest outside, so the sparsemixer weighs expert 0 by the
# softmax over the two (~0.5025) and expert 1 by 1; softmax top-2 would give something else.
MIXER_GATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
MIXER_LOGITS = (2.0, 1.99, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0)
MIXER_EPS = 0.01


def sparse_mixer_weights(logits, eps: float) -> tuple[list[int], list[float]]:
    """phimoe's sparsemixer at inference on one row: the two experts and their (unnormalized) weights."""
    s = np.asarray(logits, np.float64)
    chosen, weights, scores = [], [], s.copy()
    for _ in range(2):
        top, index = scores.max(), int(scores.argmax())
        masked = (top - s) / np.maximum(np.abs(s), top) > 2 * eps
        row = np.where(masked, -np.inf, scores)
        weights.append(float(np.exp(row[index] - top) / np.exp(row - top).sum()))
        chosen.append(index)
        scores = scores.copy()
        scores[index] = -np.inf
    return chosen, weights


def expert_answer(top_k: int, normalize: bool, sparse_mixer: bool = False, geglu: bool = False) -> float:
    """The known answer; ``geglu`` (gemma4's experts): GELU-tanh(gate) * up in place of SwiGLU."""
    gates = MIXER_GATES if sparse_mixer else EXPERT_GATES
    if geglu:
        act = np.array([0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) for g in gates])
    else:
        act = np.array([g / (1 + np.exp(-g)) for g in gates])
    if sparse_mixer:
        chosen, w = sparse_mixer_weights(MIXER_LOGITS, MIXER_EPS)
        return float((np.asarray(w) * act[chosen]).sum())
    p = np.exp(EXPERT_LOGITS) / np.exp(EXPERT_LOGITS).sum()
    chosen = np.argsort(-np.asarray(EXPERT_LOGITS))[:top_k]
    w = p[chosen] / (p[chosen].sum() if normalize else 1.0)
    return float((w * act[chosen]).sum())


def expert_probe_graph(dtype: str, bits: int | None, top_k: int, normalize: bool, workdir,
                       sparse_mixer: bool = False, geglu: bool = False) -> tuple[ir.Model, dict]:
    """The export's expert op (MoE, or QMoE through the export's own quantize pass) on a checkpoint
    of the known-answer experts written to ``workdir`` (``sparse_mixer``: CUDA's own routing; ``geglu``: gemma4's
    GEGLU over [gate | up] rows)."""
    from pathlib import Path

    from safetensors.numpy import save_file

    from exporter.graph.components.moe import experts_op
    from exporter.graph.passes.quantize import QuantizeExpertsPass
    from exporter.packaging.checkpoint import Checkpoint, WeightPart

    entry, n = DTYPES[dtype], EXPERT_WIDTH
    tensors = {}
    gates, router = (MIXER_GATES, MIXER_LOGITS) if sparse_mixer else (EXPERT_GATES, EXPERT_LOGITS)
    for e, gate in enumerate(gates):
        tensors[f"e{e}.gate"] = np.full((n, n), gate / n, np.float32)
        tensors[f"e{e}.up"] = np.full((n, n), 1 / n, np.float32)
        tensors[f"e{e}.down"] = np.full((n, n), 1 / n, np.float32)
    save_file(tensors, str(Path(workdir) / "experts.safetensors"))
    b = GraphBuilder(Checkpoint(Path(workdir)), entry.ir)
    experts = len(gates)
    fc1 = b.stacked_weight("fc1", [WeightPart(f"e{e}.{t}") for e in range(experts) for t in ("gate", "up")],
                           experts=experts, interleave=1 if geglu else 2)
    fc2 = b.stacked_weight("fc2", [WeightPart(f"e{e}.down") for e in range(experts)], experts=experts)
    x, logits = _input("x", entry.ir, [1, n]), _input("logits", entry.ir, [1, experts])
    y = experts_op(b, x, logits, fc1, fc2, top_k, normalize, sparse_mixer=sparse_mixer, geglu=geglu)
    y.name, y.type, y.shape = "y", ir.TensorType(entry.ir), ir.Shape([1, n])
    graph = ir.Graph([x, logits], [y], nodes=b.tape.nodes, initializers=b.tape.initializers,
                     opset_imports={"": 24, "com.microsoft": 1}, name="probe_experts")
    model = ir.Model(graph, ir_version=11)
    if bits:
        QuantizeExpertsPass(bits, EXPERT_WIDTH, True, num_layers=1)(model)
    feeds = {"x": np.ones((1, n), entry.numpy), "logits": np.array([router], entry.numpy)}
    return model, feeds


def expert_gate(ep: str, activations: str, dtype: str, moe: dict) -> GateResult:
    """The export's expert op (its attributes, its quantization) on ``ep``: known answer or not."""
    import tempfile

    import onnxruntime as ort

    bits = {"int4": 4, "int8": 8}.get(dtype)
    from exporter.graph.components.moe import GEGLU, ROUTING_CUDA_SPARSE_MIXER, cuda_geglu

    mixer, geglu = moe.get("routing") == ROUTING_CUDA_SPARSE_MIXER, moe.get("activation") == GEGLU
    op = (f"QMoE int{bits}" if bits else "MoE") + (" (its sparse mixer)" if mixer else " (GEGLU)" if geglu else "")
    check = f"{op} experts known answer on {ep} ({activations})"
    if geglu and not (ep == "cuda" and cuda_geglu()):  # gemma4's experts in standard ops, which parity checks
        return GateResult("runtime", check, True, "not run", ProbeOutcome.SUPPORTED.value,
                          f"a {ep} export of this onnxruntime ({ort.__version__}) computes GEGLU experts in standard "
                          f"ops, not through the expert op (whose {ep} kernels here have no GEGLU)", informational=True)
    top_k, normalize = min(2, moe["top_k"]), moe["normalize"]
    want = expert_answer(top_k, normalize, mixer, geglu)
    provider = PROVIDER_NAMES[ep]
    if provider not in ort.get_available_providers():
        return GateResult("runtime", check, False, ProbeOutcome.MISSING.value, ProbeOutcome.SUPPORTED.value,
                          f"{provider} is not in this onnxruntime ({ort.__version__}) build")
    try:
        with tempfile.TemporaryDirectory(prefix="expert-probe-") as workdir:
            model, feeds = expert_probe_graph(activations, bits, top_k, normalize, workdir, mixer, geglu)
            proto = ir.to_proto(model).SerializeToString()
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if ep != "cpu":
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        from exporter.runtime.device import cuda_provider

        session = ort.InferenceSession(proto, options, providers=[cuda_provider() if ep == "cuda" else provider])
        out = np.empty((1, EXPERT_WIDTH), DTYPES[activations].numpy)
        got = run_bound(session, feeds, {"y": out})["y"].astype(np.float32)  # bound: numpy has no bf16 feeds
    except Exception as err:  # a failure to build or run is the finding
        return GateResult("runtime", check, False, ProbeOutcome.ERROR.value, ProbeOutcome.SUPPORTED.value,
                          f"{provider} could not run the export's {op} in {activations}: {err}")
    ok = bool(np.allclose(got, want, rtol=2e-2, atol=0))
    return GateResult("runtime", check, ok, (ProbeOutcome.SUPPORTED if ok else ProbeOutcome.WRONG_RESULT).value,
                      ProbeOutcome.SUPPORTED.value,
                      ("phimoe's sparsemixer over 8 experts (threshold 0.01): " if mixer else
                       f"top-{top_k} of 4 {'GEGLU ' if geglu else ''}experts "
                       f"{'renormalized' if normalize else 'as the softmax gives them'}: ") +
                      f"expected {want:.4f}, got {float(got.flat[0]):.4f}")
