"""Stage: decode benchmark of an export, with IO binding, on CPU or CUDA.

Per context length and batch size the caches are filled with ``ctx`` tokens per row (that prefill
is timed too), then one-token decode steps of every row are timed: median and p90 ms per step after
warm-up. Every run goes through ``exporter.runtime.session.Decoder``'s device binding, following
the variant's own cache contract:

- ``static`` (attn_static): each ``key_cache.{i}`` input and its ``updated_key_cache.{i}`` output
  are bound to one buffer, so the scatter updates it in place; the per-step inputs (token,
  position, write index, count after the scatter) live in fixed device buffers updated in place, so
  the decode step can be captured once as a CUDA graph and replayed.
- ``gqa`` (GroupQueryAttention, ours or onnxruntime-genai's): past and present bound to one
  max-length buffer (ORT's shared-buffer mode); the attention mask is as wide as the buffer and its
  sum gives ``seqlens_k``; also CUDA-graph capturable.
- ``dynamic`` (attn_dynamic): past -> present grows every step; no capture possible.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import numpy as np

from exporter.contract import BENCH_FILE, MODEL_FILE, VISION_FILE
from exporter.runtime.isolated import phase
from exporter.runtime.session import Decoder, read_metadata

# Untimed prefills of each shape before the timed one.
PREFILL_WARMUP = 1


@dataclasses.dataclass
class ContextResult:
    ctx: int
    decode_ms_median: float
    decode_ms_p90: float
    steps: int
    prefill_ms: float | None = None
    buffer: int | None = None
    batch: int = 1


@dataclasses.dataclass
class BenchResult:
    variant: str
    dtype: str
    ep: str
    contexts: list[ContextResult]
    prefill_tokens_per_s: dict[int, float]
    settings: dict
    image: dict | None = None  # an image-text export's image figures (image_figures)

    def to_dict(self) -> dict:
        return {
            "schema": 2,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "variant": self.variant, "dtype": self.dtype, "ep": self.ep,
            "decode": [dataclasses.asdict(c) for c in self.contexts],
            "prefill_tokens_per_s": {str(k): v for k, v in self.prefill_tokens_per_s.items()},
            "settings": self.settings,
            **({"image": self.image} if self.image else {}),
        }


def timed_prefill(decoder: Decoder, tokens: np.ndarray, buffer: int, warmup: int = PREFILL_WARMUP) -> tuple[float, dict]:
    """Seconds of one prefill of ``tokens`` on fresh caches (returned), after ``warmup`` untimed ones
    of the same shape: the first run of a shape pays kernel selection, allocation and, on CUDA, the
    driver's compilation (a 128-token prefill once read 1455 ms beside 85 ms for 1024 tokens)."""
    for _ in range(warmup):
        decoder.prefill_bound(tokens, decoder.new_caches(buffer, tokens.shape[0]), buffer)
    caches = decoder.new_caches(buffer, tokens.shape[0])
    elapsed, _ = decoder.prefill_bound(tokens, caches, buffer)
    return elapsed, caches


def bench_contexts(decoder: Decoder, contexts, steps: int, warmup: int, buffer_for, should_stop=lambda: False,
                   vocab: int = 1000, seed: int = 0, batch: int = 1,
                   prefill_warmup: int = PREFILL_WARMUP) -> list[ContextResult]:
    """Measure each context with a buffer of ``buffer_for(ctx)`` positions, ``batch`` rows."""
    rng = np.random.default_rng(seed)
    results = []
    for ctx in contexts:
        buffer = buffer_for(ctx)
        phase(f"prefilling {ctx} tokens, batch {batch}, into a {buffer}-position buffer")
        prefill_s, caches = timed_prefill(decoder, rng.integers(3, vocab, size=(batch, ctx)), buffer, prefill_warmup)
        times, _ = decoder.decode_bound(caches, ctx, buffer, steps, warmup, should_stop)
        results.append(ContextResult(ctx, float(np.median(times)), float(np.percentile(times, 90)), len(times),
                                     prefill_s * 1000.0, buffer, batch))
    return results


def image_figures(model, limit: int, repeats: int = 5, text_tokens: int = 8) -> dict:
    """An image-text export's image costs, on ``model`` (exporter.runtime.image_text's runtime of it): the vision graph
    on one image (``model.timing_image()``: the model's own size, or a square of TIMING_IMAGE_TOKENS tokens where the
    tokens follow the image's size; median ms of ``repeats`` after one untimed run), and the time to the first token
    of a prompt of that image and ``text_tokens`` text tokens: vision, embedding and the decoder's prefill on fresh
    caches (median); the prompt within ``limit`` positions (the export's max_seq_len)."""
    import time

    inputs, tokens, image = model.timing_image(limit - text_tokens - 1)
    if tokens + text_tokens + 1 > limit:
        return {"skipped": f"a one-image prompt ({tokens} image tokens and {text_tokens} text tokens) does not fit the "
                           f"export's {limit} positions"}
    model.image_features(**inputs)
    encode = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.image_features(**inputs)
        encode.append(time.perf_counter() - start)
    prompt = np.array([[model.image_token_id] * tokens + [3] * text_tokens], np.int64)
    buffer = prompt.shape[1] + 1
    first = []
    for i in range(repeats + 1):
        model.clear()
        caches = model.decoder.new_caches(buffer, 1)
        start = time.perf_counter()
        model.encode(**inputs)
        model.decoder.prefill_bound(prompt, caches, buffer)
        if i:  # the first pays the prompt shape's kernel selection
            first.append(time.perf_counter() - start)
    model.clear()
    return {**image, "tokens_per_image": tokens,
            "encode_ms_median": float(np.median(encode)) * 1000.0, "prompt_tokens": int(prompt.shape[1]),
            "time_to_first_token_ms_median": float(np.median(first)) * 1000.0, "repeats": repeats}


def run_bench(
    export_dir: Path, ep: str | None = None, contexts: list[int] = (16, 64), steps: int = 16, warmup: int = 3,
    prefill_lengths: list[int] = (64,), repeats: int = 1, should_stop=lambda: False, cuda_graph: bool | None = None,
    batches: list[int] = (1,),
) -> BenchResult:
    """The pipeline's bench stage: measure ``export_dir`` and write benchmark.json next to it.

    Each (context, batch) is measured ``repeats`` times (fresh caches each time), the medians pooled.
    """
    export_dir = Path(export_dir)
    meta = read_metadata(export_dir / MODEL_FILE)
    ep = ep or meta["ep"]
    image_text = (export_dir / VISION_FILE).is_file()
    # an image-text decoder is fed inputs_embeds the embedding graph computes on the host before every step: no
    # captured graph around it
    graph = (ep == "cuda" and meta["variant"] != "attn_dynamic" and not image_text) if cuda_graph is None else cuda_graph
    if image_text:  # text decode timed through the embedding graph (no images), as generation runs it
        from exporter.runtime.image_text import open_image_text

        model = open_image_text(export_dir, ep, cuda_graph=graph)
        decoder = model.decoder
    else:
        decoder = Decoder(export_dir, ep, cuda_graph=graph)
    limit = meta["config"]["max_seq_len"] or meta["config"]["context_length"]
    vocab = meta["config"]["vocab_size"]
    results = []
    for batch in batches:
        for ctx in contexts:
            if ctx + warmup + steps > limit:
                continue
            runs = [bench_contexts(decoder, [ctx], steps, warmup, lambda c: c + warmup + steps, should_stop, vocab,
                                   batch=batch)[0] for _ in range(repeats)]
            results.append(ContextResult(
                ctx, float(np.median([r.decode_ms_median for r in runs])), float(np.median([r.decode_ms_p90 for r in runs])),
                sum(r.steps for r in runs), float(np.median([r.prefill_ms for r in runs])), runs[0].buffer, batch))
    prefill = {}
    rng = np.random.default_rng(1)
    for length in prefill_lengths:
        if length > limit:
            continue
        elapsed, _ = timed_prefill(decoder, rng.integers(3, vocab, size=(1, length)), length)
        prefill[length] = length / elapsed
    result = BenchResult(meta["variant"], meta["dtype"], ep, results, prefill,
                         {"steps": steps, "warmup": warmup, "prefill_warmup": PREFILL_WARMUP, "repeats": repeats,
                          "cuda_graph": graph,
                          "io_binding": True, "cache_mode": decoder.mode, "batches": list(batches),
                          "sliding_layers": len(meta["config"].get("sliding_layers") or [])},
                         image_figures(model, limit) if image_text else None)
    (export_dir / BENCH_FILE).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
