"""A qwen2_5_vl image-text export runs in onnxruntime-genai 0.18's own multimodal path: og.Model on the export
folder, model.create_multimodal_processor() on a PNG (onnxruntime-extensions smart-resizes it and cuts it into the
flattened patches and image_grid_thw the vision graph takes, and expands the prompt's <|vision_start|> to the
image's <|image_pad|> tokens), a Generator fed with set_inputs. genai computes the decoder's M-RoPE position_ids
[3, batch, seq] itself (as transformers' get_rope_index, then each step at its 1-D position + rope_deltas) and runs
the export's vision.onnx, embedding.onnx (at every step) and model.onnx as written: its greedy tokens and every
step's logits equal transformers' generate on the ids, patches and grid genai's processor made, and those equal
transformers' own image processor's and tokenizer's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporter import contract
from exporter.packaging.genai_image_text import genai_image_processor
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, make_tiny_vlm_checkpoint
from tests.genai_greedy import genai_multimodal_run, variant_exports, worst_of_range

og = pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_SEQ_LEN = 256
NEW_TOKENS = 12
IMAGE_PROMPT = "hello <|vision_start|><|image_pad|><|vision_end|> the quick brown fox"
TEXT_PROMPT = "hello onnx runtime, the quick brown fox"
IMAGE_TOKEN, VISION_START = 302, 300  # the tiny checkpoint's <|image_pad|> and <|vision_start|>
LOGIT_TOLERANCE = 1e-4  # of the logit range, fp32
PIXEL_TOLERANCE = 1e-6  # genai's patches against transformers' image processor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny qwen2_5_vl checkpoint with its tokenizer and Qwen2VLImageProcessor (4-pixel patches, 2 x 2 merged)."""
    return make_tiny_vlm_checkpoint("qwen2_5_vl_genai", tmp_path_factory.mktemp("genai-qwen-ckpt") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def export(tmp_path_factory, checkpoint):
    return variant_exports(checkpoint, tmp_path_factory.mktemp("genai-qwen-exports"), MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    """transformers' image processor and tokenizer of the checkpoint (Qwen2_5_VLProcessor itself also wants a video
    processor, which needs torchvision)."""
    return (transformers.AutoImageProcessor.from_pretrained(str(checkpoint)),
            transformers.AutoTokenizer.from_pretrained(str(checkpoint)))


def png(tmp_path, height: int, width: int, seed: int = 1):
    path = tmp_path / f"{height}x{width}.png"
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def hf_image_prompt(hf_processor, prompt: str, image_path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, pixel_values, image_grid_thw) as Qwen2_5_VLProcessor makes them: the image processor's patches and
    grid, each <|image_pad|> of the prompt repeated t * h * w / merge^2 times, tokenized without special tokens."""
    image_processor, tokenizer = hf_processor
    images = image_processor(Image.open(image_path), return_tensors="np")
    grid = images["image_grid_thw"]
    tokens = int(grid[0].prod()) // image_processor.merge_size ** 2
    ids = tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * tokens), add_special_tokens=False,
                    return_tensors="np")["input_ids"]
    return ids, images["pixel_values"], grid



def transformers_run(model, ids: np.ndarray, pixel_values: np.ndarray | None, grid: np.ndarray | None, steps: int):
    ids = torch.from_numpy(ids.astype(np.int64))
    images = {} if pixel_values is None else {"pixel_values": torch.from_numpy(pixel_values),
                                              "image_grid_thw": torch.from_numpy(grid.astype(np.int64))}
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **images,
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return [int(t) for t in out.sequences[0, ids.shape[1]:]], [step[0].numpy() for step in out.logits]



def check_image_and_text_prompts(model, reference, hf_processor, image, label: str) -> dict:
    """One image (64 x 48: 16 x 12 patches, 48 image tokens) + text, then text only, through genai's processor and
    generator of ``model`` (og.Model); transformers' ``reference`` driven with the ids, patches and grid genai's
    processor made (its pixels and ids checked against ``hf_processor``'s). Returns {prompt: (ids, transformers'
    tokens)}."""
    processor = model.create_multimodal_processor()
    runs, first = {}, {}
    for prompt in ("one image", "text only"):
        if prompt == "one image":
            inputs = processor(IMAGE_PROMPT, images=og.Images.open(str(image)))
            pixel_values, grid = inputs["pixel_values"].as_numpy(), inputs["image_grid_thw"].as_numpy()
            hf_ids, hf_pixels, hf_grid = hf_image_prompt(hf_processor, IMAGE_PROMPT, image)
            pixel_error = float(np.abs(pixel_values - hf_pixels).max())
            assert grid.tolist() == hf_grid.tolist() == [[1, 12, 16]] and pixel_error <= PIXEL_TOLERANCE
            assert inputs["input_ids"].as_numpy().tolist() == hf_ids.tolist()
        else:
            inputs, pixel_values, grid = processor(TEXT_PROMPT), None, None
        ids = inputs["input_ids"].as_numpy()
        assert int((ids == IMAGE_TOKEN).sum()) == (48 if pixel_values is not None else 0)
        tokens, logits = genai_multimodal_run(model, inputs, NEW_TOKENS)
        ref_tokens, ref_logits = transformers_run(reference, ids, pixel_values, grid, NEW_TOKENS)
        error = worst_of_range(logits, ref_logits)
        print(f"{label} {prompt}: {ids.shape[1]} prompt tokens, genai {tokens}, logits max err {error:.2e} of range"
              + (f", pixel_values max err {pixel_error:.2e}" if pixel_values is not None else ""))
        assert tokens == ref_tokens
        assert error <= LOGIT_TOLERANCE
        first[prompt], runs[prompt] = logits[0], (ids, ref_tokens)
    # the image's features reach the logits (not a text-only run in disguise)
    difference = float(np.abs(first["one image"] - first["text only"]).max())
    assert difference > 100 * LOGIT_TOLERANCE * np.ptp(first["text only"])
    return runs


@pytest.mark.parametrize("variant", ["gqa", "attn_dynamic"])
def test_genai_multimodal_generates_transformers_tokens(export, reference, hf_processor, tmp_path, variant):
    """One image + text, then text only, through genai's processor and generator (check_image_and_text_prompts)."""
    model = og.Model(str(export(variant).out_dir))
    check_image_and_text_prompts(model, reference, hf_processor, png(tmp_path, 48, 64), variant)


def check_two_images_in_one_prompt(model, reference, tmp_path, label: str) -> None:
    """Two images of different sizes in one prompt: genai's processor makes both images' patches (each image's
    block padded with zero rows to the largest one's, which genai drops before the vision graph), a grid of two rows,
    and expands each vision block to its own image's tokens; genai places each on M-RoPE's streams. transformers,
    driven with the ids, the grids and the patches genai made (its padding rows taken out), gives the same greedy
    tokens (``model``: og.Model of the package, ``reference``: transformers' model)."""
    processor = model.create_multimodal_processor()
    prompt = "first " + IMAGE_PROMPT.removeprefix("hello ") + " then <|vision_start|><|image_pad|><|vision_end|> end"
    images = [png(tmp_path, 48, 64, seed=1), png(tmp_path, 32, 24, seed=2)]
    inputs = processor(prompt, images=og.Images.open(*(str(p) for p in images)))
    ids, pixel_values = inputs["input_ids"].as_numpy(), inputs["pixel_values"].as_numpy()
    grid = inputs["image_grid_thw"].as_numpy()
    assert grid.tolist() == [[1, 12, 16], [1, 8, 6]]
    assert int((ids == IMAGE_TOKEN).sum()) == 48 + 12
    block = pixel_values.shape[0] // len(grid)  # the largest image's patches
    counts = [int(np.prod(g)) for g in grid]
    assert block == max(counts) and not pixel_values[block + counts[1]:].any()
    patches = np.concatenate([pixel_values[i * block: i * block + n] for i, n in enumerate(counts)])
    tokens, logits = genai_multimodal_run(model, inputs, NEW_TOKENS)
    ref_tokens, ref_logits = transformers_run(reference, ids, patches, grid, NEW_TOKENS)
    error = worst_of_range(logits, ref_logits)
    print(f"{label} two images: {ids.shape[1]} prompt tokens, grids {grid.tolist()}, genai {tokens}, logits max err "
          f"{error:.2e} of range")
    assert tokens == ref_tokens and error <= LOGIT_TOLERANCE


def test_two_images_in_one_prompt_generate_transformers_tokens(export, reference, tmp_path):
    """check_two_images_in_one_prompt on the gqa package."""
    check_two_images_in_one_prompt(og.Model(str(export("gqa").out_dir)), reference, tmp_path, "qwen2_5_vl")


@pytest.mark.parametrize("height, width, grid", [(100, 80, [1, 16, 14]), (9, 9, [1, 4, 4]), (30, 90, [1, 8, 22])],
                         ids=["shrunk-to-max-pixels", "grown-to-min-pixels", "rounded-to-8"])
def test_resized_patches_equal_transformers(export, hf_processor, tmp_path, height, width, grid):
    """Images the processor smart-resizes (bicubic, to multiples of patch x merge = 8 pixels between QWEN_MIN_PIXELS
    and QWEN_MAX_PIXELS): genai's onnxruntime-extensions transforms give transformers' (PIL) patches and grid."""
    model = og.Model(str(export("gqa").out_dir))
    image = png(tmp_path, height, width, seed=2)
    inputs = model.create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(image)))
    theirs = hf_processor[0](Image.open(image), return_tensors="np")
    ours = inputs["pixel_values"].as_numpy()
    error = float(np.abs(ours - theirs["pixel_values"]).max())
    print(f"{width} x {height} -> grid {grid}: pixel_values max err {error:.2e}")
    assert inputs["image_grid_thw"].as_numpy().tolist() == theirs["image_grid_thw"].tolist() == [grid]
    assert ours.shape == theirs["pixel_values"].shape and error <= PIXEL_TOLERANCE


def test_shrinking_one_side_and_growing_the_other_rounds_differently(export, hf_processor, tmp_path):
    """70 x 50 -> 72 x 48: where genai's bicubic (onnxruntime-extensions' copy of Pillow's, always the horizontal
    pass first) is not transformers' (Pillow 13 takes the vertical pass first here: resizing 70 x 50 -> 70 x 48 ->
    72 x 48 by hand gives its pixels exactly): the two passes round and clip to uint8 in the other order. The grid
    is the same and a smooth image's pixels differ by at most a grey level or so (measured 0.015 of the normalized values, 1 level; on random noise, where
    bicubic overshoot clips, 0.24), not a difference in what the export computes."""
    model = og.Model(str(export("gqa").out_dir))
    rows, cols = np.mgrid[0:50, 0:70]
    smooth = np.stack([127 + 120 * np.sin(cols / 7 + c) * np.cos(rows / 5) for c in range(3)], -1).astype(np.uint8)
    image = tmp_path / "smooth.png"
    Image.fromarray(smooth).save(image)
    inputs = model.create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(image)))
    theirs = hf_processor[0](Image.open(image), return_tensors="np")
    error = float(np.abs(inputs["pixel_values"].as_numpy() - theirs["pixel_values"]).max())
    print(f"70 x 50 -> 72 x 48 (smooth): pixel_values max err {error:.2e}")
    assert inputs["image_grid_thw"].as_numpy().tolist() == theirs["image_grid_thw"].tolist() == [[1, 12, 18]]
    assert error <= 2 / 255 / min(hf_processor[0].image_std)  # two grey levels


def test_manifest_and_config_describe_the_package(export):
    """genai_config.json: type qwen2_5_vl, the image / vision start / video token ids, the vision section's
    image_grid_thw input and the tower's sizes; ort_image_processor.json written from the checkpoint's
    Qwen2VLImageProcessor (smart resize between its min and max pixels, bicubic, 1/255, CLIP mean / std)."""
    result = export("gqa")
    entry = result.manifest.data["genai"]
    assert entry["package"] is True and entry["reason"] is None and entry["config"] == contract.GENAI_CONFIG_FILE
    assert {contract.GENAI_CONFIG_FILE, contract.GENAI_IMAGE_PROCESSOR_FILE, "tokenizer.json"} <= set(entry["files"])
    model = json.loads((result.out_dir / contract.GENAI_CONFIG_FILE).read_text())["model"]
    assert model["type"] == "qwen2_5_vl"
    assert (model["image_token_id"], model["vision_start_token_id"], model["video_token_id"]) == (302, 300, 303)
    vision = model["vision"]
    assert vision["inputs"] == {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"}
    assert (vision["spatial_merge_size"], vision["patch_size"], vision["window_size"]) == (2, 4, 16)
    assert vision["tokens_per_second"] == 4.0  # transformers' default (images take none of it)
    assert model["decoder"]["inputs"]["position_ids"] == "position_ids"  # [3, batch, seq], fed by genai
    assert "input_ids" not in model["decoder"]["inputs"]
    transforms = json.loads((result.out_dir / contract.GENAI_IMAGE_PROCESSOR_FILE).read_text())["processor"]
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in transforms["transforms"]}
    assert transforms["name"] == "qwen2_5_image_processor"
    assert list(ops) == ["DecodeImage", "Resize", "Rescale", "Normalize", "PatchImage"]
    assert ops["Resize"] == {"interpolation": "CUBIC", "smart_resize": 1, "min_pixels": QWEN_MIN_PIXELS,
                             "max_pixels": QWEN_MAX_PIXELS, "patch_size": 4, "merge_size": 2}
    assert ops["PatchImage"] == {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}


def test_image_processor_settings_map_or_refuse(checkpoint, tmp_path):
    """v4 min_pixels / max_pixels keys, no rescale (Rescale by 1 still makes the floats PatchImage takes), and the
    settings genai's processor cannot follow, refused by name."""
    for name in ("config.json",):
        (tmp_path / name).write_text((checkpoint / name).read_text())
    entry = {"model_type": "qwen2_5_vl"}

    def settings(**image_processor):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({
            "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 4, "merge_size": 2, **image_processor}))
        return genai_image_processor(tmp_path, entry)

    processor, reason = settings(do_rescale=False, resample=2)
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in processor["processor"]["transforms"]}
    assert reason is None and ops["Rescale"] == {"rescale_factor": 1.0} and ops["Resize"]["interpolation"] == "LINEAR"
    assert (ops["Resize"]["min_pixels"], ops["Resize"]["max_pixels"]) == (3136, 12845056)
    assert "patch_size 14 is not the vision tower's 4" in settings(patch_size=14)[1]
    assert "resamples with 1" in settings(resample=1)[1]  # lanczos
    assert "does not bound its pixels" in settings(do_resize=False)[1]


def test_what_genai_cannot_run_is_refused(export, tmp_path):
    """attn_static (genai feeds no write_indices), and a qwen2_5_vl checkpoint without a tokenizer holding
    <|vision_start|> / <|image_pad|> / <|vision_end|>: written, without a genai config, the reason in the manifest."""
    assert "attn_static reads write_indices" in export("attn_static").manifest.data["genai"]["reason"]
    checkpoint = make_tiny_vlm_checkpoint("qwen2_5_vl_genai", tmp_path / "ckpt")
    (checkpoint / "tokenizer.json").unlink()
    entry = export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN), tmp_path / "out",
                         validate=False).manifest.data["genai"]
    assert entry["package"] is False and not (tmp_path / "out" / contract.GENAI_CONFIG_FILE).exists()
    assert "writes <|vision_start|>, <|image_pad|>, <|vision_end|> into the prompt" in entry["reason"]
