"""Runtime probe: a known-answer run of the static-cache pattern on the target EP.

Decode one query over a cache whose valid slots 0 and 1 were written earlier and whose slot 2 is
written by this step's TensorScatter (``nonpad_kv_seqlen`` = 3, the count after the scatter).
With bottom-right causal alignment the query sees all three values (mean 3.0); an ORT that aligns
causality top-left lets it see only slot 0 (1.0). An EP that cannot run the pattern is refused
at session creation (CPU fallback disabled), so a silent fall back to CPU is caught too.
"""

from __future__ import annotations

import enum

import numpy as np
import onnx_ir as ir

from exporter.gates import GateResult
from exporter.runtime import run_numpy

EXPECTED = 3.0
TOP_LEFT_ANSWER = 1.0
# Tokens cached after this step's scatter (slots 0, 1 and the new slot 2).
PROBE_NONPAD_KV_SEQLEN = 3


class ProbeOutcome(str, enum.Enum):
    SUPPORTED = "supported"
    WRONG_RESULT = "wrong-result"
    MISSING = "missing"  # the EP is not available in this onnxruntime
    ERROR = "error"  # the EP is there but could not build or run the pattern


PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _probe_model(dtype: ir.DataType) -> bytes:
    def value(name, shape, dt=dtype):
        return ir.Value(name=name, type=ir.TensorType(dt), shape=ir.Shape(shape))

    q, key_cache, value_cache = value("q", [1, 2, 1, 8]), value("key_cache", [1, 1, 4, 8]), value("value_cache", [1, 1, 4, 8])
    new_k, new_v = value("new_k", [1, 1, 1, 8]), value("new_v", [1, 1, 1, 8])
    write, nonpad = value("write_indices", [1], ir.DataType.INT64), value("nonpad_kv_seqlen", [1], ir.DataType.INT64)
    k = ir.node("TensorScatter", [key_cache, new_k, write], {"axis": 2})
    v = ir.node("TensorScatter", [value_cache, new_v, write], {"axis": 2})
    attn = ir.node("Attention", [q, k.outputs[0], v.outputs[0], None, None, None, nonpad], {"is_causal": 1})
    y = attn.outputs[0]
    y.name, y.type, y.shape = "y", ir.TensorType(dtype), ir.Shape([1, 2, 1, 8])
    graph = ir.Graph([q, key_cache, value_cache, new_k, new_v, write, nonpad], [y], nodes=[k, v, attn], opset_imports={"": 24})
    return ir.to_proto(ir.Model(graph, ir_version=11)).SerializeToString()


def probe_static_cache(ep: str, dtype: str = "fp32") -> tuple[ProbeOutcome, str]:
    """Classify ``ep`` for the static-cache pattern, with a sentence saying why."""
    import onnxruntime as ort

    provider = PROVIDER_NAMES[ep]
    if provider not in ort.get_available_providers():
        return ProbeOutcome.MISSING, f"{provider} is not in this onnxruntime ({ort.__version__}) build"
    ir_dtype = {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}[dtype]
    np_dtype = ir_dtype.numpy()
    key_cache = np.zeros((1, 1, 4, 8), np_dtype)
    value_cache = np.zeros((1, 1, 4, 8), np_dtype)
    value_cache[..., 0, :], value_cache[..., 1, :] = 1.0, 3.0
    feeds = {
        "q": np.zeros((1, 2, 1, 8), np_dtype),  # equal scores: the output is the mean of visible values
        "key_cache": key_cache, "value_cache": value_cache,
        "new_k": np.zeros((1, 1, 1, 8), np_dtype), "new_v": np.full((1, 1, 1, 8), 5.0, np_dtype),
        "write_indices": np.array([2], np.int64), "nonpad_kv_seqlen": np.array([PROBE_NONPAD_KV_SEQLEN], np.int64),
    }
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if ep != "cpu":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        if ep == "cuda" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        session = ort.InferenceSession(_probe_model(ir_dtype), options, providers=[provider])
        got = run_numpy(session, feeds, {"y": (1, 2, 1, 8)})["y"].astype(np.float32)
    except Exception as err:  # any failure to build or run is a classification, not a crash
        return ProbeOutcome.ERROR, f"{provider} could not run TensorScatter + Attention(nonpad_kv_seqlen): {err}"
    return classify_probe_output(got)


def classify_probe_output(got: np.ndarray) -> tuple[ProbeOutcome, str]:
    if np.allclose(got, EXPECTED, atol=1e-2):
        return ProbeOutcome.SUPPORTED, f"decode over a static cache gave {EXPECTED} as expected"
    what = "top-left causal alignment" if np.allclose(got, TOP_LEFT_ANSWER, atol=1e-2) else "an unexpected value"
    return ProbeOutcome.WRONG_RESULT, f"expected {EXPECTED}, got {float(got.flat[0]):.4g} ({what})"


def runtime_gate(ep: str, dtype: str, required: bool) -> GateResult:
    """The probe as a gate: required for attn_static exports, reported for the others."""
    outcome, message = probe_static_cache(ep, dtype if dtype != "bf16" or ep != "cpu" else "fp32")
    return GateResult(
        gate="runtime",
        check=f"static-cache known answer on {ep}" + ("" if required else " (informational)"),
        passed=outcome is ProbeOutcome.SUPPORTED or not required,
        measured=outcome.value,
        threshold=ProbeOutcome.SUPPORTED.value,
        message=message,
    )
