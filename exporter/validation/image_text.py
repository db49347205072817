"""An image-text export against transformers' image-text model on the same weights (issue 48), one
section per component: the vision graph's image features, the embedding graph's merged inputs_embeds,
and end to end the three graphs' greedy tokens and logits on image prompts (one image, two images,
text only) against transformers' own ``generate``.

The export runs as a runtime runs it (exporter.runtime.image_text): vision -> embedding -> decoder
prefill, then each decode step's token through the embedding graph with no images. The pixels are
random normalized images at the checkpoint's size (what its image processor hands the model: the
graphs start at pixel_values), the same array to both sides. transformers is loaded whole, in fp32.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from exporter.validation.gates import GateResult
from exporter.vision.crops import CROPS_FAMILIES
from exporter.validation.reference import ReferenceRun, top2_gap
from exporter.validation.yardstick import TORCH_DTYPES

if TYPE_CHECKING:
    from exporter.validation.parity import ExportRun

# Max abs error of image features and merged embeddings, as a fraction of the reference's range (max - min).
FEATURE_TOLERANCE = {"fp32": 1e-4, "fp16": 3e-3, "bf16": 3e-2}
PROMPTS = ("one image", "two images", "text only")
# Families whose processor gives pixel_values [batch, images per row, ...] (the tiles of each row's images).
PER_ROW_IMAGES = CROPS_FAMILIES  # (the crops families: one list, exporter.vision.crops)


TEXT_TOKENS = 12  # text tokens of each validation prompt, around its images


def check_image_text_validatable(max_seq_len: int | None, cfg, steps: int) -> None:
    """Refuse an export too short for validation's two-image prompt and its decode steps (``cfg``: the checkpoint's
    exporter.vision.VisionConfig)."""
    from exporter.errors import ExportError
    from exporter.vision.config import PIXTRAL

    tokens_per_image = cfg.tokens_per_image
    # (tokens_per_image 0: a patch-sequence or padded-images tower, whose validation images are VALIDATION_GRIDS' sizes)
    image_tokens = f"2 x {tokens_per_image}" if tokens_per_image else str(_grid_tokens(VALIDATION_GRIDS[2]))
    parts = [f"{image_tokens} image tokens"]
    needed = (2 * tokens_per_image or _grid_tokens(VALIDATION_GRIDS[2])) + TEXT_TOKENS + steps
    if cfg.tower == PIXTRAL:  # each row of an image's tokens ends in a break token, its last in an end token
        rows = sum(h for _, h, _ in VALIDATION_GRIDS[2])
        parts.append(f"{rows} row-end tokens")
        needed += rows
    if max_seq_len is not None and max_seq_len < needed:
        raise ExportError(f"max_seq_len {max_seq_len} is shorter than validation's two-image prompt needs ("
                          f"{' + '.join(parts)} + {TEXT_TOKENS} text tokens + {steps} decode steps = "
                          f"{needed}): use max_seq_len {needed} or more (CLI: or --no-validate)")


# A patch-sequence tower's (qwen2_5_vl) validation images by count, as (frames, rows, columns) of merged tokens: one
# image; two of different sizes and shapes. Their patch grids are these times spatial_merge_size in rows and columns
# (a padded-images tower's, mistral3's, are these rows and columns of tokens, times patch x merge pixels, one frame).
VALIDATION_GRIDS = {1: [(1, 4, 4)], 2: [(1, 4, 6), (1, 3, 2)]}


def _grid_tokens(grids) -> int:
    return sum(t * h * w for t, h, w in grids)


def validation_patches(images: int, merge: int, patch_dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random normalized patches of VALIDATION_GRIDS[images] as the Qwen2-VL image processor lays them out
    ([patches, patch_dim] fp32) and their image_grid_thw [images, 3]."""
    grid_thw = np.array([(t, h * merge, w * merge) for t, h, w in VALIDATION_GRIDS[images]], np.int64)
    patches = np.random.default_rng(seed).standard_normal((int(grid_thw.prod(axis=1).sum()), patch_dim))
    return patches.astype(np.float32), grid_thw


def validation_padded_images(images: int, token_pixels: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random normalized images of VALIDATION_GRIDS[images] tokens (rows and columns times ``token_pixels``: patch x
    merge) zero-padded to the largest, as PixtralImageProcessor batches them ([images, 3, H, W] fp32), and their
    image_sizes [images, 2] in pixels."""
    sizes = np.array([(h * token_pixels, w * token_pixels) for _, h, w in VALIDATION_GRIDS[images]], np.int64)
    rng = np.random.default_rng(seed)
    pixels = np.zeros((images, 3, *sizes.max(axis=0)), np.float32)
    for i, (height, width) in enumerate(sizes):
        pixels[i, :, :height, :width] = rng.standard_normal((3, height, width))
    return pixels, sizes


def pixtral_image_run(rows: int, cols: int, image_token_id: int, break_token_id: int, end_token_id: int) -> list[int]:
    """One image's tokens as PixtralProcessor writes them: ``cols`` image tokens and a break token per row, the last
    row's break an end token."""
    run = ([image_token_id] * cols + [break_token_id]) * rows
    return run[:-1] + [end_token_id]


def load_image_text_reference(checkpoint: Path, dtype: str = "fp32"):
    """transformers' image-text model of ``checkpoint``, in eval, in fp32 (or ``dtype``: fp16 / bf16, the yardstick's)."""
    import torch
    import transformers

    torch_dtype = torch.float32 if dtype == "fp32" else getattr(torch, TORCH_DTYPES[dtype])
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch_dtype)
    return model.eval()


def language_model_module(model):
    """transformers' image-text model's language model (``model.language_model``; idefics3 / smolvlm's
    ``model.text_model``): the decoder layers the export's model.onnx holds."""
    return getattr(model.model, "language_model", None) or model.model.text_model


def open_image_text_reference(checkpoint: Path):
    """The image-text counterpart of ``reference.open_reference``: transformers' image-text model of
    ``checkpoint``, whole, in fp32, on the host whatever the EP (as validation holds it, and as the job's
    estimate counts it: exporter.resources: a whole fp32 model is four times a bf16 checkpoint, which a GPU holding
    the export does not have beside it), called as the streamed reference is (``reference.WholeReference``). Text
    ids alone run its language model as the image-text model runs a text prompt (Qwen's text-only M-RoPE positions
    included)."""
    from exporter.validation.reference import WholeReference

    return WholeReference(Path(checkpoint), "cpu", load_image_text_reference(checkpoint))


def random_images(count: int, size: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """``count`` normalized images [count, channels, size, size] fp32, as an image processor gives them."""
    return np.random.default_rng(seed).standard_normal((count, channels, size, size)).astype(np.float32)


def image_prompt(images: int, tokens_per_image: int | list[int], image_token_id: int, vocab: int,
                 text_tokens: int = TEXT_TOKENS, seed: int = 0, image_runs: list[list[int]] | None = None) -> list[int]:
    """A prompt of random text tokens around ``images`` images' tokens (each image's tokens in one run;
    ``tokens_per_image`` a list: each image's own count; ``image_runs``: each image's own token sequence, in place of
    its image tokens)."""
    rng = np.random.default_rng(seed)
    text = [int(t) for t in rng.integers(3, vocab, size=text_tokens) if t != image_token_id]
    cut = np.linspace(0, len(text), images + 2).astype(int)[1:-1]  # where the images go between text
    counts = tokens_per_image if isinstance(tokens_per_image, list) else [tokens_per_image] * images
    runs = image_runs or [[image_token_id] * tokens for tokens in counts]
    prompt, start = [], 0
    for c, run in zip(cut, runs):
        prompt += text[start:c] + list(run)
        start = c
    return prompt + text[start:]


def _pixels_for(model, pixels: np.ndarray | None):
    import torch

    if pixels is None or not len(pixels):
        return None
    pixel_values = torch.from_numpy(pixels)
    return pixel_values[None] if model.config.model_type in PER_ROW_IMAGES else pixel_values


def deepstack_maps(model) -> int:
    """How many deepstack maps transformers' model adds to its language model's first layers (Qwen3-VL's
    deepstack_merger_list; 0 for a tower without one)."""
    return len(getattr(getattr(model.model, "visual", None), "deepstack_merger_list", None) or ())


def reference_features(model, pixels: np.ndarray, image_grid_thw: np.ndarray | None = None,
                       image_sizes: np.ndarray | None = None) -> np.ndarray:
    """transformers' ``get_image_features``, per image: [images, tokens, text hidden] (``image_grid_thw``: a
    patch-sequence tower's, ``image_sizes``: a padded-images tower's; their per-image tuple concatenated, [image
    tokens, text hidden]; Qwen3-VL's: each row its pooler_output then its deepstack_features side by side, [image
    tokens, text hidden x (1 + maps)], as the export's wide image_features)."""
    import torch

    with torch.no_grad():
        sized = image_grid_thw if image_grid_thw is not None else image_sizes
        if sized is not None:  # the second argument of either's get_image_features
            out = model.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(sized))
            maps = [torch.cat(list(per_image)) for per_image in getattr(out, "deepstack_features", None) or ()]
            return torch.cat([torch.cat(list(out.pooler_output)), *maps], dim=-1).numpy()
        out = model.model.get_image_features(_pixels_for(model, pixels)).pooler_output
    if model.config.model_type in PER_ROW_IMAGES:  # one flat row of features per batch row
        (flat,) = out
        return flat.reshape(len(pixels), -1, flat.shape[-1]).numpy()
    return (torch.stack(list(out)) if isinstance(out, (list, tuple)) else out).numpy()


def _grid_kwargs(prompt: list[int], image_grid_thw: np.ndarray | None, image_token_id: int | None,
                 image_sizes: np.ndarray | None = None) -> dict:
    """A patch-sequence model's image arguments beside pixel_values: the grids, and mm_token_type_ids (1 at image
    tokens), from which its get_rope_index places the images on M-RoPE's streams, as its processor gives them; a
    padded-images model's: image_sizes."""
    import torch

    if image_sizes is not None:
        return {"image_sizes": torch.from_numpy(image_sizes)}
    if image_grid_thw is None:
        return {}
    return {"image_grid_thw": torch.from_numpy(image_grid_thw),
            "mm_token_type_ids": (torch.tensor([prompt]) == image_token_id).int()}


def reference_embeds(model, prompt: list[int], pixels: np.ndarray | None,
                     image_grid_thw: np.ndarray | None = None, image_sizes: np.ndarray | None = None) -> np.ndarray:
    """The inputs_embeds transformers' model hands its language model for one prompt row. Qwen3-VL's with its
    deepstack maps beside them as the export's wide inputs_embeds carry them: map k at the positions transformers adds
    it to (visual_pos_masks), zeros elsewhere."""
    import torch

    captured = {}
    hook = language_model_module(model).register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    grids = _grid_kwargs(prompt, image_grid_thw, getattr(model.config, "image_token_id", None), image_sizes)
    try:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([prompt]), pixel_values=_pixels_for(model, pixels), **grids)
    finally:
        hook.remove()
    embeds = captured["inputs_embeds"]
    maps = [torch.zeros_like(embeds) for _ in range(deepstack_maps(model))]
    for wide, added in zip(maps, captured.get("deepstack_visual_embeds") or ()):
        wide[captured["visual_pos_masks"]] = added
    return torch.cat([embeds, *maps], dim=-1).numpy()


def reference_generate(model, prompt: list[int], pixels: np.ndarray | None, steps: int,
                       image_grid_thw: np.ndarray | None = None, image_sizes: np.ndarray | None = None) -> ReferenceRun:
    """transformers' own greedy ``generate`` (``steps`` tokens, no stop at end-of-sequence) and the raw
    logits that chose each token."""
    import torch

    pixel_values = _pixels_for(model, pixels)  # (passed as None, generate would encode it all the same)
    images = {} if pixel_values is None else {
        "pixel_values": pixel_values,
        **_grid_kwargs(prompt, image_grid_thw, getattr(model.config, "image_token_id", None), image_sizes)}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), **images, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    logits = [step[0].float().numpy() for step in out.logits]
    tokens = [int(t) for t in out.sequences[0, len(prompt):]]
    return ReferenceRun(list(prompt), logits[0], tokens, logits, [top2_gap(step) for step in logits])


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Max abs error as a fraction of the reference's range."""
    if ours.shape != reference.shape:
        raise ValueError(f"shape {list(ours.shape)} where transformers gives {list(reference.shape)}")
    span = float(np.ptp(reference)) or 1.0
    return float(np.abs(ours.astype(np.float64) - reference).max() / span)


def _component_gate(gate: str, check: str, error: float, tolerance: float, what: str) -> GateResult:
    ok = bool(error <= tolerance)
    return GateResult(gate, check, ok, error, tolerance,
                      "" if ok else f"{what} differ from transformers' by {error:.3g} of their range",
                      details={"relative_to": "the reference's range (max - min)"})


def crops_vision_encoder_gate(checkpoint: Path, model, vision_dtype: str, ep: str, activations: str,
                              seed: int = 3) -> tuple[GateResult, dict]:
    """idefics3 / smolvlm's hf layout: the vision_encoder transformers.js runs is not the farm's vision graph but one
    that takes its crops and pixel mask (exporter.vision.graphs.build_crops_vision_graph, on the same weights), so it
    is judged on its own against transformers' get_image_features: two prompts' crops, one of them an all-zero
    padding crop (dropped) and one with padding pixels (its patch mask and positions), within the vision tolerance."""
    import tempfile

    import onnx_ir as ir
    import onnxruntime as ort
    import torch

    from exporter import contract
    from exporter.packaging.external_data import write_model_files
    from exporter.runtime.device import cuda_provider
    from exporter.vision.graphs import build_crops_vision_graph

    graph = build_crops_vision_graph(checkpoint, ir.DataType[vision_dtype])
    size = int(graph.graph.inputs[0].shape[-1])
    rng = np.random.default_rng(seed)
    pixels = rng.normal(size=(2, 2, 3, size, size)).astype(np.float32)
    mask = np.ones((2, 2, size, size), bool)
    pixels[1, 1], mask[1, 1] = 0.0, False  # the second prompt's padding crop
    mask[0, 1, size // 2:, :], mask[0, 1, :, size * 3 // 4:] = False, False  # padding pixels of a crop
    pixels[0, 1][:, ~mask[0, 1]] = 0.0
    with tempfile.TemporaryDirectory(prefix="crops-vision-") as work:
        write_model_files(graph, Path(work), model_file=contract.VISION_FILE)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        providers = [cuda_provider()] if ep == "cuda" else ["CPUExecutionProvider"]  # the worker's bound GPU
        session = ort.InferenceSession(str(Path(work) / contract.VISION_FILE), options, providers=providers)
        got = session.run(None, {contract.PIXEL_VALUES: pixels, contract.PIXEL_ATTENTION_MASK: mask})[0]
        del session
    with torch.no_grad():
        want = torch.cat(model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(mask)).pooler_output)
    want = want.float().numpy()
    tolerance = FEATURE_TOLERANCE[activations]
    error = relative_error(got.astype(np.float32), want) if got.shape == want.shape else float("inf")
    gate = _component_gate("vision", "hf layout vision_encoder (transformers.js's crops and pixel mask) max abs error "
                           "/ range", error, tolerance, "the crops vision_encoder's features")
    return gate, {"prompt": "transformers.js crops: 2 prompts x 2 crops, one padding crop, one with padding pixels",
                  "images": 3, "shape": list(got.shape), "max_abs_error_of_range": error, "tolerance": tolerance}


class PromptDecode(NamedTuple):
    """One validation prompt's runs, kept to be judged once every prompt has run."""

    position: int  # where its gates go in the gate list
    label: str
    images: int
    prompt: list[int]
    pixels: np.ndarray | None
    extra: dict  # image_grid_thw / image_sizes
    run: ExportRun  # the export teacher-forced on the reference's tokens
    ref: ReferenceRun
    own: ExportRun  # the export free-running


def image_text_gates(export_dir: Path, checkpoint: Path, ep: str, dtype: str, activations: str, steps: int,
                     model=None, manifest: dict | None = None) -> tuple[list[GateResult], dict]:
    """Every component of the image-text export in ``export_dir`` against transformers on ``checkpoint``:
    (gates, the report's sections by component). ``model``: transformers' fp32 model, where the caller holds it; a
    list holding it hands it over (it is freed here once its runs are done, before a yardstick loads another).
    A quantized export's end-to-end figures inform (its weights are not the checkpoint's; its decoder is judged on
    text by the quality gate, validate.py); its vision and embedding graphs, which are not quantized, are judged.
    Each prompt's end-to-end section carries the quality gate's mean KL and agreement over its teacher-forced steps,
    reported: whether image-conditioned quality matches the text's. A half-precision export that departs on a prompt is
    read beside transformers in its dtype there (``image_text_yardsticks``)."""
    from exporter.runtime.image_text import PaddedImagesModel, PatchSequenceModel, image_text_decode, open_image_text
    from exporter.validation.gates.parity import parity_gates
    from exporter.validation.gates.quality import step_figures

    quantized = dtype in ("int4", "int8")
    decodes: list[PromptDecode] = []
    tolerance = FEATURE_TOLERANCE[activations]
    model = model.pop() if isinstance(model, list) else model if model is not None else load_image_text_reference(checkpoint)
    runtime = open_image_text(export_dir, ep, prepack=False, spin=False)
    tpi, image_token, vocab = runtime.tokens_per_image, runtime.image_token_id, runtime.decoder.vocab
    patch_sequence = isinstance(runtime, PatchSequenceModel)  # qwen2_5_vl: patches + image_grid_thw, M-RoPE
    padded = isinstance(runtime, PaddedImagesModel)  # mistral3: images of their own sizes padded, image_sizes
    gates: list[GateResult] = []
    sections: dict = {"vision": [], "embedding": [], "end_to_end": []}
    for images, label in zip((1, 2, 0), PROMPTS):
        pixels = random_images(images, runtime.image_size, seed=images) if images else None
        grid, sizes, tokens, runs = None, None, tpi, None
        if patch_sequence and images:
            patch_dim = runtime.vision.get_inputs()[0].shape[1]
            pixels, grid = validation_patches(images, runtime.spatial_merge_size, patch_dim, seed=images)
            tokens = [runtime.image_tokens(g) for g in grid]
        if padded and images:
            pixels, sizes = validation_padded_images(images, runtime.token_pixels, seed=images)
            tokens = [runtime.image_tokens(size) for size in sizes]
            # [IMG_BREAK] / [IMG_END] are ordinary tokens the config does not name: two text ids stand in for them
            drawn = np.random.default_rng(100 + images).integers(3, vocab, size=4)
            breaks = [int(t) for t in drawn if t != image_token]
            runs = [pixtral_image_run(*runtime.token_grid(size), image_token, breaks[0], breaks[1]) for size in sizes]
        prompt = image_prompt(images, tokens, image_token, vocab, seed=images, image_runs=runs)
        extra = {"image_grid_thw": grid, "image_sizes": sizes}
        suffix = f", {label}"
        if images:
            features = (runtime.image_features(pixels) if grid is None and sizes is None else
                        runtime.image_features(pixels, grid if grid is not None else sizes))
            reference = reference_features(model, pixels, **extra)
            error = relative_error(features, reference)
            maps = []
            if runtime.deepstack:  # qwen3_vl: the merged features and each deepstack map, each against its own range
                width = runtime.text_hidden
                error = relative_error(features[:, :width], reference[:, :width])
                maps = [{"map": k, "decoder_layer": k, "max_abs_error_of_range": relative_error(
                    features[:, (k + 1) * width:(k + 2) * width], reference[:, (k + 1) * width:(k + 2) * width])}
                    for k in range(runtime.deepstack)]
            gates.append(_component_gate("vision", f"image features max abs error / range{suffix}", error, tolerance,
                                         "image features"))
            gates += [_component_gate("vision", f"deepstack map {m['map']} max abs error / range{suffix}",
                                      m["max_abs_error_of_range"], tolerance, f"deepstack map {m['map']}'s features")
                      for m in maps]
            sections["vision"].append({"prompt": label, "images": images, "shape": list(features.shape),
                                       "max_abs_error_of_range": max([error] + [m["max_abs_error_of_range"] for m in maps]),
                                       "tolerance": tolerance,
                                       **({"merged_max_abs_error_of_range": error, "deepstack": maps} if maps else {}),
                                       **({"image_sizes": sizes.tolist()} if sizes is not None else {})})
        else:
            features = None
        embeds = runtime.embed(np.array([prompt], np.int64), features)
        error = relative_error(embeds, reference_embeds(model, prompt, pixels, **extra))
        gates.append(_component_gate("embedding", f"merged inputs_embeds max abs error / range{suffix}", error,
                                     tolerance, "merged embeddings"))
        sections["embedding"].append({"prompt": label, "images": images, "tokens": len(prompt),
                                      "image_tokens": prompt.count(image_token), "max_abs_error_of_range": error,
                                      "tolerance": tolerance})
        ref = reference_generate(model, prompt, pixels, steps, **extra)
        # teacher-forced on transformers' tokens
        run = image_text_decode(runtime, prompt, pixels, steps, ref.tokens, **extra)
        own = image_text_decode(runtime, prompt, pixels, steps, **extra)  # and free-running, as a runtime generates
        decodes.append(PromptDecode(len(gates), label, images, prompt, pixels, extra, run, ref, own))
    request = (manifest or {}).get("request") or {}
    vision = ((manifest or {}).get("image_text") or {}).get("components", {}).get("vision") or {}
    if request.get("layout") == "hf" and (manifest or {}).get("image_text", {}).get("model_type") in PER_ROW_IMAGES:
        gate, section = crops_vision_encoder_gate(checkpoint, model, vision.get("dtype", "FLOAT"), ep, activations)
        gates.append(gate)
        sections["vision"].append(section)
    # Where a half-precision export departs on a prompt: a mixture of experts' departures that near-tie expert choices
    # taken the other way reproduce are named so by replaying transformers' fp32 with them (routing.py), while the fp32
    # model is here; then, for the prompts still departing, transformers in the export's dtype says whether the dtype
    # or the export departed, as for a text export (yardstick.py). Neither changes the verdict of a prompt that passes.
    departed = [d for d in decodes if not quantized and dtype in TORCH_DTYPES
                and not all(g.passed for g in parity_gates(d.run, d.ref, dtype, prompt=d.label, ep=ep)[0])]
    routing_ties = {d.label: explain_routing(model, dtype, d) for d in departed}
    del runtime, model  # their memory (and the sessions' on the GPU), before transformers in the export's dtype
    gc.collect()  # (a transformers model is a graph of cycles: without a collection its memory stays until one runs)
    departed = [d for d in departed if not all(g.passed for g in parity_gates(
        d.run, d.ref, dtype, prompt=d.label, ep=ep, routing_ties=routing_ties[d.label])[0])]
    yardsticks = image_text_yardsticks(checkpoint, dtype, ep, departed) if departed else {}
    added = 0
    for d in decodes:
        run, ref = d.run, d.ref
        judged, result = parity_gates(run, ref, activations if quantized else dtype, *yardsticks.get(d.label, ()),
                                      prompt=d.label, ep=ep, routing_ties=routing_ties.get(d.label))
        worst = max(float(np.abs(got - want).max()) for got, want in zip(run.logits, ref.step_logits))
        # the quality gate's figures on this prompt's steps: does image-conditioned quality match the text's?
        figures = step_figures(ref.step_logits, run.logits)
        for gate in judged:
            if quantized:
                gate.informational = True
                gate.message = ("quantized weights: reported against fp32 transformers, not judged"
                                + (f" ({gate.message})" if gate.message else ""))
        gates[d.position + added:d.position + added] = judged
        added += len(judged)
        sections["end_to_end"].append({
            "prompt": d.label, "images": d.images, "prompt_tokens": len(d.prompt), **result.to_dict(),
            "steps_max_abs_error": worst, "steps_kl_mean": figures["kl_mean"], "steps_kl_max": figures["kl_max"],
            "steps_agreement": figures["agreement"], "steps_agreement_all": figures["agreement_all"],
            "steps_decisive": figures["decisive_positions"], "reference_tokens": ref.tokens,
            "greedy_tokens": d.own.chosen, "greedy_equal": d.own.chosen == ref.tokens})
    return gates, sections


def yardstick_device(model, ep: str) -> str:
    """Where transformers' ``model`` (in a half precision) runs beside a departed export: the export's GPU (as a text
    export's yardstick, yardstick.cached_measure) where it fits the free memory with a quarter to spare and a GiB for
    activations, else the host."""
    import torch

    from exporter.runtime.device import cuda_device
    from exporter.validation.streamed import reference_device

    device = reference_device(ep, cuda_device())
    if device == "cpu":
        return device
    need = sum(p.numel() * p.element_size() for p in model.parameters()) * 1.25 + (1 << 30)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return device if need <= free else "cpu"


def image_text_yardsticks(checkpoint: Path | None, dtype: str, ep: str, decodes: list[PromptDecode]) -> dict:
    """transformers' image-text model of ``checkpoint`` loaded in ``dtype`` (as a user of transformers loads it: modules
    transformers keeps in fp32 stay fp32) on each departed prompt of ``decodes``, and where that is not sound the
    other half precision: {prompt: (its Drift, the other's or None)}. A yardstick is not a gate: one that cannot run
    (no checkpoint, a failure) is logged and the export judged without it ({})."""
    from exporter import checkpoints
    from exporter.validation import yardstick
    from exporter.validation.gates.parity import NEAR_TIE_MARGIN, PREFILL_TOLERANCE

    def measured(in_dtype: str, rows: list[PromptDecode]) -> dict:
        """Each prompt's Drift (None for one a single pass cannot feed: a generated image token)."""
        import torch

        model = load_image_text_reference(checkpoint, in_dtype)
        try:
            device = yardstick_device(model, ep)
            model.to(device)
            drifts = {}
            for d in rows:
                try:
                    drifts[d.label] = image_text_drift(model, in_dtype, device, d)
                except Exception as err:  # (a generated image token, out of memory) that prompt's yardstick only
                    if checkpoints.is_stop(err):
                        raise
                    logging.getLogger(__name__).warning("transformers in %s not run on %s: %s", in_dtype, d.label, err)
                    drifts[d.label] = None
            return drifts
        finally:
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the memory back to the GPU (for the other dtype's model, the next job)

    if checkpoint is None:
        return {}
    try:
        same = measured(dtype, decodes)
        unsound = [d for d in decodes if same[d.label] is not None
                   and not yardstick.sound(same[d.label], d.ref, PREFILL_TOLERANCE[dtype], NEAR_TIE_MARGIN[dtype])]
        other = measured(yardstick.OTHER[dtype], unsound) if unsound else {}
        return {label: (drift, other.get(label)) for label, drift in same.items() if drift is not None}
    except Exception as err:
        if checkpoints.is_stop(err):
            raise  # a cancel or a lost lease, not a failure of this step
        logging.getLogger(__name__).warning("transformers in %s could not run beside the export: %s", dtype, err)
        return {}


def image_text_drift(model, dtype: str, device: str, decode: PromptDecode):
    """transformers' image-text ``model`` (in ``dtype`` on ``device``) fed ``decode``'s prompt, its images and its
    reference's tokens in one pass (teacher-forced, as yardstick.measure feeds a text model): its Drift from the
    reference."""
    import torch

    from exporter.validation.yardstick import drift

    with torch.no_grad():
        logits = model(**teacher_forced_inputs(model, device, decode)).logits[0, len(decode.prompt) - 1:]
    result = drift("transformers", dtype, list(logits.float().cpu().numpy()), decode.ref)
    result.device = device
    return result


def teacher_forced_inputs(model, device: str, decode: PromptDecode) -> dict:
    """transformers' ``model``'s inputs for ``decode``'s prompt, its images and its reference's tokens, in one pass on
    ``device``. A generated token that is the image token would ask that pass for an image's features: refused
    (ValueError)."""
    import torch

    prompt, extra = decode.prompt, decode.extra
    image_token = getattr(model.config, "image_token_id", None)
    fed = list(decode.ref.tokens[:-1])
    if image_token in fed:
        raise ValueError(f"the reference generated the image token ({image_token}): one teacher-forced pass would take "
                         "it for an image's")
    inputs = {"input_ids": torch.tensor([list(prompt) + fed], device=device)}
    pixel_values = _pixels_for(model, decode.pixels)
    if pixel_values is not None:
        inputs["pixel_values"] = pixel_values.to(device, model.dtype)
        for name, value in _grid_kwargs(prompt, extra.get("image_grid_thw"), image_token, extra.get("image_sizes")).items():
            if name == "mm_token_type_ids":  # the fed tokens are text
                value = torch.nn.functional.pad(value, (0, len(fed)))
            inputs[name] = value.to(device)
    return inputs


def explain_routing(model, dtype: str, decode: PromptDecode) -> dict:
    """Which departures of ``decode`` flipped near-tie expert choices of transformers' fp32 ``model`` explain
    (routing.explain_run): {step: RoutingTie}."""
    from exporter import checkpoints
    from exporter.validation import routing

    if not routing.routers(model):
        return {}
    try:
        inputs = teacher_forced_inputs(model, "cpu", decode)
    except Exception as err:  # (a generated image token: no one pass to replay) it explains, it is not a gate
        if checkpoints.is_stop(err):
            raise
        logging.getLogger(__name__).warning("the routing replay could not run on %s: %s", decode.label, err)
        return {}
    return routing.explain_run(model, inputs, decode.run, decode.ref, dtype)


def render_sections(sections: dict) -> list[str]:
    """The report's markdown for the components (parity_report.md)."""
    lines = ["", "## Vision features", "", "| prompt | images | max abs error / range | tolerance |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {s['prompt']} | {s['images']} | {s['max_abs_error_of_range']:.3g} | {s['tolerance']:.3g} |"
              for s in sections.get("vision", [])]
    deepstack = [(s, m) for s in sections.get("vision", []) for m in s.get("deepstack", ())]
    if deepstack:  # qwen3_vl: each map against its own range (the row above: the worst of them and the merged features)
        lines += ["", "Deepstack maps (added after decoder layer k at the image positions; image_features and "
                  "inputs_embeds carry them beside the merged features):", "",
                  "| prompt | merged features | map | decoder layer | max abs error / range |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['prompt']} | {s['merged_max_abs_error_of_range']:.3g} | {m['map']} | {m['decoder_layer']} | "
                  f"{m['max_abs_error_of_range']:.3g} |" for s, m in deepstack]
    lines += ["", "## Merged embeddings", "", "| prompt | tokens | image tokens | max abs error / range | tolerance |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s['prompt']} | {s['tokens']} | {s['image_tokens']} | {s['max_abs_error_of_range']:.3g} | "
              f"{s['tolerance']:.3g} |" for s in sections.get("embedding", [])]
    lines += ["", "## End to end (vision -> embedding -> decoder)", "",
              "| prompt | steps | prefill max abs error | logit range | steps max abs error | mismatches | "
              "near ties | greedy tokens equal | steps mean KL (nats) | steps agreement (decisive) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {s['prompt']} | {s['steps']} | {s['prefill_max_abs_error']:.3g} | {s['logit_range']:.3g} | "
              f"{s['steps_max_abs_error']:.3g} | {s['mismatches']} | {len(s['near_ties'])} | {s['greedy_equal']} | "
              f"{_figure(s.get('steps_kl_mean'))} | {_figure(s.get('steps_agreement'))} "
              f"({s.get('steps_decisive', '-')}) |"
              for s in sections.get("end_to_end", [])]
    lines += ["", "Steps mean KL and agreement: the quality gate's figures on each prompt's teacher-forced steps "
              "against transformers, reported, not judged (a few dozen positions; the quality gate judges text)."]
    from exporter.validation.routing import render_ties

    return lines + render_ties([(s["prompt"], s) for s in sections.get("end_to_end", [])])


def _figure(value) -> str:
    """A figure of the report as the markdown shows it (a report written before it was measured: '-')."""
    return "-" if value is None else f"{float(value):.4g}"


def component_weight_gates(export_dir: Path, manifest: dict, checkpoint, activations: str) -> list[GateResult]:
    """The weight gate's by-value check of the vision and embedding graphs (in the activation dtype, never
    quantized), each against the checkpoint tensors its manifest entry names."""
    from exporter.validation.gates.weights import weight_integrity

    everything = frozenset(checkpoint.names())  # which tensors no graph holds is the decoder's check
    gates = []
    for name, component in manifest["image_text"]["components"].items():
        if "initializers" not in component:
            continue  # the decoder: checked as model.onnx
        (slices, _exported), _stats = weight_integrity(Path(export_dir) / component["file"], component, checkpoint,
                                                       activations, activations, False, everything)
        slices.check = f"{name}: {slices.check}"
        gates.append(slices)
    return gates
