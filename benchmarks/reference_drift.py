"""How far transformers' own image-text model moves from its fp32 run when it computes in bf16 or fp16, on the farm's
validation prompts (issue 48): the yardstick for an export that fails the GPU gates in a reduced dtype. Where
transformers' own run departs as far, the checkpoint (not the export) is what rounding moves.

For each prompt of exporter/validation/image_text.py (one image, two images, text only: the same ids, pixels and grids
validation builds), on this machine's CPU with torch:
- prefill: the last position's logits of the bf16 / fp16 model against the fp32 model's, max abs error and its fraction
  of the fp32 range (validation's tolerance for the export: 20% of the range);
- teacher-forced steps: the fp32 run's greedy continuation fed back to every dtype, and the steps whose argmax differs
  from fp32's, with fp32's top-2 gap there (validation calls a step decisive where that gap is not a near tie);
- the experts chosen: for a model with a router (``mlp.gate``), the fraction of (layer, token) routings whose top-k set
  differs from fp32's at prefill, each router's smallest top-k margin (the gap between a token's k-th and (k+1)-th
  router logit), and what one flipped choice does: the fp32 model run again with one (layer, token)'s k-th expert
  replaced by its (k+1)-th (weights renormalized over the new pair), the last position's logits against the unflipped
  run, for every (layer, token) of the prompt.

    python benchmarks/reference_drift.py --case qwen3_5_moe_genai --out r.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def route(model, inputs) -> list:
    """One pass of ``model`` on ``inputs`` (any dtype): each router's (top-k expert sets, sorted ids per token; its
    router logits as fp32 on the host)."""
    from exporter.validation.routing import hooked_pass

    seen = []
    hooked_pass(model, inputs, lambda m, out: seen.append(
        (np.sort(out[2].reshape(-1, m.top_k).cpu().numpy(), axis=-1), out[0].detach().float().cpu())))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="exporter.vision.tiny_checkpoint's name of a tiny checkpoint")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--work", type=Path, default=Path("/tmp/reference-drift"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from exporter.validation.image_text import (
        PROMPTS, _grid_kwargs, image_prompt, load_image_text_reference, random_images, validation_patches,
    )
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    torch.set_num_threads(2)
    checkpoint = make_tiny_vlm_checkpoint(args.case, args.work / args.case)
    reference = load_image_text_reference(checkpoint)
    config = reference.config
    text = config.get_text_config()
    vision = config.vision_config
    image_token, vocab = config.image_token_id, text.vocab_size
    merge = getattr(vision, "spatial_merge_size", None)
    models = {"fp32": reference}
    for name in args.dtypes:
        models[name] = load_image_text_reference(checkpoint, name)  # loaded in that dtype, as transformers' users do

    def one_flip_moves(model, inputs, last: int) -> list[dict]:
        """For every (router, token): the token's k-th expert swapped for its (k+1)-th and the model rerun
        (validation's own replay, exporter.validation.routing); how far the logits at position ``last`` move (max abs),
        beside that routing's margin. Sorted by margin."""
        from exporter.validation import routing

        base, seen, renormalize = routing.router_logits(model, inputs)
        rows = []
        for flip in routing.near_ties(model, seen, last, float("inf")):
            moved, _ = routing.replay(model, inputs, [flip], renormalize)
            rows.append({"layer": flip.layer, "token": flip.token, "margin": flip.margin,
                         "last_logits_move": round(float(np.abs(moved[last] - base[last]).max()), 4)})
        return sorted(rows, key=lambda row: (row["margin"], row["layer"], row["token"]))

    def feed(model, ids: list[int], pixels: np.ndarray | None, grid: np.ndarray | None) -> dict:
        """The model's inputs for ``ids``: the pixels in its dtype, a patch-sequence model's grids and image-token
        map (validation's own _grid_kwargs)."""
        if pixels is None:
            return {"input_ids": torch.tensor([ids])}
        return {"input_ids": torch.tensor([ids]),
                "pixel_values": torch.from_numpy(pixels).to(next(model.parameters()).dtype),
                **_grid_kwargs(ids, grid, image_token)}

    result = {"benchmark": "reference_drift", "command": "python benchmarks/reference_drift.py " + " ".join(sys.argv[1:]),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.node(),
              "torch": torch.__version__, "case": args.case, "model_type": config.model_type,
              "how": __doc__.split("For each prompt", 1)[1].strip(), "prompts": {}}
    for images, label in zip((1, 2, 0), PROMPTS):
        grid = None
        if images and merge:
            patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
            pixels, grid = validation_patches(images, merge, patch_dim, seed=images)
            tokens = [int(np.prod(g)) // merge ** 2 for g in grid]
        elif images:
            pixels = random_images(images, vision.image_size, seed=images)
            tokens = config.mm_tokens_per_image
        else:
            pixels, tokens = None, 0
        prompt = image_prompt(images, tokens, image_token, vocab, seed=images)
        with torch.no_grad():
            out = reference.generate(**feed(reference, prompt, pixels, grid), max_new_tokens=args.steps,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        full = out[0].tolist()  # the prompt and fp32's greedy continuation, fed to every dtype (teacher-forced)
        logits, experts = {}, {}
        for name, model in models.items():
            with torch.no_grad():
                logits[name] = model(**feed(model, full[:-1], pixels, grid)).logits[0, len(prompt) - 1:].float().numpy()
            experts[name] = route(model, feed(model, prompt, pixels, grid))
        fp32 = logits["fp32"]
        top2 = np.sort(fp32, axis=-1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        span = float(np.ptp(fp32[0]))
        entry = {"prompt_tokens": len(prompt), "fp32_prefill_range": span}
        if experts["fp32"]:  # what one flipped expert choice does to the prompt's last logits, smallest margins first
            router_logits = [seen for _, seen in experts["fp32"]]
            flips = one_flip_moves(reference, feed(reference, prompt, pixels, grid), len(prompt) - 1)
            entry["one_flip_smallest_margins"] = flips[:4]
            entry["one_flip_largest_move"] = max(flips, key=lambda row: row["last_logits_move"])
            # the fp32 router logits' top-k boundary, smallest over tokens, per layer; and the last token's
            layers = range(len(router_logits))
            entry["fp32_router_margin_min_per_layer"] = [min(r["margin"] for r in flips if r["layer"] == layer)
                                                         for layer in layers]
            entry["fp32_router_margin_last_token_per_layer"] = [
                next(r["margin"] for r in flips if r["layer"] == layer and r["token"] == len(prompt) - 1)
                for layer in layers]
        for name in args.dtypes:
            got = logits[name]
            differing = [int(i) for i in np.nonzero(got.argmax(-1) != fp32.argmax(-1))[0]]
            routed = [sets for sets, _ in experts["fp32"]]
            changed = [sets for sets, _ in experts[name]]
            flips = (sum(int((a != b).any(axis=-1).sum()) for a, b in zip(routed, changed)) /
                     max(1, sum(len(a) for a in routed))) if routed else None
            entry[name] = {"prefill_max_abs_error": float(np.abs(got[0] - fp32[0]).max()),
                           "prefill_error_of_range": float(np.abs(got[0] - fp32[0]).max() / span),
                           "steps_differing": differing, "fp32_gaps_there": [round(float(gaps[i]), 3) for i in differing],
                           "routing_sets_changed": flips}
        result["prompts"][label] = entry
        print(label, json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
