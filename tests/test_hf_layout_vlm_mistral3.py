"""The hf layout of a mistral3 image-text export run by transformers.js 4.3 under Node as a user runs it
(clients/transformersjs/image_text_generate.mjs): its PixtralProcessor on a PNG and a prompt naming the image with
[IMG], then AutoModelForImageTextToText.generate (Mistral3ForConditionalGeneration, which transformers.js runs as
llava: vision_encoder on pixel_values alone, the vision graph's image_sizes left at its default). transformers, driven
with the ids and pixel_values transformers.js computed and the image's size, gives the same greedy tokens, for one image
+ text and for text only; transformers.js's ids equal transformers' PixtralProcessor's and its pixel_values transformers'
image processor's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from exporter import contract
from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
from tests.test_hf_layout import transformersjs  # noqa: F401  (the fixture: npm ci of clients/transformersjs)
from tests.test_hf_layout_vlm import js_generate
from tests.test_vlm_mistral3 import hf_prompt

NEW_TOKENS = 12
MAX_SEQ_LEN = 256
PIXEL_TOLERANCE = 1e-6
PROMPT = "hello [IMG] the quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny mistral3 with its tokenizer, PixtralImageProcessor and processor_config.json."""
    return make_tiny_vlm_checkpoint("mistral3_genai", tmp_path_factory.mktemp("mistral3-repo") / "ckpt")


@pytest.fixture(scope="module")
def layout(tmp_path_factory, checkpoint) -> Path:
    request = ExportRequest(model=str(checkpoint), ep="cpu", variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN,
                            layout="hf")
    return export_model(request, tmp_path_factory.mktemp("mistral3-hf") / "layout", validate=False).out_dir


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A 48 x 64 RGB PNG of noise: whole tokens within the longest edge, so neither processor resamples it."""
    from PIL import Image

    path = tmp_path_factory.mktemp("image") / "noise.png"
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path)
    return path


def test_transformersjs_generates_transformers_tokens(checkpoint, layout, image, transformersjs):  # noqa: F811
    requests = [{"prompt": PROMPT, "image": str(image), "max_new_tokens": NEW_TOKENS},
                {"prompt": "export the model to onnx and run it", "image": None, "max_new_tokens": NEW_TOKENS}]
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = (transformers.PixtralImageProcessorPil.from_pretrained(str(checkpoint)),
                 transformers.AutoTokenizer.from_pretrained(str(checkpoint)))
    for request, js in zip(requests, js_generate(layout, "fp32", requests)):
        paths = [request["image"]] if request["image"] else []
        ids, pixels, sizes = hf_prompt(processor, request["prompt"], paths)
        bos = [processor[1].bos_token_id]  # transformers.js's tokenizer adds BOS; hf_prompt tokenizes without
        assert js["input_ids"] == [bos + ids[0].tolist()]
        kwargs, error = {}, 0.0
        if paths:
            got = np.asarray(js["pixel_values"]["data"], np.float32).reshape(js["pixel_values"]["dims"])
            assert got.shape == pixels.shape == (1, 3, 48, 64)
            error = float(np.abs(got - pixels).max())
            assert error <= PIXEL_TOLERANCE
            kwargs = {"pixel_values": torch.from_numpy(got), "image_sizes": torch.from_numpy(sizes)}
        prompt = torch.tensor(js["input_ids"])
        with torch.no_grad():
            want = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)[0].tolist()
        length = prompt.shape[1]
        got_tokens = js["sequences"][0][length:]
        kind = "image + text" if paths else "text only"
        print(f"mistral3 fp32 {kind}: {length} prompt tokens, pixel_values max diff {error:.1e}, new tokens {got_tokens} "
              f"vs transformers {want[length:]}")
        assert got_tokens == want[length:]
        assert len(set(want[length:])) > 2, "the prompt does not tell positions apart (a repeated token)"


def test_the_layout_holds_what_transformersjs_loads(layout):
    """vision_encoder's one required input is pixel_values (image_sizes an overridable initializer);
    preprocessor_config.json carries the tower's patch_size (an int) and spatial_merge_size for transformers.js's
    PixtralImageProcessor; processor_config.json the image tokens."""
    graph = onnx.load(str(layout / "onnx" / "vision_encoder.onnx"), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    assert [i.name for i in graph.input if i.name not in initializers] == [contract.PIXEL_VALUES]
    assert contract.IMAGE_SIZES in initializers
    preprocessor = json.loads((layout / "preprocessor_config.json").read_text())
    assert (preprocessor["image_processor_type"], preprocessor["processor_class"]) == ("PixtralImageProcessor",
                                                                                       "PixtralProcessor")
    assert (preprocessor["patch_size"], preprocessor["spatial_merge_size"]) == (4, 2)
    processor = json.loads((layout / "processor_config.json").read_text())
    assert (processor["image_token"], processor["image_break_token"], processor["image_end_token"]) == (
        "[IMG]", "[IMG_BREAK]", "[IMG_END]")


@pytest.mark.parametrize("settings, message", [
    ({"patch_size": 4}, r"has no processor_config.json naming spatial_merge_size \(PixtralProcessor's settings\)"),
    ({"patch_size": 4, "spatial_merge_size": 1}, r"processor_config.json gives spatial_merge_size 1 where the vision "
                                                 r"tower's is 2"),
], ids=["no-merge-size", "other-merge-size"])
def test_a_processor_config_without_the_towers_token_geometry_is_refused(checkpoint, tmp_path, settings, message):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (copy / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor", **settings}))
    with pytest.raises(ExportError, match=message):
        export_model(ExportRequest(model=str(copy), max_seq_len=MAX_SEQ_LEN, layout="hf"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
