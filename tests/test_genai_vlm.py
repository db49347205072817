"""A gemma3 image-text export runs in onnxruntime-genai 0.18's own multimodal path (issue 48): og.Model on the
export folder, model.create_multimodal_processor() on a PNG opened with og.Images.open, processor(prompt,
images=...), a Generator fed with set_inputs. genai runs the export's vision.onnx, embedding.onnx (at every
step) and model.onnx as written; its greedy tokens and every step's logits equal transformers' generate on
the ids and pixel_values genai's processor made (and those pixel_values equal transformers' own image
processor's, the ids its processor's). llava, idefics3 and smolvlm have no genai image-text type: refused by
name in the manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporter import contract
from exporter.packaging.genai_image_text import GEMMA3_GENAI_IMAGE_TOKENS, genai_image_processor
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
from tests.genai_greedy import genai_multimodal_run, variant_exports, worst_of_range

og = pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_SEQ_LEN = 640  # one image's 256 tokens and its text, and validation's two-image prompt (548) where it runs
NEW_TOKENS = 12
IMAGE_PROMPT = "hello <start_of_image> the quick brown fox"  # genai expands the marker to the image's 258 tokens
TEXT_PROMPT = "hello onnx runtime, the quick brown fox"
LOGIT_TOLERANCE = 1e-4  # of the logit range, fp32 (measured: about 3e-7)
PIXEL_TOLERANCE = 1e-6  # genai's pixel_values against transformers' image processor (measured 1.2e-7, resized too)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny gemma3 image-text checkpoint with its tokenizer and image processor (256 tokens an image)."""
    return make_tiny_vlm_checkpoint("gemma3_genai", tmp_path_factory.mktemp("genai-vlm-ckpt") / "gemma3")


@pytest.fixture(scope="module")
def export(tmp_path_factory, checkpoint):
    return variant_exports(checkpoint, tmp_path_factory.mktemp("genai-vlm-exports"), MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """Random RGB PNGs: one at the processor's 64 x 64, one it resizes (100 wide, 80 high)."""
    root, rng = tmp_path_factory.mktemp("pngs"), np.random.default_rng(1)
    paths = {}
    for name, (height, width) in {"native": (64, 64), "resized": (80, 100)}.items():
        paths[name] = root / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[name])
    return paths



def transformers_run(model, ids: np.ndarray, pixel_values: np.ndarray | None, steps: int):
    images = {} if pixel_values is None else {"pixel_values": torch.from_numpy(pixel_values)}
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids.astype(np.int64)), **images, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return [int(t) for t in out.sequences[0, ids.shape[1]:]], [step[0].numpy() for step in out.logits]



@pytest.mark.parametrize("variant", ["gqa", "attn_dynamic"])
def test_genai_multimodal_generates_transformers_tokens(export, reference, checkpoint, pngs, variant):
    """One image + text, then text only, through genai's processor and generator; transformers driven with the
    ids and pixel_values genai's processor made."""
    result = export(variant)
    model = og.Model(str(result.out_dir))
    processor = model.create_multimodal_processor()
    hf_processor = transformers.AutoProcessor.from_pretrained(str(checkpoint))
    image_token = reference.config.image_token_index
    runs = {}
    for label in ("one image", "text only"):
        if label == "one image":
            inputs = processor(IMAGE_PROMPT, images=og.Images.open(str(pngs["native"])))
            pixel_values = inputs["pixel_values"].as_numpy()
            # genai's processor against transformers' on the same file: the pixels and the ids (genai adds no BOS)
            hf = hf_processor(text=IMAGE_PROMPT, images=Image.open(pngs["native"]), add_special_tokens=False,
                              return_tensors="np")
            pixel_error = float(np.abs(pixel_values - hf["pixel_values"]).max())
            assert pixel_error <= PIXEL_TOLERANCE
            assert inputs["input_ids"].as_numpy().tolist() == hf["input_ids"].tolist()
        else:
            inputs, pixel_values = processor(TEXT_PROMPT), None
        ids = inputs["input_ids"].as_numpy()
        assert int((ids == image_token).sum()) == (GEMMA3_GENAI_IMAGE_TOKENS if pixel_values is not None else 0)
        tokens, logits = genai_multimodal_run(model, inputs, NEW_TOKENS)
        ref_tokens, ref_logits = transformers_run(reference, ids, pixel_values, NEW_TOKENS)
        error = worst_of_range(logits, ref_logits)
        print(f"{variant} {label}: {ids.shape[1]} prompt tokens, genai {tokens}, logits max err {error:.2e} of range"
              + (f", pixel_values max err {pixel_error:.2e}" if pixel_values is not None else ""))
        assert tokens == ref_tokens
        assert error <= LOGIT_TOLERANCE
        runs[label] = logits[0]
    # the image's features reach the logits (not a text-only run in disguise)
    assert float(np.abs(runs["one image"] - runs["text only"]).max()) > 100 * LOGIT_TOLERANCE * np.ptp(runs["text only"])


def test_two_images_in_one_prompt_stop_in_genai_018_at_its_processor_count(export, pngs):
    """genai 0.18's gemma3 processor counts 256 image tokens per prompt whatever its images
    (src/models/gemma_image_processor.cpp: num_image_tokens = [image_seq_length]) and allocates the vision graph's
    image_features by that count, so a prompt with two images stops at the vision run (two images make 512 rows).
    Pinned here as genai's behaviour, not ours: two-image prompts of this export run in the farm's own runtime and
    its validation (exporter/validation/image_text.py); when genai counts per image this test fails and the
    two-image case moves to the test above."""
    model = og.Model(str(export("gqa").out_dir))
    processor = model.create_multimodal_processor()
    inputs = processor("first <start_of_image> then <start_of_image> compare them",
                       images=og.Images.open(str(pngs["native"]), str(pngs["resized"])))
    assert inputs["pixel_values"].as_numpy().shape == (2, 3, 64, 64)
    assert inputs["num_image_tokens"].as_numpy().tolist() == [GEMMA3_GENAI_IMAGE_TOKENS]
    with pytest.raises(RuntimeError, match=r"image_features.*\{256,64\}.*\{512,64\}"):
        genai_multimodal_run(model, inputs, 1)


def test_resized_image_pixels_equal_transformers(export, checkpoint, pngs):
    """An image the processor resizes (100 x 80 to 64 x 64, bilinear as the checkpoint's resample 2 says): genai's
    onnxruntime-extensions transforms give transformers' (PIL) pixel_values."""
    model = og.Model(str(export("gqa").out_dir))
    inputs = model.create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(pngs["resized"])))
    ours = inputs["pixel_values"].as_numpy()
    theirs = transformers.AutoProcessor.from_pretrained(str(checkpoint)).image_processor(
        Image.open(pngs["resized"]), return_tensors="np")["pixel_values"]
    error = float(np.abs(ours - theirs).max())
    print(f"resized 100 x 80 -> 64 x 64: pixel_values max err {error:.2e}")
    assert ours.shape == theirs.shape == (1, 3, 64, 64) and error <= PIXEL_TOLERANCE


def test_manifest_and_config_describe_the_package(export):
    """genai_config.json names the export's three graphs and the processor JSON written from the checkpoint's
    image processor (64 x 64, bilinear, 1/255, mean and std 0.5); the manifest lists them as a text export's."""
    result = export("gqa")
    entry = result.manifest.data["genai"]
    assert entry["package"] is True and entry["reason"] is None and entry["config"] == contract.GENAI_CONFIG_FILE
    assert {contract.GENAI_CONFIG_FILE, contract.GENAI_IMAGE_PROCESSOR_FILE, "tokenizer.json"} <= set(entry["files"])
    assert set(entry["files"]) <= set(result.manifest.data["files"])
    model = json.loads((result.out_dir / contract.GENAI_CONFIG_FILE).read_text())["model"]
    assert model["type"] == "gemma3" and model["image_token_id"] == 302
    assert (model["vision"]["filename"], model["embedding"]["filename"], model["decoder"]["filename"]) == (
        contract.VISION_FILE, contract.EMBEDDING_FILE, contract.MODEL_FILE)
    assert model["vision"]["config_filename"] == contract.GENAI_IMAGE_PROCESSOR_FILE
    assert model["embedding"]["inputs"] == {"input_ids": "input_ids", "image_features": "image_features"}
    assert "input_ids" not in model["decoder"]["inputs"] and model["decoder"]["inputs"]["inputs_embeds"] == "inputs_embeds"
    transforms = json.loads((result.out_dir / contract.GENAI_IMAGE_PROCESSOR_FILE).read_text())["processor"]["transforms"]
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in transforms}
    assert list(ops) == ["DecodeImage", "Resize", "Rescale", "Normalize", "Permute3D"]
    assert ops["Resize"] == {"interpolation": "LINEAR", "width": 64, "height": 64, "keep_aspect_ratio": 0}
    assert ops["Normalize"] == {"mean": [0.5] * 3, "std": [0.5] * 3}


def test_image_processor_settings_map_or_refuse(tmp_path):
    entry = {"image_size": 896}

    def settings(**image_processor):
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {
            "size": {"height": 896, "width": 896}, **image_processor}}))
        return genai_image_processor(tmp_path, entry)

    processor, reason = settings(resample=3, image_mean=[0.1, 0.2, 0.3], image_std=[1, 1, 1], do_rescale=False)
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in processor["processor"]["transforms"]}
    assert reason is None and "Rescale" not in ops and ops["Resize"]["interpolation"] == "CUBIC"
    assert ops["Normalize"] == {"mean": [0.1, 0.2, 0.3], "std": [1.0, 1.0, 1.0]}
    assert "pans and scans" in settings(do_pan_and_scan=True)[1]
    assert "resamples with 1" in settings(resample=1)[1]  # lanczos
    assert "where the vision graph takes 896 x 896" in settings(size={"height": 448, "width": 448})[1]


@pytest.mark.parametrize("case", ["llava", "idefics3", "smolvlm"])
def test_families_without_a_genai_type_are_refused_by_name(tmp_path, case):
    """genai 0.18 has no llava / idefics3 / smolvlm image-text type: the export is written, without a genai config."""
    checkpoint = make_tiny_vlm_checkpoint(case, tmp_path / "ckpt")
    result = export_model(ExportRequest(model=str(checkpoint), max_seq_len=192), tmp_path / "out", validate=False)
    entry = result.manifest.data["genai"]
    assert entry["package"] is False and not (result.out_dir / contract.GENAI_CONFIG_FILE).exists()
    assert f"no image-text model type for '{case}'" in entry["reason"]


def test_gemma3_without_what_genai_needs_is_refused(export, tmp_path):
    """attn_static (genai feeds no write_indices), and a gemma3 checkpoint of 16 tokens an image with no image
    processor settings: written, without a genai config, the reason in the manifest."""
    assert "attn_static reads write_indices" in export("attn_static").manifest.data["genai"]["reason"]
    checkpoint = make_tiny_vlm_checkpoint("gemma3", tmp_path / "ckpt")
    entry = export_model(ExportRequest(model=str(checkpoint), max_seq_len=192), tmp_path / "out",
                         validate=False).manifest.data["genai"]
    assert entry["package"] is False and "no image processor settings" in entry["reason"]
