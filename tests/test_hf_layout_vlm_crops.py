"""The hf layout of idefics3 and smolvlm image-text exports run by transformers.js 4.3 under Node as a user runs it
(clients/transformersjs/image_text_generate.mjs): its Idefics3Processor splits each image into crops of the tower's
size plus the whole image resized to one, writes each crop's image tokens into the prompt, and feeds vision_encoder
pixel_values [batch, crops, 3, S, S] with pixel_attention_mask (a batch of prompts with different crop counts padded
with all-zero crops). Its greedy tokens equal transformers' own processor + generate on the same images and text; the
vision_encoder's features equal transformers' get_image_features on crops with an all-zero padding crop and padded
pixels. And a processor transformers.js would run otherwise than the graphs compute, refused before anything is
written."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from exporter import contract
from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import VLM_CONFIGS
from exporter.vision.tiny_processor import CROPS_PER_SIDE
from tests.test_hf_layout import transformersjs  # noqa: F401  (the fixture: npm ci of clients/transformersjs)
from tests.test_hf_layout_vlm import js_generate, repo  # noqa: F401  (repo: the tiny checkpoints with their processors)

CASES = ["idefics3", "smolvlm"]
NEW_TOKENS = 12
MAX_SEQ_LEN = 256
PIXEL_TOLERANCE = 1e-6  # both rescale and normalize in fp32; the crops' resizes are exact on 2 x 2 pixel blocks
FEATURE_TOLERANCE = 1e-4  # of the features' range, fp32
PROMPT = "hello <image> the quick brown fox"


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory, repo):
    root = tmp_path_factory.mktemp("crops-hf")

    @functools.cache
    def make(case: str) -> Path:
        request = ExportRequest(model=str(repo(case)), ep="cpu", variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN,
                                layout="hf")
        return export_model(request, root / case, validate=False).out_dir

    return make


def crop_size(case: str) -> int:
    """The tower's image_size, every crop's side."""
    return VLM_CONFIGS[case][1]["vision_config"]["image_size"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """images(case) -> (square, wide) PNGs of noise in 2 x 2 (1 x 2) pixel blocks: CROPS_PER_SIDE crops a side (4 crops
    and the whole image), and 1 x 2 crops (2 and the whole). Already at the processors' longest edge, so only their
    crop resizes resample, which a block image makes exact in both."""
    from PIL import Image

    root = tmp_path_factory.mktemp("crops-images")

    @functools.cache
    def make(case: str) -> tuple[Path, Path]:
        side = crop_size(case) * CROPS_PER_SIDE // 2
        rng = np.random.default_rng(7)
        square = np.repeat(np.repeat(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), 2, 0), 2, 1)
        wide = np.repeat(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), 2, 1)
        paths = root / f"{case}-square.png", root / f"{case}-wide.png"
        for path, pixels in zip(paths, (square, wide)):
            Image.fromarray(pixels).save(path)
        return paths

    return make


def hf_inputs(checkpoint: Path, case: str, texts: list[str], images: list[list[Path]]) -> dict:
    """transformers' processor on ``texts`` and each one's ``images``: Idefics3Processor; for smolvlm, whose
    SmolVLMProcessor wants torchvision and num2words, its own parts (image processor, tokenizer, the prompt expansion
    SmolVLMProcessor.replace_image_token calls) as it composes them."""
    from PIL import Image

    pil = [[Image.open(path) for path in row] for row in images]
    if case == "idefics3":
        processor = transformers.AutoProcessor.from_pretrained(checkpoint)
        return dict(processor(images=pil, text=texts, return_tensors="pt"))
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    seq_len = json.loads((checkpoint / "processor_config.json").read_text())["image_seq_len"]
    image_inputs = transformers.AutoImageProcessor.from_pretrained(checkpoint)(pil, return_row_col_info=True,
                                                                               return_tensors="pt")
    expanded = []
    for text, rows, cols in zip(texts, image_inputs.pop("rows"), image_inputs.pop("cols")):
        parts = text.split(tokenizer.image_token)
        expanded.append(parts[0] + "".join(
            get_image_prompt_string(r, c, seq_len, tokenizer.fake_image_token, tokenizer.image_token,
                                    tokenizer.global_image_token) + rest for r, c, rest in zip(rows, cols, parts[1:])))
    return {**tokenizer(expanded, return_tensors="pt"), **image_inputs}


def hf_generate(checkpoint: Path, inputs: dict) -> list[list[int]]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(**{k: v for k, v in inputs.items() if k != "token_type_ids"}, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    return out.tolist()


def padded_batch(checkpoint: Path, square: Path, wide: Path) -> dict:
    """A request of two prompts, the square image's (5 crops) and the wide one's (3 crops, padded with 2 all-zero
    crops), the second's text lengthened to the first's tokens: transformers.js's Idefics3Processor does not pad."""
    def length(text: str, image: Path) -> int:
        return hf_inputs(checkpoint, checkpoint.name, [text], [[image]])["input_ids"].shape[1]

    # the image tokens are special tokens, so the text after them adds its own tokens alone
    text_tokens = transformers.AutoTokenizer.from_pretrained(checkpoint)
    short, second = length(PROMPT, square) - length(PROMPT, wide), PROMPT
    while len(text_tokens(second).input_ids) - len(text_tokens(PROMPT).input_ids) < short:
        second += "!"  # one byte, one token (the tiny BPE merges none of it)
    assert length(second, wide) == length(PROMPT, square), "the filler does not give the first prompt's length"
    return {"prompts": [PROMPT, second], "images": [[str(square)], [str(wide)]], "max_new_tokens": NEW_TOKENS}


@pytest.mark.parametrize("case", CASES)
def test_transformersjs_generates_transformers_tokens_on_crops(case, repo, laid_out, images,
                                                              transformersjs):  # noqa: F811
    """One image split into crops, a batch of two prompts whose crops transformers.js pads with all-zero crops, and
    text only: transformers.js's ids, pixels and pixel mask equal transformers' processor's, and its greedy tokens
    transformers' generate on transformers' own processor output."""
    square, wide = images(case)
    requests = [{"prompt": PROMPT, "image": str(square), "max_new_tokens": NEW_TOKENS},
                padded_batch(repo(case), square, wide),
                {"prompt": "export the model to onnx and run it", "image": None, "max_new_tokens": NEW_TOKENS}]
    for request, js in zip(requests, js_generate(laid_out(case), "fp32", requests)):
        texts = request.get("prompts") or [request["prompt"]]
        image_rows = request.get("images") or ([[request["image"]]] if request["image"] else None)
        if image_rows is None:
            want = dict(transformers.AutoTokenizer.from_pretrained(repo(case))(texts, return_tensors="pt"))
        else:
            want = hf_inputs(repo(case), case, texts, [[Path(p) for p in row] for row in image_rows])
        assert js["input_ids"] == want["input_ids"].tolist(), "transformers.js's processor gave other ids"
        kind = "text only"
        if image_rows is not None:
            pixels = np.asarray(js["pixel_values"]["data"], np.float32).reshape(js["pixel_values"]["dims"])
            mask = np.asarray(js["pixel_attention_mask"]["data"], bool).reshape(js["pixel_attention_mask"]["dims"])
            assert pixels.shape == tuple(want["pixel_values"].shape)
            error = float(np.abs(pixels - want["pixel_values"].numpy()).max())
            assert error <= PIXEL_TOLERANCE, f"pixel_values differ by {error:.2e}"
            assert np.array_equal(mask, want["pixel_attention_mask"].numpy().astype(bool))
            padding = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if not mask[i, j].any()]
            kind = f"{len(texts)} prompt(s), crops {list(pixels.shape[:2])}, padding crops {padding}"
            if len(texts) == 2:  # the wide image's 3 crops padded to the square's 5
                assert padding == [(1, 3), (1, 4)] and not pixels[1, 3:].any()
        got, expected = js["sequences"], hf_generate(repo(case), want)
        prompt = len(js["input_ids"][0])
        print(f"{case} {kind}: {prompt} prompt tokens, new tokens {[s[prompt:] for s in got]} vs transformers "
              f"{[s[prompt:] for s in expected]}")
        assert got == expected, f"{kind}: transformers.js {got} vs transformers {expected}"
        assert all(len(set(s[prompt:])) > 2 for s in expected), "greedy repeats a token: a test that cannot tell"


@pytest.mark.parametrize("case", CASES)
def test_vision_encoder_features_equal_get_image_features(case, repo, laid_out):
    """The layout's vision_encoder against transformers' get_image_features, fp32, on two prompts' crops: an all-zero
    padding crop (dropped), a crop whose bottom rows and right columns are padding pixels (mask False: fewer real
    patches, other position ids, attention over the real ones only); and all crops zero (smolvlm keeps the first,
    idefics3 has none to give: transformers fails there too)."""
    session = ort.InferenceSession(str(laid_out(case) / "onnx" / "vision_encoder.onnx"))
    model = transformers.AutoModelForImageTextToText.from_pretrained(repo(case), dtype=torch.float32)
    size = crop_size(case)
    rng = np.random.default_rng(3)
    pixels = rng.normal(size=(2, 3, 3, size, size)).astype(np.float32)
    mask = np.ones((2, 3, size, size), bool)
    pixels[1, 2], mask[1, 2] = 0.0, False  # a padding crop
    mask[0, 1, size // 2 + 3:, :], mask[0, 1, :, size * 3 // 4:] = False, False  # padding pixels, whole patches and not
    pixels[0, 1][:, ~mask[0, 1]] = 0.0
    whole = mask.copy()
    whole[0, 1] = True  # a control: the padded-pixel crop read whole, which the mask is there to prevent
    control = session.run(None, {contract.PIXEL_VALUES: pixels, contract.PIXEL_ATTENTION_MASK: whole})[0]
    inputs = [(pixels, mask)]
    if case == "smolvlm":
        inputs.append((np.zeros_like(pixels[:1]), np.ones_like(mask[:1])))
    for pixel_values, pixel_mask in inputs:
        got = session.run(None, {contract.PIXEL_VALUES: pixel_values, contract.PIXEL_ATTENTION_MASK: pixel_mask})[0]
        with torch.no_grad():
            want = torch.cat(model.get_image_features(torch.from_numpy(pixel_values),
                                                      torch.from_numpy(pixel_mask)).pooler_output).numpy()
        assert got.shape == want.shape
        error = float(np.abs(got - want).max() / (want.max() - want.min()))
        print(f"{case} crops {list(pixel_values.shape[:2])}: features within {error:.1e} of their range")
        assert error <= FEATURE_TOLERANCE
        if pixel_values is pixels:
            off = float(np.abs(control - want).max() / (want.max() - want.min()))
            print(f"{case} control, the padded pixels read as real: {off:.2f} of the range off")
            assert off > 100 * FEATURE_TOLERANCE


def test_the_layout_holds_what_transformersjs_feeds(laid_out):
    """vision_encoder takes transformers.js's 5-D pixel_values and its bool pixel_attention_mask, its weights the
    export's vision weights (the same bytes, moved); the processor files are what Idefics3Processor reads."""
    for case in CASES:
        layout = laid_out(case)
        graph = onnx.load(str(layout / "onnx" / "vision_encoder.onnx"), load_external_data=False).graph
        inputs = {i.name: (i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in
                                                          i.type.tensor_type.shape.dim]) for i in graph.input}
        size, crops = crop_size(case), ["batch_size", "num_crops"]
        assert inputs == {contract.PIXEL_VALUES: (onnx.TensorProto.FLOAT, [*crops, 3, size, size]),
                          contract.PIXEL_ATTENTION_MASK: (onnx.TensorProto.BOOL, [*crops, size, size])}
        manifest = json.loads((layout / "manifest.json").read_text())
        assert manifest["files"]["onnx/vision_encoder.onnx_data"] == manifest["layout"]["from_export"]["files"][
            contract.data_file(contract.VISION_FILE)]
        assert "vision_encoder" in manifest["layout"]
        preprocessor = json.loads((layout / "preprocessor_config.json").read_text())
        assert preprocessor["processor_class"] == {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}[case]
        assert preprocessor["max_image_size"] == {"longest_edge": size} and preprocessor["do_image_splitting"] is True
        assert preprocessor["image_processor_type"] in ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
        assert json.loads((layout / "processor_config.json").read_text())["image_seq_len"] == manifest["image_text"][
            "tokens_per_image"]
        assert (layout / "chat_template.jinja").is_file()  # smolvlm's written from its chat_template.json


def _edited(source: Path, dst: Path, file: str, change: dict) -> Path:
    shutil.copytree(source, dst)
    path = dst / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return dst


def test_a_processor_transformersjs_would_run_otherwise_is_refused(repo, tmp_path):
    """Crops of another size than the tower's, another image_seq_len than its tokens per crop, a tokenizer naming
    other image tokens than transformers.js writes: each refused by name before anything is written."""
    source = repo("smolvlm")
    cases = [
        ("preprocessor_config.json", {"max_image_size": {"longest_edge": 50}},
         r"crops of max_image_size 50 pixels where the vision tower's image_size is 100"),
        ("processor_config.json", {"image_seq_len": 169}, r"image_seq_len 169 image tokens a crop where the vision "
                                                          r"graph gives 25"),
        ("tokenizer_config.json", {"extra_special_tokens": {"image_token": "<image>",
                                                           "global_image_token": "<row_1_col_1>",
                                                           "fake_image_token": "<fake_token_around_image>"}},
         r"names global_image_token '<row_1_col_1>'.*transformers.js's Idefics3Processor writes '<global-img>'"),
    ]
    for i, (file, change, message) in enumerate(cases):
        checkpoint = _edited(source, tmp_path / f"ckpt{i}", file, change)
        with pytest.raises(ExportError, match=message):
            export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN, layout="hf"), tmp_path / "out",
                         validate=False)
        assert not (tmp_path / "out").exists()


def test_the_crops_vision_encoder_is_validated_when_exported(repo, tmp_path):
    """The hf layout's crops vision_encoder is not the farm's vision graph, so the export validates it on its own
    against transformers' get_image_features (crops with a padding crop and padding pixels): a gate and a vision row
    of the report. A control: the gate against another checkpoint's transformers model fails."""
    from exporter.validation.image_text import crops_vision_encoder_gate, load_image_text_reference
    from exporter.vision.tiny_processor import make_tiny_vlm_repo

    request = ExportRequest(model=str(repo("smolvlm")), ep="cpu", variant="attn_dynamic", max_seq_len=MAX_SEQ_LEN,
                            layout="hf")
    result = export_model(request, tmp_path / "hf")
    report = json.loads((result.out_dir / contract.REPORT_JSON).read_text())  # the layout carries the export's reports
    listed = json.loads((result.out_dir / contract.MANIFEST_FILE).read_text())["files"]
    assert contract.REPORT_JSON in listed and contract.GENAI_CONFIG_FILE not in listed
    gates = [g for g in report["gates"] if "vision_encoder (transformers.js's crops" in g["check"]]
    assert len(gates) == 1 and gates[0]["status"] == "pass" and gates[0]["measured"] <= FEATURE_TOLERANCE
    assert any(row["prompt"].startswith("transformers.js crops") for row in report["components"]["vision"])
    other = load_image_text_reference(make_tiny_vlm_repo("smolvlm", tmp_path / "other", seed=2))
    gate, _ = crops_vision_encoder_gate(repo("smolvlm"), other, "FLOAT", "cpu", "fp32")
    assert not gate.passed and gate.measured > 100 * FEATURE_TOLERANCE
