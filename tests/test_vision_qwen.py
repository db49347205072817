"""Qwen2.5-VL's vision graph (dynamic resolution, 2-D rotary, window attention, the PatchMerger) and Qwen3.5's
(the same rotary, full attention per frame, a learned position table resampled to each grid), and their embedding
graphs, against transformers on the same tiny random weights, fp32 on the CPU with onnxruntime: one graph for every
image grid, the windows and their padding (qwen2_5_vl) or the position table's resampling (qwen3_5) computed from
image_grid_thw at run time."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporter.errors import ExportError
from exporter.vision import (
    IMAGE_FEATURES, IMAGE_GRID_THW, INPUT_IDS, INPUTS_EMBEDS, PIXEL_VALUES, build_embedding_graph,
    build_vision_graph, load_vision_config,
)
from exporter.vision.tiny_checkpoint import IMAGE_TOKEN, make_tiny_vlm_checkpoint
from tests.test_vision import reference_embeds, worst

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FEATURE_TOLERANCE = 1e-4  # of the reference features' range (max - min), fp32
FP16_TOLERANCE = 3e-3  # of the range: fp16 weights and activations against transformers' fp32
VISION_START, VISION_END = IMAGE_TOKEN + 2, IMAGE_TOKEN + 3

# (frames, patch rows, patch columns) per image. The tiny tower's windows are 2 x 2 merged tokens (4 x 4
# patches): 8 x 8 divides into whole windows, 10 x 6 (5 x 3 merged) leaves a short row and column of windows.
GRIDS = {
    "one image": [[1, 8, 8]],
    "two images of different sizes": [[1, 8, 12], [1, 6, 4]],
    "grid the window does not divide": [[1, 10, 6]],
    "three images, one smaller than a window": [[1, 2, 2], [1, 14, 4], [1, 6, 10]],
}


def tiny(name: str, tmp_path_factory):
    """(checkpoint dir, transformers model in eval, fp32 vision session) of the tiny ``name`` checkpoint."""
    directory = make_tiny_vlm_checkpoint(name, tmp_path_factory.mktemp(name))
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, model, session(build_vision_graph(directory))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The tiny qwen2_5_vl, built once."""
    return tiny("qwen2_5_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """The tiny qwen3_5 (its position table 4 x 4 patches), built once."""
    return tiny("qwen3_5", tmp_path_factory)


@pytest.fixture(scope="module", params=["qwen", "qwen3_5"])
def either(request):
    """Each of the two patch-sequence families, for what their graphs share (the embedding graph, the fp16 build)."""
    return request.getfixturevalue(request.param)


def session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def patches(directory, grids: list[list[int]], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random normalized patches for ``grids``, laid out as the image processor lays them out."""
    grid_thw = np.array(grids, dtype=np.int64)
    count = int(grid_thw.prod(axis=1).sum())
    pixels = np.random.default_rng(seed).standard_normal((count, load_vision_config(directory).patch_dim))
    return pixels.astype(np.float32), grid_thw


def reference_features(model, pixels: np.ndarray, grid_thw: np.ndarray, video: bool = False) -> np.ndarray:
    """transformers' get_image_features (get_video_features), its per-image tuple concatenated."""
    get = model.model.get_video_features if video else model.model.get_image_features
    with torch.no_grad():
        per_image = get(torch.from_numpy(pixels), torch.from_numpy(grid_thw)).pooler_output
    return torch.cat(list(per_image)).numpy()


def prompt(grid_thw: np.ndarray, merge: int = 2) -> np.ndarray:
    """One prompt row per image, each with that image's tokens between vision start / end, padded with text
    tokens to one length."""
    rows = [[1, 5, VISION_START, *[IMAGE_TOKEN] * (int(np.prod(g)) // merge ** 2), VISION_END, 7] for g in grid_thw]
    width = max(map(len, rows))
    return np.array([row + [9] * (width - len(row)) for row in rows], dtype=np.int64)


@pytest.mark.parametrize("case", GRIDS)
def test_image_features_equal_transformers(qwen, case):
    directory, model, vision = qwen
    pixels, grid_thw = patches(directory, GRIDS[case])
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    error = worst(features, reference_features(model, pixels, grid_thw))
    print(f"qwen2_5_vl {case} {GRIDS[case]}: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_processor_output_goes_straight_in(qwen):
    """Two odd-sized images through transformers' own Qwen2-VL image processor (sized to the tiny tower):
    its pixel_values and image_grid_thw are the graph's inputs as they are."""
    directory, model, vision = qwen
    processor = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                   min_pixels=16 * 16, max_pixels=64 * 64)
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 256, (37, 53, 3), dtype=np.uint8), rng.integers(0, 256, (60, 20, 3), dtype=np.uint8)]
    batch = processor(images=images, return_tensors="np")
    pixels, grid_thw = batch["pixel_values"], batch["image_grid_thw"]
    assert grid_thw.tolist() == [[1, 10, 14], [1, 16, 4]]  # 5 x 7 merged tokens: windows padded both ways
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    error = worst(features, reference_features(model, pixels, grid_thw))
    print(f"qwen2_5_vl processor images: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_windows_matter_on_these_grids(qwen, monkeypatch):
    """The comparisons above can tell window attention from full attention: the same weights built with every
    block on full attention are far off transformers'."""
    import exporter.vision.graphs as graphs

    directory, model, _ = qwen
    read = graphs.load_vision_config
    monkeypatch.setattr(graphs, "load_vision_config",
                        lambda d: dataclasses.replace(read(d), full_attention_layers=(0, 1, 2, 3)))
    pixels, grid_thw = patches(directory, GRIDS["grid the window does not divide"])
    (features,) = session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    assert worst(features, reference_features(model, pixels, grid_thw)) > 0.05


def test_frames_of_a_video_grid_equal_get_video_features(qwen):
    """A grid of several frames (t > 1: full attention per frame, windows per frame) computes what
    get_video_features does; the embedding graph takes no video features (see test_video_tokens_are_not_merged)."""
    directory, model, vision = qwen
    pixels, grid_thw = patches(directory, [[3, 6, 10], [2, 4, 4]], seed=5)
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    assert worst(features, reference_features(model, pixels, grid_thw, video=True)) <= FEATURE_TOLERANCE


def test_merged_embeds_equal_transformers(either):
    """Two prompt rows, an image of a different grid in each: the vision graph's 2-D features merged by the
    embedding graph equal the inputs_embeds transformers feeds its language model; text positions exactly."""
    directory, model, vision = either
    pixels, grid_thw = patches(directory, GRIDS["two images of different sizes"], seed=1)
    input_ids = prompt(grid_thw)
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    (embeds,) = session(build_embedding_graph(directory)).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: features})
    reference = reference_embeds(model, input_ids, pixels, grid_thw)
    error = worst(embeds, reference)
    print(f"{model.config.model_type} merged inputs_embeds: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE
    text = input_ids != IMAGE_TOKEN
    np.testing.assert_array_equal(embeds[text], reference[text])


def test_text_only_prompt_takes_no_features(either):
    directory, model, _ = either
    input_ids = np.array([[1, 5, 6, 7, 8, 9]], dtype=np.int64)
    none = np.zeros((0, load_vision_config(directory).text_hidden_size), np.float32)
    (embeds,) = session(build_embedding_graph(directory)).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: none})
    np.testing.assert_array_equal(embeds, reference_embeds(model, input_ids, None, None))


def test_video_tokens_are_not_merged(either):
    """Video is outside the embedding graph's contract: a video token keeps its own table row (transformers
    would want pixel_values_videos there); only image_token_id positions take features."""
    directory, model, _ = either
    cfg = load_vision_config(directory)
    input_ids = np.array([[1, IMAGE_TOKEN + 1, 7]], dtype=np.int64)
    none = np.zeros((0, cfg.text_hidden_size), np.float32)
    (embeds,) = session(build_embedding_graph(directory)).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: none})
    table = model.model.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(embeds[0], table[input_ids[0]])


def test_fp16_build_is_close_to_fp32_transformers(either):
    directory, model, _ = either
    pixels, grid_thw = patches(directory, GRIDS["two images of different sizes"], seed=2)
    input_ids = prompt(grid_thw)
    vision = build_vision_graph(directory, ir.DataType.FLOAT16)
    embedding = build_embedding_graph(directory, ir.DataType.FLOAT16)
    for graph in (vision, embedding):  # a half build holds no fp32 initializer (the rotary's are computed)
        dtypes = {v.const_value.dtype for v in graph.graph.initializers.values()}
        assert dtypes <= {ir.DataType.FLOAT16, ir.DataType.INT64}
    (features,) = session(vision).run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    assert features.dtype == np.float16
    (embeds,) = session(embedding).run(None, {INPUT_IDS: input_ids, IMAGE_FEATURES: features})
    feature_error = worst(features, reference_features(model, pixels, grid_thw))
    embeds_error = worst(embeds, reference_embeds(model, input_ids, pixels, grid_thw))
    print(f"{model.config.model_type} fp16: features {feature_error:.2e}, merged embeds {embeds_error:.2e} of range")
    assert feature_error <= FP16_TOLERANCE and embeds_error <= FP16_TOLERANCE


def test_graph_contract_and_ops(either):
    """Names, dtypes, dims and metadata as exporter.vision's docstring states them (qwen3_5's the same as
    qwen2_5_vl's); no control flow; one MultiHeadAttention and one RotaryEmbedding per block."""
    directory, _, _ = either
    cfg = load_vision_config(directory)
    vision = build_vision_graph(directory)
    assert [(v.name, v.dtype, v.shape.dims) for v in vision.graph.inputs] == [
        (PIXEL_VALUES, ir.DataType.FLOAT, ("num_patches", 3 * 2 * 4 * 4)),
        (IMAGE_GRID_THW, ir.DataType.INT64, ("num_images", 3)),
    ]
    (features,) = vision.graph.outputs
    assert (features.name, features.shape.dims) == (IMAGE_FEATURES, ("num_image_tokens", cfg.text_hidden_size))
    ops = [node.op_type for node in vision.graph]
    assert not {"Loop", "If", "Scan"} & set(ops)
    blocks = {"qwen2_5_vl": 4, "qwen3_5": 3}[cfg.model_type]
    assert ops.count("MultiHeadAttention") == ops.count("RotaryEmbedding") == cfg.num_layers == blocks
    assert {key: vision.metadata_props[f"exportfarm.vision.{key}"]
            for key in ("image_token_id", "tokens_per_image", "image_size", "spatial_merge_size")} == {
        "image_token_id": str(IMAGE_TOKEN), "tokens_per_image": "0", "image_size": "0", "spatial_merge_size": "2"}
    embedding = build_embedding_graph(directory)
    assert [(v.name, v.shape.dims) for v in embedding.graph.inputs] == [
        (INPUT_IDS, ("batch_size", "sequence_length")), (IMAGE_FEATURES, ("num_image_tokens", cfg.text_hidden_size))]
    assert [v.name for v in embedding.graph.outputs] == [INPUTS_EMBEDS]


def test_a_family_without_a_vision_graph_is_refused_by_name(tmp_path):
    """Qwen2-VL's tower (its own merger, no learned position table) is not one the builder takes."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ExportError, match=r"no vision graph for model_type 'qwen2_vl'.*qwen2_5_vl"):
        build_vision_graph(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"window_size": 4}, r"window_size 4 is under one merged token"),
    ({"out_hidden_size": 48}, r"merger gives 48 channels .* text hidden_size is 64"),
    ({"hidden_act": "relu"}, r"hidden_act 'relu' is not one the vision builder computes"),
    ({"fullatt_block_indexes": [7]}, r"fullatt_block_indexes \[7\] name blocks outside its depth 4"),
])
def test_settings_the_graph_does_not_compute_are_refused(tmp_path, change, message):
    from exporter.vision.tiny_checkpoint import PATCH_SEQUENCE_CONFIGS

    _, kwargs = PATCH_SEQUENCE_CONFIGS["qwen2_5_vl"]
    config = transformers.Qwen2_5_VLConfig(**{**kwargs, "vision_config": {**kwargs["vision_config"], **change}})
    config.save_pretrained(tmp_path)
    with pytest.raises(ExportError, match=message):
        build_vision_graph(tmp_path)


# qwen3_5: (frames, patch rows, patch columns) per image against its 4 x 4 position table, which transformers
# resamples to each grid (bilinear, corners aligned): a grid of the table's size reads it as it is, the others between
# its rows and columns, smaller or larger on either axis.
QWEN3_5_GRIDS = {
    "the table's size": [[1, 4, 4]],
    "smaller than the table": [[1, 2, 2]],
    "smaller in rows, larger in columns": [[1, 2, 8]],
    "larger, square": [[1, 8, 8]],
    "larger, wide": [[1, 6, 10]],
    "larger, tall": [[1, 12, 8]],
    "two images of different sizes": [[1, 8, 12], [1, 4, 2]],
    "a grid of two frames": [[2, 6, 10]],
}


@pytest.mark.parametrize("case", QWEN3_5_GRIDS)
def test_qwen3_5_image_features_equal_transformers(qwen3_5, case):
    directory, model, vision = qwen3_5
    pixels, grid_thw = patches(directory, QWEN3_5_GRIDS[case])
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    error = worst(features, reference_features(model, pixels, grid_thw))
    print(f"qwen3_5 {case} {QWEN3_5_GRIDS[case]}: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_qwen3_5_frames_of_video_grids_equal_get_video_features(qwen3_5):
    """Several frames per grid, two grids: every frame attends within itself and reads the table resampled to its
    own rows and columns, as get_video_features computes."""
    directory, model, vision = qwen3_5
    pixels, grid_thw = patches(directory, [[3, 6, 10], [2, 4, 4]], seed=5)
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    error = worst(features, reference_features(model, pixels, grid_thw, video=True))
    print(f"qwen3_5 video grids: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_qwen3_5_processor_output_goes_straight_in(qwen3_5):
    """Two odd-sized images through the Qwen2-VL image processor that transformers' AutoImageProcessor gives
    qwen3_5 (mean and std 0.5, sized to the tiny tower): its pixel_values and image_grid_thw are the graph's
    inputs as they are."""
    directory, model, vision = qwen3_5
    processor = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                      min_pixels=16 * 16, max_pixels=64 * 64,
                                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 256, (37, 53, 3), dtype=np.uint8), rng.integers(0, 256, (60, 20, 3), dtype=np.uint8)]
    batch = processor(images=images, return_tensors="np")
    pixels, grid_thw = batch["pixel_values"], batch["image_grid_thw"]
    assert grid_thw.tolist() == [[1, 10, 14], [1, 16, 4]]
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    error = worst(features, reference_features(model, pixels, grid_thw))
    print(f"qwen3_5 processor images: max |err| / range = {error:.2e}")
    assert error <= FEATURE_TOLERANCE


def test_qwen3_5_resampling_rule_matters_on_these_grids(qwen3_5):
    """The comparisons above can tell the table's resampling rule: transformers' own tower with the table resampled
    with half-pixel centres (align_corners False) instead is far off the graph's features."""
    directory, model, vision = qwen3_5
    pixels, grid_thw = patches(directory, QWEN3_5_GRIDS["larger, wide"])
    (features,) = vision.run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    model.model.visual.interpolation_align_corners = False
    try:
        other_rule = reference_features(model, pixels, grid_thw)
    finally:
        model.model.visual.interpolation_align_corners = True
    error = worst(features, other_rule)
    print(f"qwen3_5 features against align_corners False: max |err| / range = {error:.2e}")
    assert error > 10 * FEATURE_TOLERANCE


@pytest.mark.parametrize("change, message", [
    ({"deepstack_visual_indexes": [1]}, r"deepstack_visual_indexes \[1\], but Qwen3.5's tower .* has no deepstack"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
     r"vision rope_parameters .*'linear'.* an axial rope whose rope_theta is a whole number"),
    ({"rope_parameters": {"rope_type": "axial", "rope_theta": 10000.5}}, r"whose rope_theta is a whole number"),
    ({"hidden_act": "relu"}, r"hidden_act 'relu' is not one the vision builder computes"),
    ({"out_hidden_size": 48}, r"merger gives 48 channels .* text hidden_size is 64"),
    ({"hidden_size": 36}, r"hidden_size 36 over num_heads 2 must give a head_dim that is a multiple of 4"),
    ({"head_dim": 8}, r"head_dim 8 is not hidden_size / num_heads \(32 / 2\)"),
    ({"patch_size": [4, 4]}, r"must each be one positive integer"),
])
def test_qwen3_5_settings_the_graph_does_not_compute_are_refused(tmp_path, change, message):
    from exporter.vision.tiny_checkpoint import PATCH_SEQUENCE_CONFIGS

    _, kwargs = PATCH_SEQUENCE_CONFIGS["qwen3_5"]
    config = transformers.Qwen3_5Config(**{**kwargs, "vision_config": {**kwargs["vision_config"], **change}})
    config.save_pretrained(tmp_path)
    with pytest.raises(ExportError, match=message):
        build_vision_graph(tmp_path)


def test_qwen3_5_genai_checkpoint_carries_its_processor(tmp_path):
    """The qwen3_5_genai checkpoint holds the tokenizer and the image processor AutoImageProcessor reads for qwen3_5
    (sized to its tower, mean and std 0.5): what that processor makes of an image goes through the vision graph."""
    from exporter.vision.tiny_checkpoint import QWEN_IMAGE_TOKENS

    directory = make_tiny_vlm_checkpoint("qwen3_5_genai", tmp_path / "qwen3_5_genai")
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (4, 2, 2)
    assert list(processor.image_mean) == list(processor.image_std) == [0.5] * 3
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    cfg = load_vision_config(directory)
    assert tokenizer.convert_tokens_to_ids(QWEN_IMAGE_TOKENS) == [300, 301, cfg.image_token_id, 303]
    image = np.random.default_rng(6).integers(0, 256, (40, 28, 3), dtype=np.uint8)
    batch = processor(images=[image], return_tensors="np")
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    (features,) = session(build_vision_graph(directory)).run(
        None, {PIXEL_VALUES: batch["pixel_values"], IMAGE_GRID_THW: batch["image_grid_thw"]})
    reference = reference_features(model, batch["pixel_values"], batch["image_grid_thw"])
    assert worst(features, reference) <= FEATURE_TOLERANCE
