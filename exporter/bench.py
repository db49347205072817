"""Stage: decode benchmark of an export, with IO binding, on CPU or CUDA.

Per context length the cache is filled with ``ctx`` tokens (that prefill is timed too), then single
token decode steps are timed: median and p90 ms/token after warm-up. Every run binds its inputs
and outputs to device buffers (IO binding), following the variant's own cache contract:

- ``static`` (attn_static): each ``key_cache.{i}`` input and its ``updated_key_cache.{i}`` output
  are bound to one buffer, so the scatter updates it in place; the per-step inputs (token,
  position, write index, count after the scatter) live in fixed device buffers updated in place, so
  the decode step can be captured once as a CUDA graph and replayed.
- ``shared`` (GroupQueryAttention, ours or onnxruntime-genai's): past and present bound to one
  max-length buffer (ORT's shared-buffer mode); the attention mask is as wide as the buffer and its
  sum gives ``seqlens_k``; also CUDA-graph capturable.
- ``dynamic`` (attn_dynamic): past -> present grows every step; no capture possible.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path

import numpy as np

BENCH_FILE = "benchmark.json"
_NP = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


@dataclasses.dataclass
class ContextResult:
    ctx: int
    decode_ms_median: float
    decode_ms_p90: float
    steps: int
    prefill_ms: float | None = None
    buffer: int | None = None


@dataclasses.dataclass
class BenchResult:
    variant: str
    dtype: str
    ep: str
    contexts: list[ContextResult]
    prefill_tokens_per_s: dict[int, float]
    settings: dict

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "variant": self.variant, "dtype": self.dtype, "ep": self.ep,
            "decode": [dataclasses.asdict(c) for c in self.contexts],
            "prefill_tokens_per_s": {str(k): v for k, v in self.prefill_tokens_per_s.items()},
            "settings": self.settings,
        }


def cache_mode(input_names: set[str]) -> str:
    """Which cache contract a model's inputs describe."""
    if "write_indices" in input_names:
        return "static"
    if "position_ids" in input_names and "attention_mask" in input_names:
        return "dynamic"
    return "shared"


class DecodeHarness:
    """Drives one ONNX decoder through prefill + decode with IO binding (CPU or CUDA)."""

    def __init__(self, model_path: Path, ep: str = "cpu", cuda_graph: bool = False, session_options=None,
                 mode: str | None = None):
        import onnxruntime as ort

        self.ort = ort
        self.device = "cuda" if ep == "cuda" else "cpu"
        if ep == "cuda":
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()
            providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if cuda_graph else "0"})]
        else:
            providers = ["CPUExecutionProvider"]
        if session_options is None:
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3
        self.session = ort.InferenceSession(str(model_path), session_options, providers=providers)
        self.cuda_graph = cuda_graph
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.mode = mode or cache_mode(set(self.inputs))
        if cuda_graph and self.mode == "dynamic":
            raise ValueError("a growing past/present cache cannot be captured in a CUDA graph")
        self.cache_pairs = self._cache_pairs()
        first = self.inputs[self.cache_pairs[0][0]]
        self.cache_dims = list(first.shape)
        if not isinstance(self.cache_dims[-1], int):
            # onnxruntime-genai's builder leaves head_dim symbolic; its genai_config.json has it.
            genai = json.loads((Path(model_path).parent / "genai_config.json").read_text())["model"]["decoder"]
            self.cache_dims[-1] = genai["head_size"]
        self.cache_dtype = _NP[first.type]
        self.mask_dtype = _NP[self.inputs["attention_mask"].type] if "attention_mask" in self.inputs else np.int64
        self._graph_ids = 0

    def _cache_pairs(self) -> list[tuple[str, str]]:
        pairs = []
        for name in self.inputs:
            if name.startswith("key_cache.") or name.startswith("value_cache."):
                pairs.append((name, "updated_" + name))
            elif name.startswith("past_key_values."):
                pairs.append((name, name.replace("past_key_values.", "present.")))
        return pairs

    def _value(self, array: np.ndarray):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, 0)

    def _zeros(self, shape, dtype):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)

    def _run(self, binding, graph_id: int) -> None:
        options = self.ort.RunOptions()
        if self.device == "cuda":
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.session.run_with_iobinding(binding, options)

    def new_caches(self, buffer: int) -> dict:
        """Zeroed cache buffers of ``buffer`` positions (``dynamic``: an empty past)."""
        length = 0 if self.mode == "dynamic" else buffer
        # Batch 1; the one symbolic dimension left is the positions axis (whatever the layout).
        shape = [1] + [d if isinstance(d, int) else length for d in self.cache_dims[1:]]
        return {name: self._value(np.zeros(shape, self.cache_dtype)) for name, _ in self.cache_pairs}

    def _step_feeds(self, tokens: np.ndarray, past: int, buffer: int) -> dict[str, np.ndarray]:
        n = tokens.shape[1]
        feeds = {"input_ids": tokens.astype(np.int64)}
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(past, past + n, dtype=np.int64)[None]
        if self.mode == "static":
            feeds["write_indices"] = np.array([past], np.int64)
            feeds["nonpad_kv_seqlen"] = np.array([past + n], np.int64)
        elif self.mode == "shared":
            mask = np.zeros((1, buffer), self.mask_dtype)
            mask[0, : past + n] = 1
            feeds["attention_mask"] = mask
        else:
            feeds["attention_mask"] = np.ones((1, past + n), self.mask_dtype)
        return feeds

    def prefill(self, tokens: np.ndarray, caches: dict, buffer: int):
        """Run the prompt (never captured); returns (elapsed seconds, logits OrtValue)."""
        binding = self.session.io_binding()
        for name, array in self._step_feeds(tokens, 0, buffer).items():
            binding.bind_ortvalue_input(name, self._value(array))
        binding.bind_output("logits", self.device)  # first: outputs come back in binding order
        self._bind_caches(binding, caches)
        start = time.perf_counter()
        self._run(binding, -1)
        elapsed = time.perf_counter() - start
        if self.mode == "dynamic":
            self._take_presents(binding, caches)
        return elapsed, binding.get_outputs()[0]


    def _bind_caches(self, binding, caches: dict) -> None:
        for name_in, name_out in self.cache_pairs:
            binding.bind_ortvalue_input(name_in, caches[name_in])
            if self.mode == "dynamic":
                binding.bind_output(name_out, self.device)
            else:
                binding.bind_ortvalue_output(name_out, caches[name_in])

    def _take_presents(self, binding, caches: dict) -> None:
        # Bound in this order: logits, then each cache output (see prefill / decode).
        outputs = dict(zip(["logits"] + [out for _, out in self.cache_pairs], binding.get_outputs()))
        for name_in, name_out in self.cache_pairs:
            caches[name_in] = outputs[name_out]

    def decode(self, caches: dict, past: int, buffer: int, steps: int, warmup: int, should_stop=lambda: False,
               capture: bool | None = None):
        """Time ``steps`` single-token steps after ``warmup``; returns (ms list, last logits as numpy).

        ``capture`` (default: whether the session was made for CUDA graphs) records the step once
        and replays it; False runs every step normally, even in a graph-enabled session.
        """
        graph_id = -1
        if self.cuda_graph and capture is not False:
            self._graph_ids += 1
            graph_id = self._graph_ids  # one captured graph per buffer set (addresses differ)
        fixed = {name: self._value(array) for name, array in self._step_feeds(np.ones((1, 1), np.int64), past, buffer).items()}
        logits = self._zeros((1, 1, self.session.get_outputs()[0].shape[2]), self.cache_dtype)
        binding = self.session.io_binding()
        for name, value in fixed.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output("logits", logits)
        if self.mode != "dynamic":
            self._bind_caches(binding, caches)
        times = []
        for i in range(warmup + steps):
            if should_stop():
                raise InterruptedError("benchmark stopped")
            start = time.perf_counter()
            if self.mode == "dynamic":
                self._bind_dynamic(binding, caches, fixed, past + i)
            for name, array in self._step_feeds(np.ones((1, 1), np.int64), past + i, buffer).items():
                if name not in ("input_ids", "attention_mask") or self.mode == "shared":
                    fixed[name].update_inplace(array)  # same address: a captured graph sees the new value
            self._run(binding, graph_id)
            if self.mode == "dynamic":
                self._take_presents(binding, caches)
            elapsed = (time.perf_counter() - start) * 1000.0
            if i >= warmup:
                times.append(elapsed)
        return times, logits.numpy()

    def _bind_dynamic(self, binding, caches: dict, fixed: dict, past: int) -> None:
        # The mask grows with the past: rebind it (and the caches) every step.
        binding.bind_ortvalue_input("attention_mask", self._value(np.ones((1, past + 1), self.mask_dtype)))
        self._bind_caches(binding, caches)


def bench_contexts(harness: DecodeHarness, contexts, steps: int, warmup: int, buffer_for, should_stop=lambda: False,
                   vocab: int = 1000, seed: int = 0) -> list[ContextResult]:
    """Measure each context with a buffer of ``buffer_for(ctx)`` positions."""
    rng = np.random.default_rng(seed)
    results = []
    for ctx in contexts:
        buffer = buffer_for(ctx)
        caches = harness.new_caches(buffer)
        prefill_s, _ = harness.prefill(rng.integers(3, vocab, size=(1, ctx)), caches, buffer)
        times, _ = harness.decode(caches, ctx, buffer, steps, warmup, should_stop)
        results.append(ContextResult(ctx, float(np.median(times)), float(np.percentile(times, 90)), len(times),
                                     prefill_s * 1000.0, buffer))
    return results


def run_bench(
    export_dir: Path, ep: str | None = None, contexts: list[int] = (16, 64), steps: int = 16, warmup: int = 3,
    prefill_lengths: list[int] = (64,), repeats: int = 1, should_stop=lambda: False, cuda_graph: bool | None = None,
) -> BenchResult:
    """The pipeline's bench stage: measure ``export_dir`` and write benchmark.json next to it.

    Each context is measured ``repeats`` times (fresh cache each time) and the step times pooled.
    """
    from exporter.runtime import read_metadata

    export_dir = Path(export_dir)
    meta = read_metadata(export_dir / "model.onnx")
    ep = ep or meta["ep"]
    graph = (ep == "cuda" and meta["variant"] != "attn_dynamic") if cuda_graph is None else cuda_graph
    harness = DecodeHarness(export_dir / "model.onnx", ep, cuda_graph=graph)
    limit = meta["config"]["max_seq_len"] or meta["config"]["context_length"]
    vocab = meta["config"]["vocab_size"]
    results = []
    for ctx in contexts:
        if ctx + warmup + steps > limit:
            continue
        runs = [bench_contexts(harness, [ctx], steps, warmup, lambda c: c + warmup + steps, should_stop, vocab)[0]
                for _ in range(repeats)]
        times_median = float(np.median([r.decode_ms_median for r in runs]))
        results.append(ContextResult(ctx, times_median, float(np.median([r.decode_ms_p90 for r in runs])),
                                     sum(r.steps for r in runs), float(np.median([r.prefill_ms for r in runs])),
                                     runs[0].buffer))
    prefill = {}
    rng = np.random.default_rng(1)
    for length in prefill_lengths:
        if length > limit:
            continue
        caches = harness.new_caches(length)
        elapsed, _ = harness.prefill(rng.integers(3, vocab, size=(1, length)), caches, length)
        prefill[length] = length / elapsed
    result = BenchResult(meta["variant"], meta["dtype"], ep, results, prefill,
                         {"steps": steps, "warmup": warmup, "repeats": repeats, "cuda_graph": graph,
                          "io_binding": True, "cache_mode": harness.mode})
    (export_dir / BENCH_FILE).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
