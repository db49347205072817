"""An independent check of decode latency: a second, minimal harness on ONNX Runtime's API alone.

It shares no code with ``exporter/`` (nor with ``benchmarks/gpu_matrix.py``): it reads a model's
inputs, binds device buffers itself and times one-token decode steps, the way a serving loop over
IO binding does. ``gpu_matrix.py`` runs it in the same process on the same exports and accepts a
configuration's figures, and so a recommendation built on them, only where the two agree within
3% (``TOLERANCE``).

How it drives each kind of model:

- static cache (``write_indices`` among the inputs): caches bound in place, per-step inputs in
  fixed device buffers updated in place; CUDA graph capture when asked.
- GroupQueryAttention with past/present (no ``position_ids``): past and present bound to one
  buffer; the mask as wide as that buffer under a CUDA graph (onnxruntime-genai's static mask), or
  as wide as the tokens so far without one (genai's growing mask).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

TOLERANCE = 0.03
_NUMPY = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32}
_ONNX_BF16 = 16


def measure(model_dir: Path, *, graph: bool, buffer: int, ctx: int, steps: int = 64, warmup: int = 8,
            seed: int = 0, ep: str = "cuda") -> float:
    """Median ms per decode step, batch 1, after a ``ctx``-token prompt, in a fresh session."""
    import onnxruntime as ort

    model_dir = Path(model_dir)
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = ([("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})] if ep == "cuda"
                 else ["CPUExecutionProvider"])
    where = "cuda" if ep == "cuda" else "cpu"
    session = ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=providers)
    inputs = {i.name: i for i in session.get_inputs()}
    static = "write_indices" in inputs
    caches = [n for n in inputs if n.startswith(("past_key_values.", "key_cache.", "value_cache."))]
    out_of = {n: ("updated_" + n if static else n.replace("past_key_values.", "present.")) for n in caches}
    first = inputs[caches[0]]
    dims = list(first.shape)
    if not isinstance(dims[-1], int):  # genai's builder leaves head_size symbolic
        dims[-1] = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    shape = [1] + [d if isinstance(d, int) else buffer for d in dims[1:]]

    def device(array: np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), where, 0)

    if first.type == "tensor(bfloat16)":
        zeros = np.zeros(shape, np.uint16)
        kv = {}
        for n in caches:
            kv[n] = ort.OrtValue.ortvalue_from_shape_and_type(shape, _ONNX_BF16, where, 0)
            kv[n].update_inplace(zeros)
    else:
        kv = {n: device(np.zeros(shape, _NUMPY[first.type])) for n in caches}
    mask_type = _NUMPY[inputs["attention_mask"].type] if "attention_mask" in inputs else np.int64
    logits_type = session.get_outputs()[0].type
    vocab = session.get_outputs()[0].shape[2]

    def feeds(tokens: np.ndarray, past: int, mask_width: int) -> dict[str, np.ndarray]:
        n = tokens.shape[1]
        out = {"input_ids": tokens.astype(np.int64)}
        if static:
            out["position_ids"] = np.arange(past, past + n, dtype=np.int64)[None]
            out["write_indices"] = np.array([past], np.int64)
            out["nonpad_kv_seqlen"] = np.array([past + n], np.int64)
        else:
            mask = np.zeros((1, mask_width), mask_type)
            mask[0, : past + n] = 1
            out["attention_mask"] = mask
        return out

    def bind_kv(binding) -> None:
        for n in caches:
            binding.bind_ortvalue_input(n, kv[n])
            binding.bind_ortvalue_output(out_of[n], kv[n])

    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 100, size=(1, ctx))
    binding = session.io_binding()
    for name, array in feeds(prompt, 0, buffer if graph else ctx).items():
        binding.bind_ortvalue_input(name, device(array))
    binding.bind_output("logits", where)
    bind_kv(binding)
    session.run_with_iobinding(binding)  # the prompt, never captured

    token = np.ones((1, 1), np.int64)
    fixed = {name: device(array) for name, array in feeds(token, ctx, buffer).items()}
    logits = ort.OrtValue.ortvalue_from_shape_and_type(
        [1, 1, vocab], _ONNX_BF16 if logits_type == "tensor(bfloat16)" else _NUMPY[logits_type], where, 0)
    binding = session.io_binding()
    for name, value in fixed.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_ortvalue_output("logits", logits)
    bind_kv(binding)
    run_options = ort.RunOptions()
    if ep == "cuda":
        run_options.add_run_config_entry("gpu_graph_id", "1" if graph else "-1")
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        for name, array in feeds(token, ctx + i, buffer).items():
            if name == "attention_mask" and not graph:  # genai without a graph: the mask grows
                binding.bind_ortvalue_input(name, device(feeds(token, ctx + i, ctx + i + 1)[name]))
            elif name != "input_ids":
                fixed[name].update_inplace(array)
        session.run_with_iobinding(binding, run_options)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    return float(np.median(times))


def agree(matrix_ms: float, check_ms: float) -> bool:
    return abs(matrix_ms / check_ms - 1.0) <= TOLERANCE
