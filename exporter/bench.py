"""Stage: decode benchmark of an export through its own cache contract.

Per context length: the cache is filled with ``ctx`` tokens, then ``steps`` single-token decode
steps are timed (median and p90 ms/token, after warm-up). Prefill throughput is timed separately.
The GPU harness (CUDA graphs, shared buffers, kernel logs) builds on the same entry point.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path

import numpy as np

from exporter.request import Variant

BENCH_FILE = "benchmark.json"


@dataclasses.dataclass
class ContextResult:
    ctx: int
    decode_ms_median: float
    decode_ms_p90: float
    steps: int


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


def _decode_times(lm, ctx: int, steps: int, warmup: int, rng, should_stop) -> list[float]:
    state = lm.new_state()
    vocab = lm.config["vocab_size"]
    lm.forward(rng.integers(0, vocab, size=(1, ctx)), state)
    token = np.array([[1]], dtype=np.int64)
    times = []
    for i in range(warmup + steps):
        if should_stop():
            raise InterruptedError("benchmark stopped")
        t0 = time.perf_counter()
        logits = lm.forward(token, state)
        elapsed = time.perf_counter() - t0
        token = np.array([[int(np.argmax(logits[0, -1]))]], dtype=np.int64)
        if i >= warmup:
            times.append(elapsed * 1000.0)
    return times


def run_bench(
    export_dir: Path, ep: str | None = None, contexts: list[int] = (16, 64), steps: int = 16, warmup: int = 3,
    prefill_lengths: list[int] = (64,), repeats: int = 1, should_stop=lambda: False,
) -> BenchResult:
    """Measure ``export_dir`` and write benchmark.json next to it.

    Each context is measured ``repeats`` times (fresh cache each time) and the step times pooled,
    so noisy machines can buy steadier figures with time.
    """
    from exporter.runtime import OnnxCausalLM, read_metadata

    export_dir = Path(export_dir)
    meta = read_metadata(export_dir / "model.onnx")
    ep = ep or meta["ep"]
    variant = Variant(meta["variant"])
    lm = OnnxCausalLM(export_dir, ep=ep, io_binding=variant is Variant.ATTN_STATIC)
    limit = lm.config["max_seq_len"] or lm.config["context_length"]
    rng = np.random.default_rng(0)
    results = []
    for ctx in contexts:
        if ctx + warmup + steps > limit:
            continue
        times = [t for _ in range(repeats) for t in _decode_times(lm, ctx, steps, warmup, rng, should_stop)]
        results.append(ContextResult(ctx, float(np.median(times)), float(np.percentile(times, 90)), len(times)))
    prefill = {}
    for length in prefill_lengths:
        if length > limit:
            continue
        state = lm.new_state()
        t0 = time.perf_counter()
        lm.forward(rng.integers(0, lm.config["vocab_size"], size=(1, length)), state)
        prefill[length] = length / (time.perf_counter() - t0)
    result = BenchResult(variant.value, meta["dtype"], ep, results, prefill,
                         {"steps": steps, "warmup": warmup, "repeats": repeats, "io_binding": variant is Variant.ATTN_STATIC})
    (export_dir / BENCH_FILE).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
