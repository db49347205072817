"""What a sliding window costs at decode on CUDA: the same model with and without one, per variant.

A Mistral-style config (random fp16 weights, built on the device) is exported twice per variant,
once with ``sliding_window`` and once without; each export is benched at batch 1 with a CUDA graph
(3 fresh sessions, median of medians) and its attention kernel is read from ORT's own logs
(exporter.runtime.kernel_log). attn_static's window layers carry an in-graph mask (no
``nonpad_kv_seqlen``); gqa's use GroupQueryAttention's ``local_window_size``::

    python3 benchmarks/window_cost.py --out $OUT/window_cost.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def checkpoint(directory: Path, window: int | None, device: str) -> Path:
    import torch
    import transformers

    config = transformers.MistralConfig(**CONFIG, sliding_window=window)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.save_pretrained(directory)
    return directory


def bench(export_dir: Path, ep: str, contexts: list[int], steps: int, warmup: int, repeats: int) -> dict:
    from exporter.runtime.session import Decoder

    out: dict = {}
    for _ in range(repeats):
        decoder = Decoder(export_dir, ep, cuda_graph=ep == "cuda")
        for ctx in contexts:
            buffer = ctx + warmup + steps
            caches = decoder.new_caches(buffer)
            decoder.prefill_bound(np.random.default_rng(0).integers(3, 1000, size=(1, ctx)), caches, buffer)
            times, _ = decoder.decode_bound(caches, ctx, buffer, steps, warmup)
            out.setdefault(str(ctx), []).append(float(np.median(times)))
        del decoder
        gc.collect()
    return {ctx: {"decode_ms_median": float(np.median(v)), "session_medians_ms": v} for ctx, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--ctx", default="1024,4096", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 2-layer, 256-wide model (CPU smoke test)")
    args = parser.parse_args()
    import onnxruntime as ort

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.kernel_log import probe

    if args.small:
        CONFIG.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    device = "cuda" if args.ep == "cuda" else "cpu"
    max_seq_len = max(args.ctx) + args.steps + args.warmup + 8
    result = {"benchmark": "window_cost", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "onnxruntime": ort.__version__,
              "config": CONFIG, "window": args.window, "settings": vars(args) | {"out": str(args.out)}, "exports": {}}
    work = Path(tempfile.mkdtemp(prefix="window-cost-"))
    for window in (None, args.window):
        source = checkpoint(work / f"ckpt-{window}", window, device)
        for variant in ("attn_static", "gqa"):
            name = f"{variant}, {'window ' + str(window) if window else 'no window'}"
            print(name, flush=True)
            request = ExportRequest(model=str(source), dtype="fp16", ep=args.ep, variant=variant,
                                    static_cache=variant == "attn_static", max_seq_len=max_seq_len)
            export_dir = export_model(request, work / name.replace(", ", "-").replace(" ", "-"), validate=False).out_dir
            entry = {"decode": bench(export_dir, args.ep, args.ctx, args.steps, args.warmup, args.repeats)}
            if args.ep == "cuda":
                entry["kernels"] = probe(export_dir / "model.onnx", args.ep, ctx=min(args.ctx))
            result["exports"][name] = entry
            args.out.write_text(json.dumps(result, indent=2))
    for variant in ("attn_static", "gqa"):
        full, windowed = result["exports"][f"{variant}, no window"], result["exports"][f"{variant}, window {args.window}"]
        result.setdefault("window_over_full", {})[variant] = {
            ctx: windowed["decode"][ctx]["decode_ms_median"] / full["decode"][ctx]["decode_ms_median"] for ctx in full["decode"]}
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["window_over_full"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
