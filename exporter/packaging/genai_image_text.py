"""Package stage, onnxruntime-genai part of an image-text export: genai_config.json with vision, embedding and
decoder sections, onnxruntime-extensions' image processor (ort_image_processor.json) and the tokenizer files.

genai 0.18 runs an image prompt as three sessions named by genai_config.json: the vision graph on the
pixel_values its own processor makes (decode, resize, rescale, normalize, channels first: the transforms
written here from the checkpoint's image processor settings), the embedding graph at every step (the
prompt with the image rows, each new token with none: image_features [0, hidden]), then the decoder on
inputs_embeds. The export's vision.onnx, embedding.onnx and model.onnx are those graphs unchanged
(image_features is 2-D, exporter.vision); nothing is written twice.

Only model types genai has a processor for get a package. Of the families exported, gemma3 (genai's
``gemma3``: GemmaImageProcessor, which expands each ``<start_of_image>`` of a prompt to 256
``<image_soft_token>``, a constant) and qwen2_5_vl (genai's ``qwen2_5_vl``: QwenImageProcessor, whose
onnxruntime-extensions transforms smart-resize the image and cut it into the flattened patches and
image_grid_thw the vision graph takes, and which expands each ``<|vision_start|>`` to t x h x w / merge^2
``<|image_pad|>``; genai computes the decoder's M-RoPE position_ids [3, batch, seq] itself, as transformers'
get_rope_index), qwen3_vl and qwen3_vl_moe (genai's ``qwen3_vl``: the same processor and positions; the vision graph's
image_features and the decoder's inputs_embeds are hidden x (1 + deepstack maps) wide, exporter.contract.image_text_width,
so genai_config's decoder.hidden_size, by which genai sizes both, says that width), qwen3_5 and qwen3_5_moe (genai's
``qwen3_5`` / ``qwen3_5_moe``: the same processor and positions; the hybrid decoder's past_conv.i / past_recurrent.i,
named by past_conv_names / past_recurrent_names as in its text package, are carried by the multimodal decoder state as
by the text one), and mistral3 (genai's ``mistral3``: Mistral3ImageProcessor, whose onnxruntime-extensions
transforms resize, normalize and report each image's size (PixtralImageSizes), and which expands each ``[IMG]`` of a
prompt to the image's rows of ``[IMG]`` ending in ``[IMG_BREAK]``, the last in ``[IMG_END]``; its vision state runs the
vision graph once per image on that image's pixels alone, which the graph's optional image_sizes lets it do); llava,
idefics3 and smolvlm have no genai VLM type in 0.18 and are refused with the reason in the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from exporter.contract import (
    EMBEDDING_FILE, GENAI_CONFIG_FILE, GENAI_IMAGE_PROCESSOR_FILE, IMAGE_FEATURES, IMAGE_GRID_THW, INPUT_IDS,
    INPUTS_EMBEDS, PIXEL_VALUES, VISION_FILE, image_text_width,
)
from exporter.graph.config import ModelConfig
from exporter.packaging.genai import (
    GenaiPackage, _read_checkpoint_json, align_special_tokens, build_genai_config, copy_tokenizer_files,
    genai_unsupported_reason,
)
from exporter.request import ExportRequest, Variant

# Hugging Face model_type -> genai model.type of the image-text types whose processor genai 0.18 has.
GENAI_IMAGE_TEXT_TYPES = {"gemma3": "gemma3", "qwen2_5_vl": "qwen2_5_vl", "mistral3": "mistral3",
                          "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "qwen3_5": "qwen3_5",
                          "qwen3_5_moe": "qwen3_5_moe"}
# The Qwen-VL families genai runs with its QwenImageProcessor (<|vision_start|> .. <|vision_end|>, patches and
# image_grid_thw) and its M-RoPE positions (model_type.h IsQwenVLFamily).
QWEN_VL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# genai 0.18's gemma3 processor: the prompt's marker, what it expands it to, and how many image tokens (constant).
GEMMA3_BOI, GEMMA3_IMAGE_TOKEN, GEMMA3_EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
GEMMA3_GENAI_IMAGE_TOKENS = 256
# genai 0.18's qwen2_5_vl processor: it expands each vision start .. end of a prompt to the image's pad tokens.
QWEN_VISION_START, QWEN_IMAGE_PAD, QWEN_VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# genai 0.18's mistral3 processor: the tokens it writes for an image (looked up by these names in the tokenizer).
PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
# transformers' (PIL's) resample codes -> onnxruntime-extensions Resize interpolation.
INTERPOLATION = {0: "NEAREST", 2: "LINEAR", 3: "CUBIC"}
_RESAMPLE_NAMES = {"nearest": 0, "bilinear": 2, "linear": 2, "bicubic": 3, "cubic": 3}


def write_genai_image_text_package(
    out_dir: Path, source_dir: Path, config: ModelConfig, variant: Variant, request: ExportRequest,
    image_text: dict, decoder_inputs: Sequence[str], decoder_outputs: Sequence[str],
) -> GenaiPackage:
    """Copy the checkpoint's tokenizer files and, where genai 0.18 can run the image-text export, write
    genai_config.json and ort_image_processor.json; otherwise say why in the returned package.
    ``config``: the language model's; ``image_text``: the manifest's ``image_text`` entry (model_type,
    tokens_per_image, image_token_id, image_size, components); ``decoder_*``: model.onnx's I/O names."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    tokenizer_files = copy_tokenizer_files(source_dir, out_dir)
    model_type = image_text["model_type"]
    # genai feeds the decoder inputs_embeds where a text decoder takes input_ids: the same check otherwise
    as_text = [INPUT_IDS if name == INPUTS_EMBEDS else name for name in decoder_inputs]
    reason = genai_image_text_reason(model_type) or genai_unsupported_reason(config, variant, as_text)
    processor = None
    if reason is None:
        processor, reason = genai_image_processor(source_dir, image_text)
    if reason is None:
        reason = _tokenizer_reason(out_dir, source_dir, image_text)
    if reason is not None:
        return GenaiPackage(list(tokenizer_files), False, reason, tokenizer_files)
    special, unusable = align_special_tokens(source_dir, out_dir)
    genai_config = build_genai_config(config, variant, request, as_text, decoder_outputs, source_dir)
    model = genai_config["model"]
    model["type"] = GENAI_IMAGE_TEXT_TYPES[model_type]
    model["image_token_id"] = image_text["image_token_id"]
    vision_keys = {}
    if model_type == "mistral3":  # what genai's processor and per-image vision runs count each image's tokens by
        vision_keys = _pixtral_settings(source_dir)
    if model_type in QWEN_VL_TYPES:  # what genai's M-RoPE positions and its processor's prompt expansion read
        qwen = _qwen_settings(source_dir)
        model["vision_start_token_id"] = qwen["vision_start_token_id"]
        model["video_token_id"] = qwen["video_token_id"]
        vision_keys = {k: qwen[k] for k in ("spatial_merge_size", "patch_size", "window_size", "tokens_per_second")
                       if qwen[k] is not None}
    # genai allocates the vision graph's image_features [tokens, hidden_size] and the embedding graph's inputs_embeds
    # [batch, seq, hidden_size] (its multi_modal_features.cpp, embeddings.cpp) by decoder.hidden_size: qwen3_vl's are
    # wide, its deepstack maps riding beside the hidden states (contract.image_text_width), so that is the width here
    model["decoder"]["hidden_size"] = image_text_width(config.hidden_size, (image_text.get("deepstack") or {}).get("maps", 0))
    decoder = model["decoder"]
    decoder["inputs"] = {"inputs_embeds": INPUTS_EMBEDS,
                         **{k: v for k, v in decoder["inputs"].items() if k != "input_ids"}}
    # the vision and embedding graphs run where the decoder does, with its session options
    model["embedding"] = {"session_options": decoder["session_options"], "filename": EMBEDDING_FILE,
                          "inputs": {"input_ids": INPUT_IDS, "image_features": IMAGE_FEATURES},
                          "outputs": {"inputs_embeds": INPUTS_EMBEDS}}
    vision_inputs = {"pixel_values": PIXEL_VALUES}
    if model_type in QWEN_VL_TYPES:
        vision_inputs["image_grid_thw"] = IMAGE_GRID_THW
    model["vision"] = {"session_options": decoder["session_options"], "filename": VISION_FILE,
                       "config_filename": GENAI_IMAGE_PROCESSOR_FILE, **vision_keys,
                       "inputs": vision_inputs, "outputs": {"image_features": IMAGE_FEATURES}}
    (out_dir / GENAI_IMAGE_PROCESSOR_FILE).write_text(json.dumps(processor, indent=2) + "\n")
    (out_dir / GENAI_CONFIG_FILE).write_text(json.dumps(genai_config, indent=4) + "\n")
    return GenaiPackage([GENAI_CONFIG_FILE, GENAI_IMAGE_PROCESSOR_FILE, *tokenizer_files], True, unusable,
                        tokenizer_files, genai_config, special_tokens=special)


def genai_image_text_reason(model_type: str) -> str | None:
    """Why genai 0.18 has no image-text package for ``model_type``, or None (gemma3, qwen2_5_vl, qwen3_vl,
    qwen3_vl_moe, qwen3_5, qwen3_5_moe, mistral3)."""
    if model_type in GENAI_IMAGE_TEXT_TYPES:
        return None
    return (f"onnxruntime-genai 0.18 has no image-text model type for {model_type!r} (its image processors are "
            "gemma3, phi3v, qwen2_5_vl, qwen3_vl, qwen3_5, mistral3, lfm2_vl, ...; llava, idefics3 and smolvlm decoders "
            "run there only as text models): run this export's three graphs with exporter.runtime.image_text, or with "
            "transformers.js through the hf layout")


def genai_image_processor(source_dir: Path, image_text: dict) -> tuple[dict | None, str | None]:
    """onnxruntime-extensions' image processing for genai's processor of ``image_text["model_type"]`` (gemma3
    when absent) from the checkpoint's own image processor settings (processor_config.json's
    ``image_processor``, or a v4 preprocessor_config.json): (the JSON, None), or (None, why genai's processor
    cannot make the pixel_values transformers' would)."""
    combined = _read_checkpoint_json(source_dir, "processor_config.json").get("image_processor")
    settings = combined if isinstance(combined, dict) else _read_checkpoint_json(source_dir, "preprocessor_config.json")
    if not settings:
        return None, ("the checkpoint has no image processor settings (processor_config.json or "
                      "preprocessor_config.json): genai's image processor config is written from them")
    if image_text.get("model_type") in QWEN_VL_TYPES:
        return qwen_image_processor(settings, _qwen_settings(source_dir))
    if image_text.get("model_type") == "mistral3":
        return pixtral_image_processor(settings, _pixtral_settings(source_dir),
                                       _read_checkpoint_json(source_dir, "processor_config.json"))
    size, want = settings.get("size") or {}, image_text["image_size"]
    if settings.get("do_resize", True) is False or (size.get("height"), size.get("width")) != (want, want):
        return None, (f"the image processor resizes to {size} (do_resize {settings.get('do_resize', True)}) where the "
                      f"vision graph takes {want} x {want}")
    if settings.get("do_pan_and_scan"):
        return None, "the image processor pans and scans (do_pan_and_scan): genai's gemma3 processor does not"
    resample, why = _interpolation(settings, 2)
    if why:
        return None, why
    transforms = [("decode_image", "DecodeImage", {"color_space": "RGB"}),
                  ("resize", "Resize", {"interpolation": INTERPOLATION[resample], "width": want, "height": want,
                                        "keep_aspect_ratio": 0})]
    if settings.get("do_rescale", True):
        factor = float(settings.get("rescale_factor", 1 / 255))
        if abs(factor - 1 / 255) > 1e-12:
            return None, f"the image processor rescales by {factor}: genai's Rescale multiplies by 1/255"
        transforms.append(("re-scale", "Rescale", {}))
    if settings.get("do_normalize", True):
        mean, std = settings.get("image_mean", [0.5] * 3), settings.get("image_std", [0.5] * 3)
        transforms.append(("normalize", "Normalize", {"mean": [float(m) for m in mean], "std": [float(s) for s in std]}))
    transforms.append(("to_channel_first", "Permute3D", {"dims": [2, 0, 1]}))
    return _processor_json("gemma_3_image_processing", transforms), None


def qwen_image_processor(settings: dict, qwen: dict) -> tuple[dict | None, str | None]:
    """onnxruntime-extensions' qwen2_5_image_processor from a Qwen2VLImageProcessor's ``settings`` (``qwen``: the
    checkpoint's patch / merge / temporal sizes, _qwen_settings): smart resize between min and max pixels to a
    multiple of patch x merge (HF's smart_resize), rescale, normalize, then PatchImage's flattened patches in
    transformers' order with image_grid_thw. (the JSON, None), or (None, why genai's would differ)."""
    size = settings.get("size") or {}
    low = settings.get("min_pixels", size.get("shortest_edge"))
    high = settings.get("max_pixels", size.get("longest_edge"))
    if settings.get("do_resize", True) is False or low is None or high is None:
        return None, (f"the image processor does not bound its pixels (do_resize {settings.get('do_resize', True)}, "
                      f"size {size}): genai's qwen2_5_vl processor smart-resizes between min_pixels and max_pixels")
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        ours = qwen["spatial_merge_size" if key == "merge_size" else key]
        if settings.get(key, ours) != ours:
            return None, (f"the image processor's {key} {settings[key]} is not the vision tower's {ours}: "
                          "its patches would not be the ones the vision graph takes")
    resample, why = _interpolation(settings, 3)
    if why:
        return None, why
    patch, merge = qwen["patch_size"], qwen["spatial_merge_size"]
    transforms = _smart_resize_transforms(settings, resample, int(low), int(high), patch, merge)
    transforms.append(("patch_image", "PatchImage", {"patch_size": patch, "merge_size": merge,
                                                     "temporal_patch_size": qwen["temporal_patch_size"]}))
    return _processor_json("qwen2_5_image_processor", transforms), None


def pixtral_image_processor(settings: dict, pixtral: dict, processor: dict) -> tuple[dict | None, str | None]:
    """onnxruntime-extensions' transforms for genai's mistral3 processor from a PixtralImageProcessor's ``settings``
    (``pixtral``: the tower's patch and merge sizes, _pixtral_settings; ``processor``: processor_config.json's
    PixtralProcessor settings): Resize with smart_resize to multiples of patch x merge between one token and a square
    of the longest edge, rescale, normalize, channels first, then PixtralImageSizes (each image's height and width,
    which genai slices the padded batch by). (the JSON, None), or (None, why genai's would differ).

    onnxruntime-extensions has no Pixtral resize: smart_resize rounds each side to the nearest multiple of patch x
    merge and bounds the area, where PixtralImageProcessor scales the image down to fit the longest edge (floor) and
    rounds each side up. An image whose sides are already multiples of patch x merge within the longest edge is left
    as it is by both; others may differ in size by a token (tests/test_genai_vlm_mistral3.py pins one)."""
    size = settings.get("size") or {}
    longest = size.get("longest_edge")
    if settings.get("do_resize", True) is False or not isinstance(longest, int):
        return None, (f"the image processor does not bound its longest edge (do_resize {settings.get('do_resize', True)},"
                      f" size {size}): genai's mistral3 processor resizes to multiples of patch x merge within a bound")
    patch, merge = pixtral["patch_size"], pixtral["spatial_merge_size"]
    for key, ours in (("patch_size", patch), ("spatial_merge_size", merge)):
        if processor.get(key, ours) != ours:
            return None, (f"processor_config.json's {key} {processor[key]} is not the vision tower's {ours}: its prompts "
                          "would not hold the tokens the vision graph gives")
    tokens = {k: processor.get(f"{k}_token", v) for k, v in (("image", PIXTRAL_IMAGE), ("image_break", PIXTRAL_BREAK),
                                                               ("image_end", PIXTRAL_END))}
    if tokens != {"image": PIXTRAL_IMAGE, "image_break": PIXTRAL_BREAK, "image_end": PIXTRAL_END}:
        return None, (f"the processor names its image tokens {tokens}: genai's mistral3 processor writes "
                      f"{PIXTRAL_IMAGE}, {PIXTRAL_BREAK} and {PIXTRAL_END}")
    resample, why = _interpolation(settings, 3)
    if why:
        return None, why
    transforms = _smart_resize_transforms(settings, resample, (patch * merge) ** 2, longest * longest, patch, merge)
    transforms += [("to_channel_first", "Permute3D", {"dims": [2, 0, 1]}), ("image_sizes", "PixtralImageSizes", {})]
    return _processor_json("pixtral_image_processor", transforms), None


def _interpolation(settings: dict, default: int) -> tuple[int | None, str | None]:
    """The image processor's resample (PIL's code, or its name) as an INTERPOLATION key, or (None, why
    onnxruntime-extensions cannot resize that way)."""
    resample = settings.get("resample", default)
    resample = _RESAMPLE_NAMES.get(resample.lower()) if isinstance(resample, str) else resample
    if resample not in INTERPOLATION:
        return None, (f"the image processor resamples with {settings.get('resample')!r}: onnxruntime-extensions "
                      f"resizes nearest, bilinear or bicubic only")
    return resample, None


def _smart_resize_transforms(settings: dict, resample: int, low: int, high: int, patch: int,
                             merge: int) -> list[tuple[str, str, dict]]:
    """Decode, smart_resize to multiples of patch x merge between ``low`` and ``high`` pixels, rescale (also what turns
    the decoded bytes into floats: factor 1 when not rescaling) and normalize (CLIP's mean and std where unset):
    the transforms genai's qwen2_5_vl and mistral3 processors start with."""
    factor = float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else 1.0
    transforms = [("decode_image", "DecodeImage", {"color_space": "RGB"}),
                  ("resize", "Resize", {"interpolation": INTERPOLATION[resample], "smart_resize": 1,
                                        "min_pixels": low, "max_pixels": high, "patch_size": patch,
                                        "merge_size": merge}),
                  ("rescale", "Rescale", {"rescale_factor": factor})]
    if settings.get("do_normalize", True):
        mean = settings.get("image_mean", [0.48145466, 0.4578275, 0.40821073])
        std = settings.get("image_std", [0.26862954, 0.26130258, 0.27577711])
        transforms.append(("normalize", "Normalize", {"mean": [float(m) for m in mean],
                                                      "std": [float(s) for s in std]}))
    return transforms


def _processor_json(name: str, transforms: list[tuple[str, str, dict]]) -> dict:
    """onnxruntime-extensions' processor JSON: ``transforms`` as (name, type, attrs), attrs left out where empty."""
    return {"processor": {"name": name, "transforms": [
        {"operation": {"name": op_name, "type": kind, **({"attrs": attrs} if attrs else {})}}
        for op_name, kind, attrs in transforms]}}


def _pixtral_settings(source_dir: Path) -> dict:
    """What genai's mistral3 type reads from config.json's tower: its patch and merge sizes."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(source_dir))
    return {"patch_size": config.vision_config.patch_size, "spatial_merge_size": config.spatial_merge_size}


def _qwen_settings(source_dir: Path) -> dict:
    """What genai's qwen2_5_vl / qwen3_vl / qwen3_5 types read from config.json: the vision tower's patch, merge and
    temporal sizes, qwen2_5_vl's window_size and tokens_per_second (transformers' defaults where config.json leaves them
    out; None for the Qwen3-VL / Qwen3.5 tower, which has neither: its image positions need no time scale), and the
    vision start / video token ids."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(source_dir))
    vision = config.vision_config
    per_second = getattr(vision, "tokens_per_second", None)
    return {"patch_size": vision.patch_size, "spatial_merge_size": vision.spatial_merge_size,
            "temporal_patch_size": vision.temporal_patch_size, "window_size": getattr(vision, "window_size", None),
            "tokens_per_second": None if per_second is None else float(per_second),
            "image_token_id": config.image_token_id, "vision_start_token_id": config.vision_start_token_id,
            "video_token_id": config.video_token_id}


def _tokenizer_ids(out_dir: Path) -> dict[str, int]:
    """tokenizer.json's token -> id (its vocab and added tokens)."""
    path = out_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    ids = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return {**vocab, **ids} if isinstance(vocab, dict) else ids


def _tokenizer_reason(out_dir: Path, source_dir: Path, image_text: dict) -> str | None:
    """Why genai's processor cannot tokenize an image prompt with the tokenizer copied to ``out_dir``, or None: the
    tokens it writes into a prompt must be in tokenizer.json, at the ids the model reads them by."""
    model_type = image_text["model_type"]
    image = ("image token", image_text["image_token_id"])
    if model_type == "mistral3":
        written, ids_of = (PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END), {PIXTRAL_IMAGE: image}
    elif model_type in QWEN_VL_TYPES:
        qwen = _qwen_settings(source_dir)
        written = (QWEN_VISION_START, QWEN_IMAGE_PAD, QWEN_VISION_END)
        ids_of = {QWEN_IMAGE_PAD: ("image_token_id", qwen["image_token_id"]),
                  QWEN_VISION_START: ("vision_start_token_id", qwen["vision_start_token_id"])}
    else:
        if image_text["tokens_per_image"] != GEMMA3_GENAI_IMAGE_TOKENS:
            return (f"genai 0.18's gemma3 processor expands each image to {GEMMA3_GENAI_IMAGE_TOKENS} image tokens and "
                    f"the checkpoint's vision tower gives {image_text['tokens_per_image']} (mm_tokens_per_image)")
        written, ids_of = (GEMMA3_BOI, GEMMA3_IMAGE_TOKEN, GEMMA3_EOI), {GEMMA3_IMAGE_TOKEN: image}
    ids = _tokenizer_ids(out_dir)
    missing = [t for t in written if t not in ids]
    if missing:
        return (f"genai's {model_type} processor writes {', '.join(missing)} into the prompt and the checkpoint's "
                "tokenizer.json does not hold them")
    for token, (what, want) in ids_of.items():
        if ids[token] != want:
            return f"the tokenizer gives {token} id {ids[token]} and the model's {what} is {want}"
    return None
