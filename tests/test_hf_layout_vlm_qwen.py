"""Qwen3.5 in transformers.js 4 (issue 46's last consumer): its classes drive a Qwen3.5 checkpoint only as image-text
(vision_encoder, embed_tokens and decoder_model_merged, M-RoPE position_ids [3, batch, seq] from its own
get_rope_index, text prompts included), so the hf layout of a qwen3_5 checkpoint is its image-text export: the
Qwen3.5 vision tower, the embedding, and the hybrid decoder (LinearAttention + CausalConvWithState, past_conv.i /
past_recurrent.i beside the full-attention layers' KV) taking inputs_embeds with interleaved M-RoPE. Run under Node
as a user runs it (AutoProcessor on a PNG, AutoModelForImageTextToText.generate: clients/transformersjs/
image_text_generate.mjs) and against transformers' generate on the ids, pixel_values and grid transformers.js made.
A text-only prompt decodes in transformers.js 4.3.2 at positions its own rope delta shifts (a bug of its
_get_text_only_rope_index, hf_generate_at_transformersjs_positions): there its tokens are transformers' at those
positions. Qwen3-VL (qwen3_vl, qwen3_vl_moe) likewise through Qwen3VLForConditionalGeneration (transformers.js's
Qwen2.5-VL class): its deepstack maps ride in the rows vision_encoder gives and embed_tokens' rows are as wide (the
table row, then zeros), which transformers.js merges row for row and feeds decoder_model_merged whole."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.packaging.hf_layout import write_hf_layout
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
from tests.test_hf_layout import transformersjs  # noqa: F401  (the fixture: npm ci of clients/transformersjs)
from tests.test_hf_layout_vlm import js_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

NEW_TOKENS = 12
MAX_SEQ_LEN = 256
PIXEL_TOLERANCE = 1e-6  # both processors rescale and normalize an image already on the patch x merge grid, in fp32
IMAGE_PROMPT = "hello <|vision_start|><|image_pad|><|vision_end|> the quick brown fox"
TEXT_PROMPT = "export the model to onnx and run it"


# the MoE one: experts on every layer beside a shared expert; qwen2_5_vl: window attention, sectioned M-RoPE, qwen2;
# qwen3_vl / qwen3_vl_moe: Qwen3.5's tower with deepstack maps, a qwen3 / qwen3_moe decoder taking them in inputs_embeds
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoints(family) -> the tiny Qwen3.5 image-text checkpoint (a linear-attention and a full-attention layer)
    with its tokenizer and image processor."""
    root = tmp_path_factory.mktemp("qwen3_5-vlm")
    return functools.cache(lambda family: make_tiny_vlm_checkpoint(f"{family}_genai", root / family, seed=1))


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("qwen3_5")


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory, checkpoints):
    """laid_out(dtype, family) -> the export straight into the hf layout, validated against transformers on the way."""
    root = tmp_path_factory.mktemp("qwen3_5-hf")

    @functools.cache
    def make(dtype: str = "fp32", family: str = "qwen3_5"):
        request = ExportRequest(model=str(checkpoints(family)), dtype=dtype, ep="cpu", variant="attn_dynamic",
                                max_seq_len=MAX_SEQ_LEN, layout="hf")
        return export_model(request, root / f"{family}-{dtype}", validate=dtype == "fp32")

    return make


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A 48 x 32 PNG of noise: 12 x 8 patches of 4 pixels (6 x 4 merged tokens), already on the processor's
    8-pixel grid and inside its pixel bounds, so neither processor resamples it; the tower's 4 x 4 position
    table is resampled to it."""
    path = tmp_path_factory.mktemp("image") / "noise.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(path)
    return path


def hf_generate(checkpoint, js: dict) -> list[int]:
    """transformers' greedy tokens on the ids, pixel_values and image_grid_thw transformers.js fed its model."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor(js["input_ids"])
    kwargs = {}
    if js["pixel_values"] is not None:
        kwargs = {"pixel_values": torch.tensor(js["pixel_values"]["data"], dtype=torch.float32).reshape(
                      js["pixel_values"]["dims"]),
                  "image_grid_thw": torch.tensor(js["image_grid_thw"]),
                  "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0].tolist()


def hf_generate_at_transformersjs_positions(checkpoint, js: dict) -> list[int]:
    """transformers' greedy tokens on a text-only prompt, each decode step at the M-RoPE position transformers.js
    4.3.2 feeds: past length + its rope delta, which its _get_text_only_rope_index (models/qwen2_vl/
    modeling_qwen2_vl.js) computes as max position + 1 + prompt length where transformers' get_rope_index takes
    max position + 1 - prompt length (0 for an unpadded prompt). So transformers.js decodes a text-only Qwen-VL
    prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) twice the prompt's length further on than transformers does;
    an image prompt takes its other branch, which agrees with transformers."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor(js["input_ids"])
    length = ids.shape[1]
    delta = (length - 1) + 1 + length
    tokens = ids[0].tolist()
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        for step in range(NEW_TOKENS):
            logits = out.logits[0, -1].clone()
            logits[eos] = -torch.inf  # min_new_tokens, as both generate calls are asked for
            token = int(logits.argmax())
            tokens.append(token)
            past = length + step
            positions = torch.full((3, 1, 1), past + delta, dtype=torch.long)
            out = model(input_ids=torch.tensor([[token]]), attention_mask=torch.ones(1, past + 1, dtype=torch.long),
                        position_ids=positions, cache=out.cache, use_cache=True)
    return tokens


def check_processor(checkpoint, request: dict, js: dict) -> float:
    """transformers' tokenizer and image processor on the same prompt and image: the same ids (each <|image_pad|>
    expanded to the image's merged tokens), the same grid, pixel_values within PIXEL_TOLERANCE."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    if request["image"] is None:
        assert js["input_ids"] == [tokenizer(request["prompt"])["input_ids"]]
        return 0.0
    image_processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    want = image_processor(Image.open(request["image"]), return_tensors="np")
    assert js["image_grid_thw"] == want["image_grid_thw"].tolist()
    tokens = int(np.prod(want["image_grid_thw"][0])) // image_processor.merge_size ** 2
    prompt = request["prompt"].replace("<|image_pad|>", "<|image_pad|>" * tokens)
    assert js["input_ids"] == [tokenizer(prompt)["input_ids"]], "transformers.js's processor gave other ids"
    got = np.asarray(js["pixel_values"]["data"], np.float32).reshape(js["pixel_values"]["dims"])
    assert got.shape == want["pixel_values"].shape
    error = float(np.abs(got - want["pixel_values"]).max())
    assert error <= PIXEL_TOLERANCE, f"pixel_values differ by {error:.2e}"
    return error


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_export_is_validated_against_transformers(laid_out, family):
    """The image-text export under the layout passed the pipeline's own gates: the vision features per image, the
    merged embeddings and the greedy tokens on image prompts against transformers' Qwen3.5 (fp32)."""
    result = laid_out("fp32", family)
    report = result.report
    assert report.passed, [g.name for g in report.failed]
    assert result.manifest.data["validation"]["status"] == "passed"
    print(json.dumps(report.components)[:2000])
    components = report.components
    assert {run["prompt"] for run in components["end_to_end"]} == {"one image", "two images", "text only"}
    assert all(run["greedy_equal"] for run in components["end_to_end"])
    assert all(run["max_abs_error_of_range"] <= 1e-4 for run in components["vision"] + components["embedding"])


@pytest.mark.parametrize("family", FAMILIES)
def test_transformersjs_generates_transformers_tokens_on_an_image_prompt_and_a_text_one(
        checkpoints, laid_out, image, transformersjs, family):  # noqa: F811
    checkpoint = checkpoints(family)
    layout = laid_out("fp32", family).out_dir
    requests = [{"prompt": IMAGE_PROMPT, "image": str(image), "max_new_tokens": NEW_TOKENS},
                {"prompt": TEXT_PROMPT, "image": None, "max_new_tokens": NEW_TOKENS}]
    for request, js in zip(requests, js_generate(layout, "fp32", requests)):
        pixels = check_processor(checkpoint, request, js)
        want = hf_generate(checkpoint, js)
        got = js["sequences"][0]
        prompt = len(js["input_ids"][0])
        kind = "image + text" if request["image"] else "text only"
        print(f"{family} fp32 {kind}: {prompt} prompt tokens, grid {js['image_grid_thw']}, pixel_values max diff "
              f"{pixels:.1e}, new tokens {got[prompt:]} vs transformers {want[prompt:]}")
        if request["image"] is None:  # transformers.js's decode positions (its bug): transformers there, and apart
            shifted = hf_generate_at_transformersjs_positions(checkpoint, js)
            print(f"  transformers at transformers.js's decode positions: {shifted[prompt:]}")
            assert got[prompt:] == shifted[prompt:] and got[prompt] == want[prompt] and got != want
            continue
        assert got[prompt:] == want[prompt:], f"{kind}: transformers.js {got[prompt:]} vs transformers {want[prompt:]}"
        assert len(set(want[prompt:])) > 2, "the prompt does not tell positions apart (a repeated token)"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layout_holds_what_transformersjs_loads(laid_out, family):
    """vision_encoder takes the patches and image_grid_thw; embed_tokens input_ids; decoder_model_merged
    inputs_embeds, the mask, 3-D position_ids and the hybrid's caches by transformers.js's names, its linear layers
    on LinearAttention (onnxruntime-node has no GatedDeltaNet kernel); the processor files name Qwen3VLProcessor."""
    layout = laid_out("fp32", family).out_dir
    inputs, outputs = {}, {}
    for name in ("vision_encoder", "embed_tokens", "decoder_model_merged"):
        graph = onnx.load(str(layout / "onnx" / f"{name}.onnx"), load_external_data=False).graph
        inputs[name] = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
        outputs[name] = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.output}
        if name == "decoder_model_merged":
            ops = {n.op_type for n in graph.node}
    assert list(inputs["vision_encoder"]) == [contract.PIXEL_VALUES, contract.IMAGE_GRID_THW]
    assert list(inputs["embed_tokens"]) == [contract.INPUT_IDS]
    decoder = inputs["decoder_model_merged"]
    assert len(decoder[contract.POSITION_IDS]) == 3 and decoder[contract.POSITION_IDS][0] == 3
    preprocessor = json.loads((layout / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"
    if family == "qwen2_5_vl":
        assert preprocessor["processor_class"] == "Qwen2_5_VLProcessor" and "past_key_values.0.key" in decoder
        return
    if family.startswith("qwen3_vl"):  # the rows: 64 hidden + 2 deepstack maps of 64, in all three sessions
        wide = [contract.BATCH, contract.SEQ, 192]
        assert outputs["vision_encoder"][contract.IMAGE_FEATURES] == ["num_image_tokens", 192]
        assert outputs["embed_tokens"][contract.INPUTS_EMBEDS] == decoder[contract.INPUTS_EMBEDS] == wide
        assert {"past_key_values.0.key", "past_key_values.2.value"} <= set(decoder) and "past_conv.0" not in decoder
        assert ("MoE" in ops) == (family == "qwen3_vl_moe")
        assert preprocessor["processor_class"] == "Qwen3VLProcessor"
        return
    assert {"past_conv.0", "past_recurrent.0", "past_key_values.1.key", "past_key_values.1.value"} <= set(decoder)
    assert "LinearAttention" in ops and "GatedDeltaNet" not in ops
    assert ("MoE" in ops) == (family == "qwen3_5_moe")
    assert preprocessor["processor_class"] == "Qwen3VLProcessor"
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"


def test_fp16_runs_in_transformersjs(laid_out, image, transformersjs):  # noqa: F811
    """fp16 (every session _fp16, the first-step caches float16 as config.json tells transformers.js) loads and
    generates."""
    layout = laid_out("fp16").out_dir
    config = json.loads((layout / "config.json").read_text())["transformers.js_config"]
    assert config["dtype"] == "fp16"
    requests = [{"prompt": IMAGE_PROMPT, "image": str(image), "max_new_tokens": NEW_TOKENS}]
    (out,) = js_generate(layout, "auto", requests)
    assert len(out["sequences"][0]) == len(out["input_ids"][0]) + NEW_TOKENS


def test_a_farm_export_of_it_is_refused_for_the_hf_layout_saying_how(checkpoint, tmp_path):
    """The farm layout exports Qwen3.5 as image-text too (onnxruntime-genai's qwen3_5 type:
    tests/test_genai_vlm_qwen3_5.py), its recurrence on GatedDeltaNet, which transformers.js's onnxruntime-node has no
    kernel for; laying it out for transformers.js afterwards is refused, naming the way that works."""
    farm = export_model(ExportRequest(model=str(checkpoint), ep="cpu", variant="attn_dynamic",
                                      max_seq_len=MAX_SEQ_LEN), tmp_path / "farm", validate=False).out_dir
    assert (farm / contract.VISION_FILE).exists()
    with pytest.raises(ExportError, match="GatedDeltaNet.*export it with layout hf"):
        write_hf_layout(farm, tmp_path / "repo", checkpoint)
    assert not (tmp_path / "repo").exists()


def test_a_farm_export_laid_out_carries_its_reports_and_not_its_genai_package(checkpoints, tmp_path):
    """A validated qwen2_5_vl farm export laid out for transformers.js brings its parity report (what the export was
    proven against), not its onnxruntime-genai package's genai_config.json, whose decoder file the layout renames."""
    farm = export_model(ExportRequest(model=str(checkpoints("qwen2_5_vl")), ep="cpu", variant="attn_dynamic",
                                      max_seq_len=MAX_SEQ_LEN), tmp_path / "farm").out_dir
    assert (farm / contract.GENAI_CONFIG_FILE).is_file() and (farm / contract.REPORT_JSON).is_file()
    manifest = write_hf_layout(farm, tmp_path / "hf", checkpoints("qwen2_5_vl"))
    assert {contract.REPORT_JSON, contract.REPORT_MD} <= set(manifest["files"])
    assert (tmp_path / "hf" / contract.REPORT_JSON).read_bytes() == (farm / contract.REPORT_JSON).read_bytes()
    assert contract.GENAI_CONFIG_FILE not in manifest["files"]
    assert not (tmp_path / "hf" / contract.GENAI_CONFIG_FILE).exists()
