"""The hf layout of an image-text export (exporter/packaging/hf_image_text.py) run by transformers.js 4
under Node as a user runs it: AutoProcessor on a PNG and a prompt naming the image, then
AutoModelForImageTextToText.generate (clients/transformersjs/image_text_generate.mjs). transformers,
driven with the ids and the pixel_values transformers.js computed (its own processor's within 1e-6 of them,
the ids equal), gives the same greedy tokens: one image + text, and text only, for gemma3 and llava in fp32
(fp16 and int4 run too, checked against transformers on the exact same inputs where they are exact). And
what transformers.js cannot run, refused before anything is written."""

from __future__ import annotations

import functools
import json
import subprocess
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
from exporter.vision.tiny_processor import PROMPT_IMAGE, make_tiny_vlm_repo
from tests.test_hf_layout import transformersjs  # noqa: F401  (the fixture: npm ci of clients/transformersjs)

SCRIPT = Path(__file__).resolve().parents[1] / "clients" / "transformersjs" / "image_text_generate.mjs"
NEW_TOKENS = 12
MAX_SEQ_LEN = 192
PIXEL_TOLERANCE = 1e-6  # both processors rescale and normalize an image already at the tower's size in fp32
CASES = ["gemma3", "llava"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """repo(case) -> a tiny image-text checkpoint saved with its processor (made once)."""
    root = tmp_path_factory.mktemp("vlm-repos")
    return functools.cache(lambda case: make_tiny_vlm_repo(case, root / case, seed=1))


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory, repo):
    """laid_out(case, dtype) -> the export of ``case`` straight into the hf layout (export_model, layout hf)."""
    root = tmp_path_factory.mktemp("vlm-hf")

    @functools.cache
    def make(case: str, dtype: str = "fp32") -> Path:
        quant = {"accuracy_level": 0, "keep": ["lm_head"] if case == "gemma3" else []} if dtype == "int4" else None
        request = ExportRequest(model=str(repo(case)), dtype=dtype, ep="cpu", variant="attn_dynamic",
                                max_seq_len=MAX_SEQ_LEN, layout="hf", quant=quant)
        return export_model(request, root / f"{case}-{dtype}", validate=False).out_dir

    return make


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A 32 x 32 RGB PNG of noise: the towers' own size, so neither processor resamples it."""
    from PIL import Image

    path = tmp_path_factory.mktemp("image") / "noise.png"
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


def prompts(case: str, image: Path) -> list[dict]:
    """One image + text, then text only."""
    return [{"prompt": f"hello {PROMPT_IMAGE[case]} the quick brown fox", "image": str(image),
             "max_new_tokens": NEW_TOKENS},
            {"prompt": "export the model to onnx and run it", "image": None, "max_new_tokens": NEW_TOKENS}]


def js_generate(layout: Path, dtype: str, requests: list[dict]) -> list[dict]:
    """One Node process: AutoProcessor + AutoModelForImageTextToText.generate per request."""
    paths = []
    for i, request in enumerate(requests):
        path = layout.parent / f"{layout.name}-request-{i}.json"
        path.write_text(json.dumps(request))
        paths.append(str(path))
    proc = subprocess.run(["node", str(SCRIPT), str(layout), dtype, *paths], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(requests), proc.stdout[-2000:]
    return lines


def hf_generate(checkpoint: Path, js: dict) -> list[int]:
    """transformers' greedy tokens on the ids and pixel_values transformers.js fed its model (no
    token_type_ids: transformers.js passes none, so gemma3 attends causally in both)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor(js["input_ids"])
    kwargs = {}
    if js["pixel_values"] is not None:
        kwargs["pixel_values"] = torch.tensor(js["pixel_values"]["data"], dtype=torch.float32).reshape(
            js["pixel_values"]["dims"])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0].tolist()


def check_processor(checkpoint: Path, request: dict, js: dict) -> float:
    """transformers' own processor on the same image and prompt: the same ids, pixel_values within
    PIXEL_TOLERANCE of transformers.js's; returns the largest pixel difference."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    if request["image"] is None:
        want = processor.tokenizer(request["prompt"], return_tensors="np")
    else:
        want = processor(images=Image.open(request["image"]), text=request["prompt"], return_tensors="np")
    assert js["input_ids"] == want["input_ids"].tolist(), "transformers.js's processor gave other ids"
    if request["image"] is None:
        return 0.0
    got = np.asarray(js["pixel_values"]["data"], np.float32).reshape(js["pixel_values"]["dims"])
    assert got.shape == want["pixel_values"].shape
    error = float(np.abs(got - want["pixel_values"]).max())
    assert error <= PIXEL_TOLERANCE, f"pixel_values differ by {error:.2e}"
    return error


@pytest.mark.parametrize("case", CASES)
def test_transformersjs_generates_transformers_tokens_on_an_image_prompt_and_a_text_one(
        case, repo, laid_out, image, transformersjs):  # noqa: F811
    layout = laid_out(case)
    requests = prompts(case, image)
    for request, js in zip(requests, js_generate(layout, "fp32", requests)):
        pixels = check_processor(repo(case), request, js)
        want = hf_generate(repo(case), js)
        got = js["sequences"][0]
        prompt = len(js["input_ids"][0])
        kind = "image + text" if request["image"] else "text only"
        print(f"{case} fp32 {kind}: {prompt} prompt tokens, pixel_values max diff {pixels:.1e}, new tokens "
              f"{got[prompt:]} vs transformers {want[prompt:]}")
        assert got[prompt:] == want[prompt:], f"{kind}: transformers.js {got[prompt:]} vs transformers {want[prompt:]}"
        assert len(set(want[prompt:])) > 2, "the prompt does not tell positions apart (a repeated token)"


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_fp16_and_int4_run_in_transformersjs(dtype, laid_out, image, transformersjs):  # noqa: F811
    """fp16 (every session _fp16) and int4 (decoder_model_merged_q4 beside fp32 vision_encoder / embed_tokens,
    config.json's dtype per session) load and generate with the dtype config.json names ("auto")."""
    layout = laid_out("gemma3", dtype)
    config = json.loads((layout / "config.json").read_text())["transformers.js_config"]
    assert config["dtype"] == ({"decoder_model_merged": "q4", "vision_encoder": "fp32", "embed_tokens": "fp32"}
                               if dtype == "int4" else "fp16")
    outs = js_generate(layout, "auto", prompts("gemma3", image))
    assert all(len(o["sequences"][0]) == len(o["input_ids"][0]) + NEW_TOKENS for o in outs)


def test_the_layout_holds_what_transformersjs_loads(laid_out, repo):
    """The three sessions with the inputs transformers.js feeds (embed_tokens: input_ids only; gemma3's
    decoder: no position_ids), flat processor files, the tokenizer and chat template."""
    for case in CASES:
        layout = laid_out(case)
        sessions = {}
        for name in ("vision_encoder", "embed_tokens", "decoder_model_merged"):
            graph = onnx.load(str(layout / "onnx" / f"{name}.onnx"), load_external_data=False).graph
            sessions[name] = [i.name for i in graph.input]
            assert (layout / "onnx" / f"{name}.onnx_data").is_file()
        assert sessions["vision_encoder"] == [contract.PIXEL_VALUES]
        assert sessions["embed_tokens"] == [contract.INPUT_IDS]
        steps = [n for n in sessions["decoder_model_merged"] if not n.startswith("past_key_values.")]
        assert steps == ([contract.INPUTS_EMBEDS, contract.ATTENTION_MASK] if case == "gemma3" else
                         [contract.INPUTS_EMBEDS, contract.ATTENTION_MASK, contract.POSITION_IDS])
        preprocessor = json.loads((layout / "preprocessor_config.json").read_text())
        assert preprocessor["processor_class"] in ("Gemma3Processor", "LlavaProcessor")
        assert preprocessor["do_normalize"] is True and "image_processor" not in preprocessor
        processor = json.loads((layout / "processor_config.json").read_text())
        assert "image_processor" not in processor
        if case == "llava":  # transformers.js counts h/p * w/p + num_additional_image_tokens, with no "- 1"
            assert processor["num_additional_image_tokens"] == 0
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                "generation_config.json"} <= {p.name for p in layout.iterdir()}
        manifest = json.loads((layout / "manifest.json").read_text())
        assert manifest["layout"]["sessions"]["embed_tokens"] == "onnx/embed_tokens.onnx"
        # The embedding table's bytes are the export's embedding.onnx.data, moved under embed_tokens' name.
        assert manifest["files"]["onnx/embed_tokens.onnx_data"] == manifest["layout"]["from_export"]["files"][
            contract.data_file(contract.EMBEDDING_FILE)]


@pytest.mark.parametrize("case", ["idefics3", "smolvlm"])
def test_pixel_shuffle_families_without_their_processor_are_refused(case, tmp_path):
    """idefics3 / smolvlm run in transformers.js from their own processor (tests/test_hf_layout_vlm_crops.py): a
    checkpoint saved without one is refused before anything is built."""
    checkpoint = make_tiny_vlm_checkpoint(case, tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"has no processor_config.json or preprocessor_config.json"):
        export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN, layout="hf"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_what_transformersjs_cannot_run_is_refused_and_nothing_is_written(repo, tmp_path, monkeypatch):
    bare = make_tiny_vlm_checkpoint("llava", tmp_path / "bare")  # no processor saved with it
    refusals = [
        (dict(model=str(bare)), r"no processor_config.json or preprocessor_config.json.*layout farm"),
        (dict(model=str(repo("llava")), variant="gqa"), r"expects right padding.*left-pad"),
    ]
    for change, message in refusals:
        with pytest.raises(ExportError, match=message):
            export_model(ExportRequest(**{"max_seq_len": MAX_SEQ_LEN, "layout": "hf", **change}), tmp_path / "out")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]
    # A failure while laying the export out leaves neither the layout nor the farm export behind.
    from exporter.packaging import hf_image_text

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_image_text, "embed_tokens_graph", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(ExportRequest(model=str(repo("llava")), max_seq_len=MAX_SEQ_LEN, layout="hf"), tmp_path / "out",
                     validate=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]




def test_gemma3_positions_from_the_mask_run_to_the_end_of_the_context(repo, laid_out, image,
                                                                      transformersjs):  # noqa: F811
    """gemma3's decoder declares no position_ids (transformers.js would feed them from 1, transformers counts
    from 0) and computes them from attention_mask: a text prompt generated up to max_seq_len positions gives
    transformers' tokens all the way."""
    request = dict(prompts("gemma3", image)[1])
    prompt = len(transformers.AutoTokenizer.from_pretrained(repo("gemma3"))(request["prompt"]).input_ids)
    request["max_new_tokens"] = MAX_SEQ_LEN - prompt  # the last step's token sits at position MAX_SEQ_LEN - 1
    js = js_generate(laid_out("gemma3"), "fp32", [request])[0]
    model = transformers.AutoModelForImageTextToText.from_pretrained(repo("gemma3"), dtype=torch.float32)
    ids = torch.tensor(js["input_ids"])
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=request["max_new_tokens"],
                          min_new_tokens=request["max_new_tokens"], do_sample=False)[0].tolist()
    assert len(js["sequences"][0]) == MAX_SEQ_LEN and js["sequences"][0] == want


def test_a_qwen2_5_vl_checkpoint_without_its_processor_is_refused_for_the_hf_layout(tmp_path):
    """qwen2_5_vl's hf layout runs in transformers.js (tests/test_hf_layout_vlm_qwen.py), from the checkpoint's own
    image processor: a checkpoint saved without one is refused before anything is built."""
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    source = make_tiny_vlm_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"has no processor_config.json or preprocessor_config.json"):
        export_model(ExportRequest(model=str(source), layout="hf"), tmp_path / "out", validate=False)
    assert not (tmp_path / "out").exists()
