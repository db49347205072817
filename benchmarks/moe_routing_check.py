"""Which experts an image-text MoE export picks, beside transformers' fp32 and transformers in the export's dtype on
the same device (issue 48: the tiny qwen3_5_moe checkpoint's bf16 export departs on CUDA where transformers' own bf16
on the CPU moved 20x less). Shows or rules out that a flipped expert choice is the departure.

For each dtype, the checkpoint is exported for the EP (validation off) and a copy of its decoder made with every expert
op's router-logits input as an extra fp32 output (the copy's other files hard links of the export's). Then for each of
validation's prompts (exporter/validation/image_text.py: one image, two images, text only), prefill only:
- the export's router logits (its runtime, exporter.runtime.image_text, as validation drives it) and last-position
  logits;
- transformers' router logits and last logits in fp32 on the host (validation's reference) and in the export's dtype
  on the device;
- per run: the (layer, token) routings whose top-k expert set differs from fp32's, with fp32's margin there (the gap
  between the token's k-th and (k+1)-th router logit), and the last logits' max abs error against fp32's;
- forced: transformers' fp32 model run with every router's choice replaced by the export's (the picked experts'
  fp32 softmax weights renormalized, as qwen3_5_moe's router renormalizes), its last logits against the export's and
  against unforced fp32. Where forcing the export's choices takes fp32 most of the way to the export, the routing is the
  departure.

    python benchmarks/moe_routing_check.py --case qwen3_5_moe_genai --ep cuda --dtypes bf16 fp16 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.reference_drift import route  # noqa: E402
from exporter.validation.routing import routers  # noqa: E402

PROBE = "probe_router_logits."


def probe_copy(export_dir: Path, probe_dir: Path) -> int:
    """``probe_dir``: the export with its decoder's expert ops' router logits (input 1) as extra fp32 outputs; the other
    files hard links. Returns how many expert ops it found."""
    import onnx
    from onnx import TensorProto, helper

    from exporter.contract import MODEL_FILE

    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    for path in export_dir.iterdir():
        if path.is_file() and path.name != MODEL_FILE:
            os.link(path, probe_dir / path.name)
    model = onnx.load(str(export_dir / MODEL_FILE), load_external_data=False)
    experts = [n for n in model.graph.node if n.op_type in ("MoE", "QMoE") and n.domain == "com.microsoft"]
    for i, node in enumerate(experts):
        name = f"{PROBE}{i}"
        model.graph.node.append(helper.make_node("Cast", [node.input[1]], [name], to=TensorProto.FLOAT))
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    onnx.save(model, str(probe_dir / MODEL_FILE))
    return len(experts)


def export_prefill(runtime, ops: int, prompt: list[int], pixels, extra: dict) -> tuple[np.ndarray, list[np.ndarray]]:
    """The export's prefill of ``prompt`` through its runtime: (last-position logits, each expert op's router logits
    [tokens, experts]). The probe outputs are bound beside the runtime's own on the session's first run."""
    from exporter.runtime.image_text import image_text_decode

    session, seen = runtime.decoder.session, []
    plain = session.run_with_iobinding

    def run(binding, *options):
        if not seen:
            for i in range(ops):
                binding.bind_output(f"{PROBE}{i}", "cpu")
        plain(binding, *options)
        if not seen:
            seen.extend(value.numpy() for value in binding.get_outputs()[-ops:])  # (fp32; the others may be bf16)

    session.run_with_iobinding = run
    try:
        run_ = image_text_decode(runtime, prompt, pixels, 0, **extra)
    finally:
        session.run_with_iobinding = plain
    return run_.logits[0], [np.asarray(r, np.float32).reshape(-1, r.shape[-1]) for r in seen]


def top_sets(logits: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-logits, axis=-1, kind="stable")[:, :k], axis=-1)


def compare_routing(sets: list[np.ndarray], fp32_sets: list[np.ndarray], fp32_logits: list) -> list[dict]:
    """Each (layer, token) whose top-k set is not fp32's, with fp32's margin there."""
    rows = []
    for layer, (got, want, logits) in enumerate(zip(sets, fp32_sets, fp32_logits)):
        ranked = np.sort(np.asarray(logits), axis=-1)[:, ::-1]
        k = want.shape[1]
        for token in np.nonzero((got != want).any(axis=-1))[0]:
            rows.append({"layer": layer, "token": int(token), "fp32_margin": round(float(ranked[token, k - 1] -
                                                                                         ranked[token, k]), 4),
                         "fp32_experts": want[token].tolist(), "experts": got[token].tolist()})
    return rows


def forced_logits(model, inputs: dict, sets: list[np.ndarray], last: int) -> np.ndarray:
    """``model`` run with every router's choice replaced by ``sets`` (per layer, [tokens, k]), the chosen experts'
    softmax weights renormalized: the logits at ``last``."""
    import torch

    patched = []
    for (_, router), chosen_sets in zip(routers(model), sets):
        plain = router.forward

        def forward(hidden, plain=plain, chosen_sets=torch.from_numpy(chosen_sets)):
            logits, scores, chosen = plain(hidden)
            picked = chosen_sets.to(device=chosen.device, dtype=chosen.dtype)
            kept = torch.softmax(logits.float(), -1).gather(1, picked)
            return logits, (kept / kept.sum(-1, keepdim=True)).to(scores.dtype), picked

        router.forward = forward
        patched.append(router)
    try:
        with torch.no_grad():
            return model(**inputs).logits[0, last].float().cpu().numpy()
    finally:
        for router in patched:
            vars(router).pop("forward", None)  # (no instance attribute, no reference cycle left behind)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="qwen3_5_moe_genai", help="exporter.vision.tiny_checkpoint's name")
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    parser.add_argument("--variant", default="gqa")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-routing-check"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import onnxruntime as ort
    import torch

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.image_text import PatchSequenceModel, open_image_text
    from exporter.validation.image_text import (
        PROMPTS, _grid_kwargs, image_prompt, load_image_text_reference, random_images, validation_patches,
    )
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    device = "cuda" if args.ep == "cuda" else "cpu"
    checkpoint = make_tiny_vlm_checkpoint(args.case, args.work / "ckpt" / args.case)
    fp32 = load_image_text_reference(checkpoint)
    config = fp32.config
    k = config.get_text_config().num_experts_per_tok
    image_token, vocab = config.image_token_id, config.get_text_config().vocab_size
    result = {"benchmark": "moe_routing_check", "command": "python benchmarks/moe_routing_check.py " +
              " ".join(sys.argv[1:]), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.node(),
              "onnxruntime": ort.__version__, "torch": torch.__version__, "case": args.case, "ep": args.ep,
              "variant": args.variant, "top_k": k,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
              "how": __doc__.split("For each dtype", 1)[1].strip(), "dtypes": {}}
    for dtype in args.dtypes:
        export_dir = args.work / f"{args.case}-{dtype}-{args.ep}"
        shutil.rmtree(export_dir, ignore_errors=True)
        export_model(ExportRequest(model=str(checkpoint), dtype=dtype, ep=args.ep, variant=args.variant,
                                   max_seq_len=192), export_dir, validate=False, overwrite=True)
        probe_dir = args.work / f"{args.case}-{dtype}-{args.ep}-probe"
        ops = probe_copy(export_dir, probe_dir)
        runtime = open_image_text(probe_dir, args.ep, prepack=False)
        theirs = load_image_text_reference(checkpoint, dtype).to(device)  # loaded in dtype, as transformers' users do
        entry = {"expert_ops": ops, "transformers_device": device, "prompts": {}}
        for images, label in zip((1, 2, 0), PROMPTS):
            pixels, grid, extra = None, None, {}
            if images and isinstance(runtime, PatchSequenceModel):
                patch_dim = runtime.vision.get_inputs()[0].shape[1]
                pixels, grid = validation_patches(images, runtime.spatial_merge_size, patch_dim, seed=images)
                tokens = [runtime.image_tokens(g) for g in grid]
                extra = {"image_grid_thw": grid}
            elif images:
                pixels, tokens = random_images(images, runtime.image_size, seed=images), runtime.tokens_per_image
            else:
                tokens = 0
            prompt = image_prompt(images, tokens, image_token, vocab, seed=images)

            def feed(model, on: str) -> dict:
                inputs = {"input_ids": torch.tensor([prompt], device=on)}
                if pixels is not None:
                    inputs["pixel_values"] = torch.from_numpy(pixels).to(on, next(model.parameters()).dtype)
                    inputs.update({name: value.to(on) if hasattr(value, "to") else value
                                   for name, value in _grid_kwargs(prompt, grid, image_token).items()})
                return inputs

            last = len(prompt) - 1
            ours_logits, ours_routers = export_prefill(runtime, ops, prompt, pixels, extra)
            with torch.no_grad():
                want = fp32(**feed(fp32, "cpu")).logits[0, last].float().numpy()
                got = theirs(**feed(theirs, device)).logits[0, last].float().cpu().numpy()
            reference = route(fp32, feed(fp32, "cpu"))
            fp32_sets, fp32_router_logits = [s for s, _ in reference], [r.numpy() for _, r in reference]
            their_route = route(theirs, feed(theirs, device))
            our_sets = [top_sets(r, k) for r in ours_routers]
            span = float(np.ptp(want))
            forced = forced_logits(fp32, feed(fp32, "cpu"), our_sets, last)
            forced_theirs = forced_logits(fp32, feed(fp32, "cpu"), [s for s, _ in their_route], last)
            entry["prompts"][label] = row = {
                "prompt_tokens": len(prompt), "fp32_last_logits_range": span,
                "export": {"last_logits_error": float(np.abs(ours_logits - want).max()),
                           "router_logits_max_abs_error": [round(float(np.abs(o - r).max()), 4)
                                                           for o, r in zip(ours_routers, fp32_router_logits)],
                           "routings_changed": compare_routing(our_sets, fp32_sets, fp32_router_logits)},
                "transformers": {"last_logits_error": float(np.abs(got - want).max()),
                                 "router_logits_max_abs_error": [round(float(np.abs(r.numpy() - f).max()), 4)
                                                                 for (_, r), f in zip(their_route, fp32_router_logits)],
                                 "routings_changed": compare_routing([s for s, _ in their_route], fp32_sets,
                                                                     fp32_router_logits)},
                "fp32_forced_to_export_routing": {
                    "moved_from_fp32": float(np.abs(forced - want).max()),
                    "from_export": float(np.abs(forced - ours_logits).max())},
                "fp32_forced_to_transformers_routing": {
                    "moved_from_fp32": float(np.abs(forced_theirs - want).max()),
                    "from_transformers": float(np.abs(forced_theirs - got).max())},
            }
            print(dtype, label, json.dumps({name: row[name] if not isinstance(row[name], dict) else
                                            {k2: v for k2, v in row[name].items() if k2 != "routings_changed"}
                                            for name in row}), flush=True)
            print("  export routings changed:", row["export"]["routings_changed"][:6], flush=True)
            print("  transformers routings changed:", row["transformers"]["routings_changed"][:6], flush=True)
        result["dtypes"][dtype] = entry
        del runtime, theirs
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
