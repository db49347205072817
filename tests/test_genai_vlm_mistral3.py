"""A mistral3 image-text export runs in onnxruntime-genai 0.18's own multimodal path: og.Model on the export folder,
model.create_multimodal_processor() on PNGs opened with og.Images.open, a Generator fed with set_inputs. genai's
Mistral3ImageProcessor expands each [IMG] of the prompt to the image's rows of [IMG] ending in [IMG_BREAK] (the last in
[IMG_END]) and its vision state runs vision.onnx once per image on that image's own pixels (the graph's image_sizes left
at its default). Its greedy tokens and every step's logits equal transformers' generate on the ids, pixel_values and
image_sizes genai's processor made, for one image, two images of different sizes and text only; its pixel_values and
ids equal transformers' Pixtral processor's where both resize an image alike, and one size where they do not is pinned."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporter import contract
from exporter.packaging.genai_image_text import pixtral_image_processor
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import PIXTRAL_LONGEST_EDGE, make_tiny_vlm_checkpoint
from tests.genai_greedy import genai_multimodal_run, variant_exports, worst_of_range
from tests.test_vlm_mistral3 import hf_prompt

og = pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_SEQ_LEN = 256
NEW_TOKENS = 12
IMAGE, BREAK, END = 300, 301, 302  # the tiny tokenizer's [IMG], [IMG_BREAK], [IMG_END]
TOKEN_PIXELS = 8  # 4-pixel patches, 2 x 2 merged
LOGIT_TOLERANCE = 1e-4  # of the logit range, fp32
PIXEL_TOLERANCE = 1e-6  # genai's pixel_values against transformers' image processor
PROMPTS = {"one image": "hello [IMG] the quick brown fox", "two images": "first [IMG] then [IMG] compare them",
           "text only": "hello onnx runtime, the quick brown fox"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_vlm_checkpoint("mistral3_genai", tmp_path_factory.mktemp("genai-mistral3") / "ckpt")


@pytest.fixture(scope="module")
def export(tmp_path_factory, checkpoint):
    return variant_exports(checkpoint, tmp_path_factory.mktemp("genai-mistral3-exports"), MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Mistral3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    """transformers' Pixtral image processor and tokenizer of the checkpoint (PixtralProcessor itself wants
    torchvision: hf_prompt does what it does)."""
    return (transformers.PixtralImageProcessorPil.from_pretrained(str(checkpoint)),
            transformers.AutoTokenizer.from_pretrained(str(checkpoint)))


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """Random RGB PNGs (height x width): one of whole tokens within the longest edge (left as it is), one both
    processors resize to 40 x 56, one they resize differently."""
    root, rng = tmp_path_factory.mktemp("pngs"), np.random.default_rng(1)
    paths = {}
    for name, (height, width) in {"whole tokens": (48, 64), "small": (24, 16), "rounded up": (37, 53),
                                  "too long": (90, 20)}.items():
        paths[name] = root / f"{height}x{width}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[name])
    return paths


def transformers_run(model, ids: np.ndarray, pixel_values: np.ndarray | None, sizes: np.ndarray | None, steps: int):
    images = {} if pixel_values is None else {"pixel_values": torch.from_numpy(pixel_values),
                                              "image_sizes": torch.from_numpy(sizes.astype(np.int64))}
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids.astype(np.int64)), **images, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return [int(t) for t in out.sequences[0, ids.shape[1]:]], [step[0].numpy() for step in out.logits]


@pytest.mark.parametrize("variant", ["gqa", "attn_dynamic"])
def test_genai_multimodal_generates_transformers_tokens(export, reference, hf_processor, pngs, variant):
    """One image (48 x 64: 6 x 8 tokens), two images of different sizes (48 x 64 and 24 x 16, padded into one batch
    that genai slices per image) and text only, through genai's processor and generator; transformers driven with the
    ids, pixel_values and image_sizes genai's processor made, which equal transformers' processor's."""
    model = og.Model(str(export(variant).out_dir))
    processor = model.create_multimodal_processor()
    images = {"one image": [pngs["whole tokens"]], "two images": [pngs["whole tokens"], pngs["small"]], "text only": []}
    first = {}
    for label, paths in images.items():
        if paths:
            inputs = processor(PROMPTS[label], images=og.Images.open(*map(str, paths)))
            pixels, sizes = inputs["pixel_values"].as_numpy(), inputs["image_sizes"].as_numpy()
        else:
            inputs, pixels, sizes = processor(PROMPTS[label]), None, None
        ids = inputs["input_ids"].as_numpy()
        hf_ids, hf_pixels, hf_sizes = hf_prompt(hf_processor, PROMPTS[label], paths)
        assert ids.tolist() == hf_ids.tolist()
        if paths:
            assert sizes.tolist() == hf_sizes.tolist()
            assert float(np.abs(pixels - hf_pixels).max()) <= PIXEL_TOLERANCE
            assert int((ids == IMAGE).sum()) == sum((h // TOKEN_PIXELS) * (w // TOKEN_PIXELS) for h, w in sizes)
            assert int((ids == END).sum()) == len(paths)
        tokens, logits = genai_multimodal_run(model, inputs, NEW_TOKENS)
        ref_tokens, ref_logits = transformers_run(reference, ids, pixels, sizes, NEW_TOKENS)
        error = worst_of_range(logits, ref_logits)
        print(f"mistral3 {variant} {label}: {ids.shape[1]} prompt tokens"
              + (f", image_sizes {sizes.tolist()}" if paths else "") + f", genai {tokens}, logits max err {error:.2e} "
              "of range")
        assert tokens == ref_tokens
        assert error <= LOGIT_TOLERANCE
        first[label] = logits[0]
    # the image's features reach the logits (not a text-only run in disguise)
    difference = float(np.abs(first["one image"] - first["text only"]).max())
    assert difference > 100 * LOGIT_TOLERANCE * np.ptp(first["text only"])


def test_images_both_processors_resize_alike_give_transformers_pixels(export, hf_processor, pngs):
    """37 x 53: transformers' Pixtral processor rounds each side up to whole tokens (40 x 56), genai's smart_resize to
    the nearest (40 x 56 too): the same size, and onnxruntime-extensions' bicubic gives PIL's pixels."""
    model = og.Model(str(export("gqa").out_dir))
    inputs = model.create_multimodal_processor()(PROMPTS["one image"], images=og.Images.open(str(pngs["rounded up"])))
    _, hf_pixels, hf_sizes = hf_prompt(hf_processor, PROMPTS["one image"], [pngs["rounded up"]])
    error = float(np.abs(inputs["pixel_values"].as_numpy() - hf_pixels).max())
    print(f"37 x 53 -> 40 x 56: pixel_values max err {error:.2e}")
    assert inputs["image_sizes"].as_numpy().tolist() == hf_sizes.tolist() == [[40, 56]]
    assert error <= PIXEL_TOLERANCE


def test_an_image_past_the_longest_edge_is_sized_otherwise_by_genai_018(export, hf_processor, pngs):
    """90 x 20 with a longest edge of 64: transformers' processor scales it to fit (64 x 14, then whole tokens: 64 x
    16); onnxruntime-extensions' smart_resize only bounds the area (64^2) and rounds each side (88 x 24). genai has no
    Pixtral resize in 0.18: pinned here, said in genai_image_text.pixtral_image_processor's docstring and the README."""
    model = og.Model(str(export("gqa").out_dir))
    inputs = model.create_multimodal_processor()(PROMPTS["one image"], images=og.Images.open(str(pngs["too long"])))
    _, _, hf_sizes = hf_prompt(hf_processor, PROMPTS["one image"], [pngs["too long"]])
    assert hf_sizes.tolist() == [[64, 16]] and max(hf_sizes[0]) <= PIXTRAL_LONGEST_EDGE
    assert inputs["image_sizes"].as_numpy().tolist() == [[88, 24]]


def test_manifest_and_config_describe_the_package(export):
    result = export("gqa")
    entry = result.manifest.data["genai"]
    assert entry["package"] is True and entry["reason"] is None
    assert {contract.GENAI_CONFIG_FILE, contract.GENAI_IMAGE_PROCESSOR_FILE, "tokenizer.json"} <= set(entry["files"])
    model = json.loads((result.out_dir / contract.GENAI_CONFIG_FILE).read_text())["model"]
    assert model["type"] == "mistral3" and model["image_token_id"] == IMAGE
    vision = model["vision"]
    assert (vision["filename"], vision["patch_size"], vision["spatial_merge_size"]) == (contract.VISION_FILE, 4, 2)
    assert vision["inputs"] == {"pixel_values": contract.PIXEL_VALUES}  # image_sizes stays at its default
    transforms = json.loads((result.out_dir / contract.GENAI_IMAGE_PROCESSOR_FILE).read_text())["processor"]["transforms"]
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in transforms}
    assert list(ops) == ["DecodeImage", "Resize", "Rescale", "Normalize", "Permute3D", "PixtralImageSizes"]
    assert ops["Resize"] == {"interpolation": "CUBIC", "smart_resize": 1, "min_pixels": 64, "max_pixels": 64 * 64,
                             "patch_size": 4, "merge_size": 2}


def test_what_genai_cannot_run_is_refused_in_the_manifest(export, tmp_path):
    """attn_static (genai feeds no write_indices) and processor settings genai's transforms do not have: the export is
    written without a genai config, the reason in the manifest."""
    assert "attn_static reads write_indices" in export("attn_static").manifest.data["genai"]["reason"]
    pixtral = {"patch_size": 4, "spatial_merge_size": 2}
    settings = {"size": {"longest_edge": 64}, "resample": 3}
    assert pixtral_image_processor(settings, pixtral, {"patch_size": 4, "spatial_merge_size": 2})[1] is None
    assert "spatial_merge_size 1 is not the vision tower's 2" in pixtral_image_processor(
        settings, pixtral, {"spatial_merge_size": 1})[1]
    assert "does not bound its longest edge" in pixtral_image_processor({"size": {"height": 64, "width": 64}}, pixtral,
                                                                        {})[1]
    assert "resamples with 1" in pixtral_image_processor({**settings, "resample": 1}, pixtral, {})[1]
    assert "names its image tokens" in pixtral_image_processor(settings, pixtral, {"image_token": "<image>"})[1]
    checkpoint = make_tiny_vlm_checkpoint("mistral3", tmp_path / "ckpt")  # no tokenizer, no image processor
    entry = export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN), tmp_path / "out",
                         validate=False).manifest.data["genai"]
    assert entry["package"] is False and "no image processor settings" in entry["reason"]
