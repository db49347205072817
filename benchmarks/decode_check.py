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
- a decoder on ``inputs_embeds`` (an image-text package's): random rows of its hidden size in its
  dtype, in place of token ids; the graph file is genai_config.json's ``decoder.filename``.

``kernels``: a dict filled with the GPU kernels of the timed steps, read by CUPTI through torch's
profiler (every kernel of the process, onnxruntime's included), summed by name per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

TOLERANCE = 0.03
PROFILED_STEPS = 16  # decode steps under the profiler, after the timed ones, where ``kernels`` asks for them
_NUMPY = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32}
_ONNX_BF16 = 16


def measure(model_dir: Path, *, graph: bool, buffer: int, ctx: int, steps: int = 64, warmup: int = 8,
            seed: int = 0, ep: str = "cuda", kernels: dict | None = None) -> float:
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
    graph_file, decoder = model_dir / "model.onnx", {}
    if (model_dir / "genai_config.json").is_file():
        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        graph_file = model_dir / decoder["filename"]
    session = ort.InferenceSession(str(graph_file), options, providers=providers)
    inputs = {i.name: i for i in session.get_inputs()}
    static = "write_indices" in inputs
    caches = [n for n in inputs if n.startswith(("past_key_values.", "key_cache.", "value_cache."))]
    out_of = {n: ("updated_" + n if static else n.replace("past_key_values.", "present.")) for n in caches}
    first = inputs[caches[0]]
    # genai's builder makes sliding-window layers' caches ring buffers of the window (GQA sliding_window_cache=1,
    # its dim "past_sliding_length"): bound at that capacity, the tokens kept below it (no wrap)
    window = (decoder.get("sliding_window") or {}).get("window_size")
    positions = ctx + warmup + steps + (PROFILED_STEPS if kernels is not None else 0)  # the cache positions written
    if positions > buffer:
        raise ValueError(f"{positions} positions (context {ctx}, {warmup} + {steps} steps and the profiled ones) do not "
                         f"fit a cache buffer of {buffer}: pass a larger buffer")
    if any("sliding" in str(inputs[n].shape[2]) for n in caches):
        if window is None:
            raise ValueError(f"{graph_file} has sliding-window caches and its genai_config.json no "
                             "decoder.sliding_window.window_size to size them")
        if positions >= window:
            raise ValueError(f"{graph_file}: its sliding-window caches hold {window} positions; measure a context "
                             f"below {window - (positions - ctx)}")

    def shape_of(name: str) -> list[int]:
        dims = list(inputs[name].shape)
        if not isinstance(dims[-1], int):  # genai's builder leaves head_size symbolic
            dims[-1] = decoder["head_size"]
        return [1] + [d if isinstance(d, int) else window if "sliding" in d else buffer for d in dims[1:]]

    def device(array: np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), where, 0)

    if first.type == "tensor(bfloat16)":
        kv = {}
        for n in caches:
            kv[n] = ort.OrtValue.ortvalue_from_shape_and_type(shape_of(n), _ONNX_BF16, where, 0)
            kv[n].update_inplace(np.zeros(shape_of(n), np.uint16))
    else:
        kv = {n: device(np.zeros(shape_of(n), _NUMPY[first.type])) for n in caches}
    mask_type = _NUMPY[inputs["attention_mask"].type] if "attention_mask" in inputs else np.int64
    logits_type = session.get_outputs()[0].type
    vocab = session.get_outputs()[0].shape[2]

    embeds = inputs.get("inputs_embeds")
    rng = np.random.default_rng(seed)

    def rows(n: int) -> np.ndarray:
        values = rng.standard_normal((1, n, embeds.shape[-1]), np.float32)
        if embeds.type == "tensor(bfloat16)":
            return (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16's bits
        return values.astype(_NUMPY[embeds.type])

    def token_input(array: np.ndarray):
        if embeds is None or embeds.type != "tensor(bfloat16)":
            return device(array)
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), _ONNX_BF16, where, 0)
        value.update_inplace(array)
        return value

    def feeds(tokens: np.ndarray, past: int, mask_width: int) -> dict[str, np.ndarray]:
        n = tokens.shape[1]
        token = {"input_ids": tokens.astype(np.int64)} if embeds is None else {"inputs_embeds": rows(n)}
        return {**token, **where_in_cache(past, n, mask_width)}

    def where_in_cache(past: int, n: int, mask_width: int) -> dict[str, np.ndarray]:
        """The inputs that place ``n`` new tokens after ``past`` cached ones (the token inputs aside)."""
        out = {}
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

    prompt = rng.integers(3, 100, size=(1, ctx))
    binding = session.io_binding()
    for name, array in feeds(prompt, 0, buffer if graph else ctx).items():
        binding.bind_ortvalue_input(name, token_input(array) if name == "inputs_embeds" else device(array))
    binding.bind_output("logits", where)
    bind_kv(binding)
    session.run_with_iobinding(binding)  # the prompt, never captured

    token = np.ones((1, 1), np.int64)
    fixed = {name: token_input(array) if name == "inputs_embeds" else device(array)
             for name, array in feeds(token, ctx, buffer).items()}
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

    def step(i: int) -> None:
        start = time.perf_counter()
        for name, array in where_in_cache(ctx + i, 1, buffer).items():  # the same token at every step
            if name == "attention_mask" and not graph:  # genai without a graph: the mask grows
                binding.bind_ortvalue_input(name, device(where_in_cache(ctx + i, 1, ctx + i + 1)[name]))
            else:
                fixed[name].update_inplace(array)
        session.run_with_iobinding(binding, run_options)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)

    for i in range(warmup + steps):
        step(i)
    if kernels is not None:  # more steps, under the profiler (their times are not kept: the profiler slows them)
        kept = list(times)
        kernels.update(gpu_kernels(lambda: [step(warmup + steps + i) for i in range(PROFILED_STEPS)], PROFILED_STEPS))
        times[:] = kept
    return float(np.median(times))


def gpu_kernels(run, steps: int, top: int = 12) -> dict:
    """The GPU work of ``run()`` (``steps`` decode steps) as CUPTI recorded it through torch's profiler: kernels,
    copies and sets summed by name (cut to 160 characters), per step in microseconds (the ``top`` largest named, the
    rest summed), and the count of kernels a step."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    by_name: dict[str, float] = {}
    count = 0
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in event:
            name = event.get("name", "?")[:160]
            by_name[name] = by_name.get(name, 0.0) + float(event["dur"])
            count += event.get("cat") == "kernel"
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    named = {name: round(us / steps, 2) for name, us in ranked[:top]}
    return {"steps": steps, "gpu_us_per_step": round(sum(by_name.values()) / steps, 1),
            "kernels_per_step": round(count / steps, 1), "top_us_per_step": named,
            "other_us_per_step": round(sum(us for _, us in ranked[top:]) / steps, 1)}


def agree(matrix_ms: float, check_ms: float) -> bool:
    return abs(matrix_ms / check_ms - 1.0) <= TOLERANCE
