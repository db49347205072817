"""The vision-encoder and embedding graphs of image-text checkpoints (exporter.vision, issue 48) against
transformers on the same tiny random weights, fp32 on the CPU with real onnxruntime sessions:
image features per image (one and two images), the merged inputs_embeds, an fp16 build, refusals."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporter.errors import ExportError
from exporter.vision import (
    IMAGE_FEATURES, INPUT_IDS, INPUTS_EMBEDS, PIXEL_VALUES, build_embedding_graph, build_vision_graph,
    load_vision_config,
)
from exporter.vision.tiny_checkpoint import VLM_CONFIGS, make_tiny_vlm_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = sorted(VLM_CONFIGS)  # gemma3, idefics3, llava, llava_layers, smolvlm
FEATURE_TOLERANCE = 1e-4  # of the reference features' range (max - min), fp32
FP16_TOLERANCE = 3e-3  # of the range: fp16 weights and activations against transformers' fp32 (measured <= 6.5e-4)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """vlm(case) -> (checkpoint dir, transformers model in eval), built once per case."""
    root = tmp_path_factory.mktemp("vlm")

    @functools.cache
    def make(case: str):
        directory = make_tiny_vlm_checkpoint(case, root / case)
        model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
        return directory, model

    return make


def session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def images(directory, count: int, seed: int = 0) -> np.ndarray:
    """``count`` random normalized images at the checkpoint's size, as its image processor would give them."""
    size = load_vision_config(directory).image_size
    return np.random.default_rng(seed).standard_normal((count, 3, size, size)).astype(np.float32)


def reference_features(model, pixels: np.ndarray) -> np.ndarray:
    """transformers' get_image_features, the images' rows one after another (as the vision graph gives them):
    [images * tokens, text hidden]."""
    with torch.no_grad():
        if model.config.model_type in ("idefics3", "smolvlm"):  # [batch, images, ...] in; a flat row per batch row out
            (flat,) = model.model.get_image_features(torch.from_numpy(pixels)[None]).pooler_output
            return flat.reshape(-1, flat.shape[-1]).numpy()
        out = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output
        out = torch.stack(list(out)) if isinstance(out, (list, tuple)) else out
        return out.reshape(-1, out.shape[-1]).numpy()


def reference_embeds(model, input_ids: np.ndarray, pixels: np.ndarray | None,
                     grid_thw: np.ndarray | None = None) -> np.ndarray:
    """The inputs_embeds transformers' model hands its language model (text and images merged), one image per
    prompt row; ``grid_thw``: a patch-sequence model's image_grid_thw (qwen2_5_vl, qwen3_5)."""
    captured = {}
    language_model = getattr(model.model, "language_model", None) or model.model.text_model

    def capture(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    hook = language_model.register_forward_pre_hook(capture, with_kwargs=True)
    kwargs = {"input_ids": torch.from_numpy(input_ids)}
    if pixels is not None:
        pixel_values = torch.from_numpy(pixels)
        if model.config.model_type in ("idefics3", "smolvlm"):
            pixel_values = pixel_values[:, None]  # [batch, images per row, ...]
        kwargs["pixel_values"] = pixel_values
        if grid_thw is not None:
            kwargs["image_grid_thw"] = torch.from_numpy(grid_thw)
            # the processor's token types (image 1, text 0), which qwen3_5 wants beside a grid for its M-RoPE positions
            kwargs["mm_token_type_ids"] = torch.from_numpy((input_ids == model.config.image_token_id).astype(np.int32))
    try:
        with torch.no_grad():
            model.model(**kwargs)
    finally:
        hook.remove()
    return captured["embeds"].numpy()


def worst(ours: np.ndarray, reference: np.ndarray) -> float:
    """Max abs error as a fraction of the reference's range."""
    assert ours.shape == reference.shape
    return float(np.abs(ours.astype(np.float64) - reference).max() / np.ptp(reference))


def prompt(directory, rows: int) -> np.ndarray:
    """``rows`` prompts of the same length, each with one image's tokens between text tokens."""
    cfg = load_vision_config(directory)
    image = [cfg.image_token_id] * cfg.tokens_per_image
    text = [[1, 5, 6, *image, 7, 8], [1, 9, *image, 10, 11, 12]]
    return np.array(text[:rows], dtype=np.int64)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("count", [1, 2])
def test_image_features_equal_transformers(vlm, case, count):
    directory, model = vlm(case)
    pixels = images(directory, count)
    (features,) = session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels})
    reference = reference_features(model, pixels)
    error = worst(features, reference)
    print(f"{case} {count} image(s): max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE, f"{case}: image features off by {error:.2e} of their range"


@pytest.mark.parametrize("case", CASES)
def test_merged_embeds_equal_transformers(vlm, case):
    """Two prompt rows, an image in each: the vision graph's features merged by the embedding graph equal
    the inputs_embeds transformers feeds its language model; text positions exactly (same table rows)."""
    directory, model = vlm(case)
    pixels, input_ids = images(directory, 2, seed=1), prompt(directory, 2)
    (features,) = session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels})
    (embeds,) = session(build_embedding_graph(directory)).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: features})
    reference = reference_embeds(model, input_ids, pixels)
    error = worst(embeds, reference)
    print(f"{case} merged inputs_embeds: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE
    text = input_ids != load_vision_config(directory).image_token_id
    np.testing.assert_array_equal(embeds[text], reference[text])


@pytest.mark.parametrize("case", ["gemma3", "llava"])
def test_text_only_prompt_takes_no_features(vlm, case):
    """num_images 0: the embedding graph is the (gemma3: scaled) token embedding alone."""
    directory, model = vlm(case)
    input_ids = np.array([[1, 5, 6, 7, 8, 9]], dtype=np.int64)
    cfg = load_vision_config(directory)
    none = np.zeros((0, cfg.text_hidden_size), np.float32)
    (embeds,) = session(build_embedding_graph(directory)).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: none})
    np.testing.assert_array_equal(embeds, reference_embeds(model, input_ids, None))


@pytest.mark.parametrize("case", CASES)
def test_fp16_build_is_close_to_fp32_transformers(vlm, case):
    directory, model = vlm(case)
    pixels, input_ids = images(directory, 2, seed=2), prompt(directory, 2)
    vision, embedding = build_vision_graph(directory, ir.DataType.FLOAT16), build_embedding_graph(directory, ir.DataType.FLOAT16)
    for graph in (vision, embedding):  # a half build holds no fp32 initializer
        assert {v.const_value.dtype for v in graph.graph.initializers.values()} <= {ir.DataType.FLOAT16, ir.DataType.INT64}
    (features,) = session(vision).run(None, {PIXEL_VALUES: pixels})
    assert features.dtype == np.float16
    (embeds,) = session(embedding).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: features})
    feature_error = worst(features, reference_features(model, pixels))
    embeds_error = worst(embeds, reference_embeds(model, input_ids, pixels))
    print(f"{case} fp16: features {feature_error:.2e}, merged embeds {embeds_error:.2e} of range")
    assert feature_error <= FP16_TOLERANCE and embeds_error <= FP16_TOLERANCE


@pytest.mark.parametrize("case", ["gemma3", "llava"])
def test_hub_layout_checkpoint(vlm, case, tmp_path):
    """Hub checkpoints nest the tower one level deeper than transformers 5 saves it (``vision_tower.vision_model.``,
    the pre-5 module layout): the same tensors under those names (which transformers loads too) give the same
    features."""
    from safetensors.numpy import load_file, save_file

    directory, _ = vlm(case)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    renamed = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in tensors.items()}
    assert any(n.startswith("vision_tower.vision_model.") for n in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    pixels = images(tmp_path, 2, seed=3)
    (features,) = session(build_vision_graph(tmp_path)).run(None, {PIXEL_VALUES: pixels})
    assert worst(features, reference_features(model, pixels)) <= FEATURE_TOLERANCE
    np.testing.assert_array_equal(features, session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels})[0])


def test_graph_contract_and_fused_ops(vlm):
    """Names, dtypes and static dims as exporter.vision's docstring states them; the tower in fused ops."""
    directory, _ = vlm("llava")
    cfg = load_vision_config(directory)
    vision = build_vision_graph(directory)
    (pixels,), (features,) = vision.graph.inputs, vision.graph.outputs
    assert (pixels.name, pixels.dtype, pixels.shape.dims[1:]) == (PIXEL_VALUES, ir.DataType.FLOAT, (3, 32, 32))
    assert (features.name, features.shape.dims) == (IMAGE_FEATURES, ("num_image_tokens", cfg.text_hidden_size))
    ops = {node.op_type for node in vision.graph}
    assert {"Conv", "Attention", "LayerNormalization", "SkipLayerNormalization", "QuickGelu", "Gelu"} <= ops
    # vision_feature_layer -2 of 3 layers: the last layer is never built
    assert sum(node.op_type == "Attention" for node in vision.graph) == 2
    embedding = build_embedding_graph(directory)
    assert [v.name for v in embedding.graph.inputs] == [INPUT_IDS, IMAGE_FEATURES]
    assert [v.name for v in embedding.graph.outputs] == [INPUTS_EMBEDS]
    assert vision.metadata_props["exportfarm.vision.tokens_per_image"] == str(cfg.tokens_per_image) == "64"


def test_unsupported_family_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    with pytest.raises(ExportError, match=r"no vision graph for model_type 'paligemma'.*gemma3, llava, idefics3, smolvlm"):
        build_vision_graph(tmp_path)


def test_llava_with_a_tower_it_cannot_build_is_refused_by_name(tmp_path):
    """A llava config whose tower is Pixtral (rotary 2-D positions, not a CLIP / SigLIP ViT): the message
    names the tower and what the builder takes, before any weight is read."""
    config = transformers.LlavaConfig(text_config={"model_type": "llama"},
                                      vision_config={"model_type": "pixtral", "hidden_size": 32})
    config.save_pretrained(tmp_path)
    with pytest.raises(ExportError, match=r"vision tower is 'pixtral', which the vision builder does not build: it takes CLIP and SigLIP"):
        build_embedding_graph(tmp_path)
