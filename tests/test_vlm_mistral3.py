"""mistral3 (Pixtral tower, Mistral3 projector and patch merger, a mistral / ministral3 language model) exported as an
image-text export, against transformers' Mistral3ForConditionalGeneration on tiny random weights, fp32 on the CPU.

The vision graph takes pixel_values [num_images, 3, height, width] (images of their own sizes, zero-padded to the
batch's largest, as PixtralImageProcessor pads them) and image_sizes int64 [num_images, 2] (each image's height and
width in pixels), and gives each image's [IMG] rows, image after image: (height // 8) x (width // 8) on the tiny tower
(4-pixel patches merged 2 x 2). image_sizes is an overridable initializer whose default reads each image as the whole
of pixel_values, so pixel_values alone (onnxruntime-genai's per-image runs, transformers.js's one image) runs too. The
runtime counts each image's tokens from image_sizes; [IMG_BREAK] / [IMG_END] are ordinary tokens. One export_model
request gives the three graphs, validated by the pipeline against transformers on one image, two images of different
sizes and text only. What the builder does not compute is refused by name, before anything is written."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.validation.image_text import pixtral_image_run, reference_embeds, reference_features
from exporter.vision import IMAGE_FEATURES, INPUT_IDS, PIXEL_VALUES, build_embedding_graph, build_vision_graph
from exporter.vision.tiny_checkpoint import IMAGE_TOKEN, PADDED_IMAGES_CONFIGS, make_tiny_vlm_checkpoint
from tests.conftest import VARIANTS
from tests.test_vision import worst
from tests.test_vlm import report_of, summary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FEATURE_TOLERANCE = 1e-4  # of the reference features' range (max - min), fp32
TOKEN_PIXELS = 8  # the tiny tower: 4-pixel patches, 2 x 2 merged
MAX_SEQ_LEN = 96  # validation's two-image prompt: 24 + 6 image tokens, 4 + 3 row ends, 12 text tokens, 24 decode steps
BREAK, END = 12, 13  # what the prompts below write for [IMG_BREAK] and [IMG_END] (ordinary tokens of the tiny vocab)

# (height, width) in pixels of each image of one batch; the batch is padded to the largest of each.
SIZES = {
    "square": [[32, 32]],
    "wide": [[24, 48]],
    "tall": [[56, 16]],
    "two images of different sizes": [[32, 48], [24, 16]],
    "three images, one of a single token": [[40, 16], [8, 8], [16, 64]],
    # 5 x 7 patches: the merger's 2 x 2 blocks leave the last row and column out, as transformers' unfold does
    "patch grid the merge does not divide": [[20, 28]],
}


def session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(name) -> (checkpoint dir, transformers model in eval, fp32 vision session), built once per name."""
    root = tmp_path_factory.mktemp("mistral3")

    @functools.cache
    def make(name: str):
        directory = make_tiny_vlm_checkpoint(name, root / name)
        model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
        return directory, model, session(build_vision_graph(directory))

    return make


def padded(sizes, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random normalized images of ``sizes`` zero-padded into one batch, and image_sizes."""
    sizes = np.array(sizes, np.int64)
    rng = np.random.default_rng(seed)
    pixels = np.zeros((len(sizes), 3, *sizes.max(axis=0)), np.float32)
    for i, (height, width) in enumerate(sizes):
        pixels[i, :, :height, :width] = rng.standard_normal((3, height, width))
    return pixels, sizes


def hf_prompt(hf_processor, prompt: str, paths: list) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(ids, pixel_values, image_sizes) as PixtralProcessor makes them from image files (``hf_processor``: the
    checkpoint's PixtralImageProcessor and tokenizer; PixtralProcessor itself wants torchvision): the images at
    patch x merge, each [IMG] of the prompt replaced by its image's rows (PixtralProcessor.replace_image_token),
    tokenized without special tokens (genai adds no BOS)."""
    from PIL import Image

    image_processor, tokenizer = hf_processor
    pixels = sizes = None
    if paths:
        batch = image_processor([Image.open(p) for p in paths], return_tensors="np",
                                patch_size={"height": TOKEN_PIXELS, "width": TOKEN_PIXELS})
        pixels, sizes = batch["pixel_values"], np.asarray(batch["image_sizes"], np.int64)
        pieces = prompt.split("[IMG]")
        prompt = pieces[0]
        for (height, width), piece in zip(sizes, pieces[1:]):
            rows = ["[IMG]" * (width // TOKEN_PIXELS) + "[IMG_BREAK]"] * (height // TOKEN_PIXELS)
            prompt += "".join(rows).removesuffix("[IMG_BREAK]") + "[IMG_END]" + piece
    return tokenizer(prompt, add_special_tokens=False, return_tensors="np")["input_ids"], pixels, sizes


@pytest.mark.parametrize("case", SIZES)
def test_image_features_equal_transformers(tiny, case):
    directory, model, vision = tiny("mistral3")
    pixels, sizes = padded(SIZES[case])
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, contract.IMAGE_SIZES: sizes})
    reference = reference_features(model, pixels, image_sizes=sizes)
    assert len(features) == sum((h // TOKEN_PIXELS) * (w // TOKEN_PIXELS) for h, w in SIZES[case])
    error = worst(features, reference)
    print(f"mistral3 {case} {SIZES[case]}: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_an_earlier_feature_layer_gelu_and_projector_biases(tiny):
    """vision_feature_layer -2 (hidden_states[1] of 2 layers: the second layer is not built), an exact GELU in the
    tower's gated MLP, biases on linear_1 and linear_2."""
    directory, model, vision = tiny("mistral3_layer")
    pixels, sizes = padded(SIZES["two images of different sizes"], seed=2)
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, contract.IMAGE_SIZES: sizes})
    error = worst(features, reference_features(model, pixels, image_sizes=sizes))
    print(f"mistral3 hidden_states[1], gelu, projector biases: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE
    graph = build_vision_graph(directory).graph
    assert sum(node.op_type == "MultiHeadAttention" for node in graph) == 1
    assert not any(".layers.1." in name for name in graph.initializers)


def test_pixel_values_alone_read_each_image_whole(tiny):
    """image_sizes is an overridable initializer: a session lists pixel_values as its only input (what
    onnxruntime-genai and transformers.js feed), and each image is then the whole array: one image at its own size,
    or a batch of images of one size, equal transformers' with their sizes."""
    directory, model, vision = tiny("mistral3")
    assert [i.name for i in vision.get_inputs()] == [PIXEL_VALUES]
    assert [i.name for i in vision.get_overridable_initializers()] == [contract.IMAGE_SIZES]
    graph = onnx.load_from_string(ir.to_proto(build_vision_graph(directory)).SerializeToString())
    assert [i.name for i in graph.graph.input] == [PIXEL_VALUES, contract.IMAGE_SIZES]
    meta = {p.key: p.value for p in graph.metadata_props}
    assert (meta[contract.META_PATCH_SIZE], meta[contract.META_SPATIAL_MERGE_SIZE], meta[contract.META_TOKENS_PER_IMAGE]) \
        == ("4", "2", "0")
    for sizes in ([[24, 48]], [[32, 16], [32, 16]]):
        pixels, image_sizes = padded(sizes, seed=3)
        (features,) = vision.run(None, {PIXEL_VALUES: pixels})
        assert worst(features, reference_features(model, pixels, image_sizes=image_sizes)) <= FEATURE_TOLERANCE


def test_processor_output_goes_straight_in(tiny):
    """Two odd-sized images through transformers' own Pixtral image processor (patch_size patch x merge, as
    PixtralProcessor calls it; longest edge 64): its padded pixel_values and image_sizes are the graph's inputs as
    they are."""
    directory, model, vision = tiny("mistral3")
    processor = transformers.PixtralImageProcessorPil(size={"longest_edge": 64},
                                                      patch_size={"height": TOKEN_PIXELS, "width": TOKEN_PIXELS})
    rng = np.random.default_rng(4)
    batch = processor(images=[rng.integers(0, 256, (37, 53, 3), dtype=np.uint8),
                              rng.integers(0, 256, (90, 20, 3), dtype=np.uint8)], return_tensors="np")
    pixels, sizes = batch["pixel_values"], np.asarray(batch["image_sizes"], np.int64)
    assert sizes.tolist() == [[40, 56], [64, 16]] and list(pixels.shape) == [2, 3, 64, 56]
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, contract.IMAGE_SIZES: sizes})
    error = worst(features, reference_features(model, pixels, image_sizes=sizes))
    print(f"mistral3 processor images: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_pixtral_rotary_layout_matters(tiny, monkeypatch):
    """The comparisons above can tell Pixtral's rotary from Qwen's: columns on the even frequencies (as rows are)
    instead of the odd ones put the features far off transformers'."""
    import exporter.vision.pixtral as pixtral

    directory, model, _ = tiny("mistral3")
    own = pixtral.rotary_angles
    monkeypatch.setattr(pixtral, "rotary_angles", lambda b, rows, cols, cfg: own(b, rows, rows, cfg))
    pixels, sizes = padded(SIZES["two images of different sizes"])
    (features,) = session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels,
                                                                     contract.IMAGE_SIZES: sizes})
    assert worst(features, reference_features(model, pixels, image_sizes=sizes)) > 0.01


def test_merged_embeds_equal_transformers(tiny):
    """A prompt of two images written as PixtralProcessor writes them ([IMG] rows, each ending in [IMG_BREAK], the
    last in [IMG_END]): the vision graph's rows merged by the embedding graph equal the inputs_embeds transformers
    feeds its language model; the break and end tokens keep their table rows."""
    directory, model, vision = tiny("mistral3")
    pixels, sizes = padded(SIZES["two images of different sizes"], seed=1)
    runs = [pixtral_image_run(h // TOKEN_PIXELS, w // TOKEN_PIXELS, IMAGE_TOKEN, BREAK, END) for h, w in sizes]
    prompt = [1, 5, *runs[0], 7, *runs[1], 9]
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, contract.IMAGE_SIZES: sizes})
    embedding = session(build_embedding_graph(directory))
    (embeds,) = embedding.run(None, {INPUT_IDS: np.array([prompt], np.int64), IMAGE_FEATURES: features})
    error = worst(embeds, reference_embeds(model, prompt, pixels, image_sizes=sizes))
    print(f"mistral3 merged embeds (two images, breaks): max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


# --- end to end, through export_model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral3_export(tmp_path_factory):
    """mistral3_export(name, variant, dtype="fp32") -> ExportResult, validated, exported once per arguments."""
    root = tmp_path_factory.mktemp("mistral3-exports")

    @functools.cache
    def make(name: str, variant: str, dtype: str = "fp32"):
        checkpoint = make_tiny_vlm_checkpoint(name, root / f"{name}-ckpt")
        request = ExportRequest(model=str(checkpoint), dtype=dtype, ep="cpu", variant=variant,
                                static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
        return export_model(request, root / f"{name}-{variant}-{dtype}", validate=True)

    return make


def assert_passes_in_fp32(result) -> dict:
    report = report_of(result)
    assert report["status"] == "passed", report["failed_gates"]
    assert result.manifest.data["status"] == "ready"
    sections = report["components"]
    assert [s["prompt"] for s in sections["end_to_end"]] == ["one image", "two images", "text only"]
    # one 32 x 32 image (4 x 4 tokens); 32 x 48 and 24 x 16 (24 + 6), padded into one batch of 32 x 48
    assert [s["image_sizes"] for s in sections["vision"]] == [[[32, 32]], [[32, 48], [24, 16]]]
    assert [s["image_tokens"] for s in sections["embedding"]] == [16, 30, 0]
    assert [s["tokens"] for s in sections["embedding"]] == [16 + 4 + 12, 30 + 7 + 12, 12]  # with the row ends
    for section in sections["vision"] + sections["embedding"]:
        assert section["max_abs_error_of_range"] <= FEATURE_TOLERANCE
    for run in sections["end_to_end"]:
        assert run["prefill_max_abs_error"] <= FEATURE_TOLERANCE * run["logit_range"]
        assert run["greedy_equal"] and len(run["greedy_tokens"]) == 24
    return report


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_export_generates_transformers_tokens(mistral3_export, variant):
    """The pipeline's own validation: every gate passes, image features and merged embeddings within 1e-4 of their
    range, the three graphs' greedy tokens equal transformers' generate on one image, two images of different sizes
    and text only. The tiny config ties the head (Mistral3Config's default): save_pretrained stores no lm_head."""
    result = mistral3_export("mistral3", variant)
    print(f"mistral3 {variant} fp32: {summary(assert_passes_in_fp32(result))}")
    vision = onnx.load(str(result.out_dir / contract.VISION_FILE), load_external_data=False)
    assert [i.name for i in vision.graph.input] == [PIXEL_VALUES, contract.IMAGE_SIZES]
    entry = result.manifest.data["image_text"]
    assert [i["name"] for i in entry["components"][contract.VISION]["inputs"]] == [PIXEL_VALUES, contract.IMAGE_SIZES]
    assert "unread" not in entry


def test_ministral3_language_model(mistral3_export):
    """A Ministral 3 language model (yarn with Llama 4's query scale, which moves every 8 positions here) under the
    same tower: validated end to end on gqa."""
    print(f"mistral3 + ministral3 gqa fp32: {summary(assert_passes_in_fp32(mistral3_export('mistral3_ministral3', 'gqa')))}")


def test_earlier_feature_layer_export_lists_the_unread_layer(mistral3_export):
    result = mistral3_export("mistral3_layer", "attn_dynamic")
    print(f"mistral3 hidden_states[1] attn_dynamic fp32: {summary(assert_passes_in_fp32(result))}")
    unread = result.manifest.data["image_text"]["unread"]["tensors"]
    assert unread and all(".transformer.layers.1." in name for name in unread)


def test_fp16_export_passes(mistral3_export):
    report = report_of(mistral3_export("mistral3", "attn_dynamic", "fp16"))
    print(f"mistral3 attn_dynamic fp16: {summary(report)}")
    assert report["status"] == "passed", report["failed_gates"]
    for run in report["components"]["end_to_end"]:
        assert not run["mismatches"]  # a differing token only at a near tie


def test_runtime_takes_whole_images_of_their_own_sizes(mistral3_export):
    """open_image_text gives the padded-images runtime: it counts each queued image's tokens from image_sizes and
    refuses a call that splits an image's tokens."""
    from exporter.runtime.image_text import PaddedImagesModel, open_image_text

    runtime = open_image_text(mistral3_export("mistral3", "attn_dynamic").out_dir, prepack=False, spin=False)
    assert isinstance(runtime, PaddedImagesModel)
    pixels, sizes = padded(SIZES["two images of different sizes"])
    assert runtime.encode(pixels, sizes).shape == (30, 64)
    assert [runtime.token_grid(size) for size in sizes] == [(4, 6), (3, 2)]
    with pytest.raises(ValueError, match=r"10 image tokens are not whole images of the 2 queued \(their tokens: \[24, 6\]\)"):
        runtime.decoder.embed(np.array([[IMAGE_TOKEN] * 10], np.int64))
    runtime.clear()
    with pytest.raises(ValueError, match=r"image_sizes \[\[40, 48\]\] are not one \(height, width\) per image within"):
        runtime.image_features(pixels[:1], np.array([[40, 48]]))


# --- refusals ------------------------------------------------------------------------------------------------------


def _checkpoint(tmp_path, **overrides):
    return make_tiny_vlm_checkpoint("mistral3", tmp_path / "ckpt", **overrides)


_, _MISTRAL3 = PADDED_IMAGES_CONFIGS["mistral3"]
_TOWER = _MISTRAL3["vision_config"]
REFUSED_CONFIGS = {
    "feature-layers": (dict(vision_feature_layer=[0, -1]), r"vision_feature_layer \[0, -1\] names several layers, whose "
                       r"features side by side transformers' own Mistral3MultiModalProjector cannot normalize"),
    "head-dim": (dict(vision_config={**_TOWER, "hidden_size": 24, "intermediate_size": 48, "num_attention_heads": 4}),
                 r"vision hidden_size 24 over num_attention_heads 4 must give a head_dim that is a multiple of 4"),
    "rope-theta": (dict(vision_config={**_TOWER, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.5}}),
                   r"rope_parameters .* are not what the vision builder computes: an axial rope whose rope_theta is a "
                   r"whole number"),
    "activation": (dict(vision_config={**_TOWER, "hidden_act": "relu"}),
                   r"vision_config.hidden_act 'relu' is not one the vision builder computes for Pixtral's gated MLP"),
}


@pytest.mark.parametrize("case", REFUSED_CONFIGS)
def test_settings_the_builder_does_not_compute_are_refused_by_name(tmp_path, case):
    overrides, message = REFUSED_CONFIGS[case]
    config = getattr(transformers, "Mistral3Config")(**{**_MISTRAL3, **overrides})
    (tmp_path / "ckpt").mkdir()
    config.save_pretrained(tmp_path / "ckpt")  # the config alone: refused before any weight is read
    with pytest.raises(ExportError, match=message):
        export_model(ExportRequest(model=str(tmp_path / "ckpt"), max_seq_len=MAX_SEQ_LEN), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_tower_other_than_pixtral_is_refused_by_name(tmp_path):
    config = transformers.Mistral3Config(**{**_MISTRAL3, "vision_config": {"model_type": "siglip_vision_model",
                                                                           "hidden_size": 32}})
    (tmp_path / "ckpt").mkdir()
    config.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"mistral3's vision tower is 'siglip_vision_model', which the vision builder "
                                          r"does not build for it: it takes a Pixtral tower"):
        export_model(ExportRequest(model=str(tmp_path / "ckpt")), tmp_path / "out")


@pytest.mark.parametrize("change, message", [
    (dict(max_seq_len=64), r"max_seq_len 64 is shorter than validation's two-image prompt needs \(30 image tokens \+ "
                           r"7 row-end tokens \+ 12 text tokens \+ 24 decode steps = 73\)"),
    (dict(dtype="bf16", ep="cuda", layout="hf"), r"transformers.js has no file name for bf16 weights"),
    (dict(builder="traced"), r"transformers.exporters does not build the vision and embedding graphs"),
    (dict(layout="hf"), r"no processor_config.json or preprocessor_config.json.*layout farm"),
], ids=["too-short", "bf16-hf", "traced", "hf-without-processor"])
def test_requests_it_cannot_serve_are_refused_and_nothing_is_written(tmp_path, change, message):
    checkpoint = _checkpoint(tmp_path)
    with pytest.raises(ExportError, match=message):
        export_model(ExportRequest(**{"model": str(checkpoint), "max_seq_len": MAX_SEQ_LEN, **change}), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
