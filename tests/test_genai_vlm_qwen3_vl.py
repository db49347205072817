"""Qwen3-VL exports (qwen3_vl, qwen3_vl_moe) run in onnxruntime-genai 0.18's own multimodal path, model.type
"qwen3_vl": og.Model on the export folder, its QwenImageProcessor on a PNG (onnxruntime-extensions' transforms written
from the checkpoint's Qwen2VLImageProcessor settings: the flattened patches and image_grid_thw), a Generator fed with
set_inputs, genai's own M-RoPE positions.

genai has no input for the deepstack maps either; it hands the vision graph's image_features to the embedding graph and
that graph's inputs_embeds to the decoder unchanged, allocating both by genai_config.json's decoder.hidden_size
(src/models/multi_modal_features.cpp, embeddings.cpp), which the package writes as the wide width (hidden x (1 + maps):
exporter.contract.image_text_width). Its greedy tokens and every step's logits equal transformers' generate on the ids,
patches and grid genai's processor made, and those equal transformers' own processor's."""

from __future__ import annotations

import gc
import json
import re

import numpy as np
import pytest

from exporter import contract
from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
from tests.genai_greedy import genai_multimodal_run, variant_exports
from tests.test_genai_vlm_qwen import (
    IMAGE_PROMPT, IMAGE_TOKEN, MAX_SEQ_LEN, PIXEL_TOLERANCE, check_image_and_text_prompts, check_two_images_in_one_prompt,
    png,
)

og = pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

WIDTH = 64 * 3  # the text hidden size 64, times 1 + 2 deepstack maps


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> (its export in ``variant``, transformers' model, its image processor and tokenizer)."""
    import functools

    root = tmp_path_factory.mktemp("genai-qwen3_vl")

    @functools.cache
    def make(name: str):
        checkpoint = make_tiny_vlm_checkpoint(f"{name}_genai", root / f"{name}-ckpt", seed=2)
        reference = transformers.AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32)
        processor = (transformers.AutoImageProcessor.from_pretrained(str(checkpoint)),
                     transformers.AutoTokenizer.from_pretrained(str(checkpoint)))
        return variant_exports(checkpoint, root / f"{name}-exports", MAX_SEQ_LEN), reference.eval(), processor

    return make


@pytest.mark.parametrize("name, variant", [("qwen3_vl", "gqa"), ("qwen3_vl_moe", "attn_dynamic")])
def test_genai_multimodal_generates_transformers_tokens(family, tmp_path, name, variant):
    """One image + text, then text only, through genai's processor and generator (check_image_and_text_prompts)."""
    export, reference, hf_processor = family(name)
    model = og.Model(str(export(variant).out_dir))
    check_image_and_text_prompts(model, reference, hf_processor, png(tmp_path, 48, 64, seed=3), f"{name} {variant}")


def test_two_images_of_different_sizes_in_one_prompt(family, tmp_path):
    """genai pads each image's patches to the largest's (zero rows it drops before the vision graph, one run per image
    into its rows of the wide image_features); transformers on the unpadded patches gives the same tokens."""
    export, reference, _ = family("qwen3_vl")
    check_two_images_in_one_prompt(og.Model(str(export("gqa").out_dir)), reference, tmp_path, "qwen3_vl")


def test_the_package_says_the_wide_width(family, tmp_path):
    """genai_config.json: type qwen3_vl, decoder.hidden_size the wide width (the text model's is 64), the vision section
    on patches and image_grid_thw with the tower's patch and merge sizes (no window: Qwen3-VL's tower has none);
    ort_image_processor.json the checkpoint's processor (mean and std 0.5, patches of 4 over 2 frames, merged 2 x 2).
    With the text width there instead, genai cannot run the image prompt: it sizes the features it hands over by it."""
    import shutil

    export, _, _ = family("qwen3_vl")
    result = export("gqa")
    entry = result.manifest.data["genai"]
    assert entry["package"] is True and entry["reason"] is None
    config = json.loads((result.out_dir / contract.GENAI_CONFIG_FILE).read_text())
    model = config["model"]
    assert model["type"] == "qwen3_vl" and model["decoder"]["hidden_size"] == WIDTH
    assert (model["image_token_id"], model["vision_start_token_id"], model["video_token_id"]) == (302, 300, 303)
    vision = model["vision"]
    assert vision["inputs"] == {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"}
    assert (vision["spatial_merge_size"], vision["patch_size"]) == (2, 4) and "window_size" not in vision
    transforms = json.loads((result.out_dir / contract.GENAI_IMAGE_PROCESSOR_FILE).read_text())["processor"]
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in transforms["transforms"]}
    assert ops["Normalize"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert ops["PatchImage"] == {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}

    narrow = tmp_path / "narrow"
    shutil.copytree(result.out_dir, narrow)
    model["decoder"]["hidden_size"] = 64
    (narrow / contract.GENAI_CONFIG_FILE).write_text(json.dumps(config))
    og_model = og.Model(str(narrow))
    inputs = og_model.create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(png(tmp_path, 48, 64))))
    with pytest.raises(Exception) as refused:
        genai_multimodal_run(og_model, inputs, 1)
    message = str(refused.value)
    # (the traceback holds the model: a live og.Model's threads slow the torch work of the tests after this one)
    del refused, og_model, inputs
    gc.collect()
    print(f"genai with decoder.hidden_size 64: {message}")
    assert re.search(r"invalid dimensions for output: inputs_embeds .* Got: 64 Expected: 192", message, re.S)


# Qwen3-VL's hub preprocessor_config.json (Qwen/Qwen3-VL-2B-Instruct): Qwen2VLImageProcessor with 16-pixel patches over
# 2 frames, merged 2 x 2, mean and std 0.5, between 256 x 256 and 4096 x 4096 pixels.
QWEN3_VL_HUB_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                          "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                          "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}


@pytest.mark.parametrize("height, width", [(300, 200), (77, 510)], ids=["grown-to-min-pixels", "wide"])
def test_qwen3_vl_processor_settings_make_transformers_patches(family, tmp_path, height, width):
    """genai's QwenImageProcessor on the transforms written from Qwen3-VL's own processor settings (patch 16, temporal
    2, merge 2, its mean / std, its pixel bounds) makes the patches and grid transformers' Qwen2VLImageProcessor makes
    (the package under test is the tiny export's, its processor files and genai_config's patch size swapped in)."""
    import shutil

    from exporter.packaging.genai_image_text import qwen_image_processor

    export, _, _ = family("qwen3_vl")
    package = tmp_path / "package"
    shutil.copytree(export("gqa").out_dir, package)
    processor, reason = qwen_image_processor(QWEN3_VL_HUB_PROCESSOR, {"patch_size": 16, "spatial_merge_size": 2,
                                                                      "temporal_patch_size": 2})
    assert reason is None
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in processor["processor"]["transforms"]}
    assert ops["Resize"] == {"interpolation": "CUBIC", "smart_resize": 1, "min_pixels": 65536, "max_pixels": 16777216,
                             "patch_size": 16, "merge_size": 2}
    assert ops["PatchImage"] == {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    (package / contract.GENAI_IMAGE_PROCESSOR_FILE).write_text(json.dumps(processor))
    config = json.loads((package / contract.GENAI_CONFIG_FILE).read_text())
    config["model"]["vision"]["patch_size"] = 16
    (package / contract.GENAI_CONFIG_FILE).write_text(json.dumps(config))
    image = png(tmp_path, height, width, seed=4)
    inputs = og.Model(str(package)).create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(image)))
    hub = {k: v for k, v in QWEN3_VL_HUB_PROCESSOR.items() if k not in ("image_processor_type", "processor_class")}
    theirs = transformers.Qwen2VLImageProcessorPil(**hub)(Image.open(image), return_tensors="np")
    ours = inputs["pixel_values"].as_numpy()
    error = float(np.abs(ours - theirs["pixel_values"]).max())
    print(f"{width} x {height} at Qwen3-VL's settings -> grid {theirs['image_grid_thw'].tolist()}: pixel_values max err "
          f"{error:.2e}")
    assert inputs["image_grid_thw"].as_numpy().tolist() == theirs["image_grid_thw"].tolist()
    assert ours.shape == theirs["pixel_values"].shape and error <= PIXEL_TOLERANCE
    assert int((inputs["input_ids"].as_numpy() == IMAGE_TOKEN).sum()) == int(theirs["image_grid_thw"].prod()) // 4
