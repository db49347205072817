"""Qwen3-VL image-text exports (qwen3_vl, qwen3_vl_moe) with their "deepstack" maps (issue 48), against transformers on
the tiny checkpoints (Qwen3.5's tower of 3 blocks, maps after blocks 0 and 2; a 3-layer qwen3 / qwen3_moe language
model that adds map k after its layer k, k = 0, 1).

Neither onnxruntime-genai's nor transformers.js's decoder takes an input for the maps, so they ride in the embeddings:
vision.onnx gives rows [merged | map 0 | map 1] (text hidden x 3 wide, contract.image_text_width), embedding.onnx
merges them into inputs_embeds of that width (a text token: its embedding, then zeros), and the decoder adds slice
k + 1 after its layer k. Shown here: the vision graph's merged features and each map equal get_image_features' on
several grids; the pipeline's validation passes on every variant (every greedy token transformers', one image, two
images, text only); the maps matter (zeroed, the image prompts' logits move far past the tolerance); the decoder and
manifest describe the width; what cannot be built is refused before anything is written. genai and transformers.js
run these exports in tests/test_genai_vlm_qwen3_vl.py and tests/test_hf_layout_vlm_qwen.py."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import onnx
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision import IMAGE_GRID_THW, PIXEL_VALUES, build_vision_graph, load_vision_config
from exporter.vision.tiny_checkpoint import IMAGE_TOKEN, PATCH_SEQUENCE_CONFIGS, make_tiny_vlm_checkpoint
from tests.conftest import VARIANTS
from tests.test_vision import worst
from tests.test_vision_qwen import patches, session
from tests.test_vlm import report_of, summary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file
safe_open = pytest.importorskip("safetensors").safe_open

MAX_SEQ_LEN = 96
TOLERANCE = 1e-4  # of the reference's range: features, each map, embeddings, prefill logits (fp32)
HIDDEN, MAPS = 64, 2  # the tiny text hidden size; deepstack_visual_indexes [0, 2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    return functools.cache(lambda name: make_tiny_vlm_checkpoint(name, root / name))


@pytest.fixture(scope="module")
def references(checkpoints):
    return functools.cache(lambda name: transformers.AutoModelForImageTextToText.from_pretrained(
        checkpoints(name), dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def exports(tmp_path_factory, checkpoints):
    """exports(name, variant, validate=True) -> ExportResult, exported once per arguments."""
    root = tmp_path_factory.mktemp("qwen3_vl-exports")

    @functools.cache
    def make(name: str, variant: str, validate: bool = True):
        request = ExportRequest(model=str(checkpoints(name)), ep="cpu", variant=variant,
                                static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
        return export_model(request, root / f"{name}-{variant}", validate=validate)

    return make


# (frames, patch rows, patch columns) per image, against the tower's 4 x 4 position table
GRIDS = {
    "the table's size": [[1, 4, 4]],
    "larger, square": [[1, 8, 8]],
    "smaller in rows, larger in columns": [[1, 2, 8]],
    "larger, wide": [[1, 6, 10]],
    "two images of different sizes": [[1, 8, 12], [1, 4, 2]],
}


@pytest.mark.parametrize("case", GRIDS)
def test_merged_features_and_each_deepstack_map_equal_get_image_features(checkpoints, references, case):
    """One vision graph for every grid: its rows are [pooler_output | deepstack_features[0] | deepstack_features[1]],
    each within 1e-4 of its own range (transformers' per-image tuples concatenated)."""
    directory, model = checkpoints("qwen3_vl"), references("qwen3_vl")
    cfg = load_vision_config(directory)
    assert (cfg.deepstack_layers, cfg.feature_width) == ((0, 2), HIDDEN * (1 + MAPS))
    pixels, grid_thw = patches(directory, GRIDS[case])
    (features,) = session(build_vision_graph(directory)).run(None, {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid_thw})
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(grid_thw))
    want = [torch.cat(list(out.pooler_output)).numpy(), *(torch.cat(list(m)).numpy() for m in out.deepstack_features)]
    assert len(want) == 1 + MAPS and features.shape == (len(want[0]), HIDDEN * (1 + MAPS))
    errors = [worst(features[:, k * HIDDEN:(k + 1) * HIDDEN], w) for k, w in enumerate(want)]
    print(f"qwen3_vl {case} {GRIDS[case]}: merged {errors[0]:.2e}, deepstack maps "
          f"{', '.join(f'{e:.2e}' for e in errors[1:])} (max |err| / range)")
    assert max(errors) <= TOLERANCE
    # the maps are not the merged features again (each its own block, its own merger)
    assert min(worst(w, want[0]) for w in want[1:]) > 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_export_generates_transformers_tokens(exports, variant):
    """The pipeline's own validation: vision (merged features and each map), the wide embeddings and every greedy
    token (free-running) against transformers' generate on one image, two images and text only."""
    result = exports("qwen3_vl", variant)
    report = report_of(result)
    print(f"qwen3_vl {variant} fp32: {summary(report)}")
    assert report["status"] == "passed" and result.manifest.data["status"] == "ready"
    sections = report["components"]
    assert [s["prompt"] for s in sections["end_to_end"]] == ["one image", "two images", "text only"]
    assert [s["shape"] for s in sections["vision"]] == [[16, 192], [30, 192]]
    assert all([m["map"] for m in s["deepstack"]] == [0, 1] for s in sections["vision"])
    for section in sections["vision"] + sections["embedding"]:
        assert section["max_abs_error_of_range"] <= TOLERANCE
    for run in sections["end_to_end"]:
        assert run["prefill_max_abs_error"] <= TOLERANCE * run["logit_range"]
        assert run["greedy_equal"] and len(run["greedy_tokens"]) == 24


def hub_layout(checkpoint, out):
    """``checkpoint`` with its experts as Qwen's hub checkpoints store them ([experts, hidden, 2I], [experts, I,
    hidden]: transposed), which transformers reads alike."""
    shutil.copytree(checkpoint, out)
    weights = load_file(str(out / "model.safetensors"))
    save_file({k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("stored", ["as transformers saves them", "as Qwen's hub checkpoints"])
def test_moe_export_generates_transformers_tokens(checkpoints, tmp_path, stored):
    """qwen3_vl_moe: qwen3_moe's layers (always renormalized top 2 of 4), the experts read from either stacked layout
    (told apart by shape, as transformers tells them), validated like the dense one."""
    source = checkpoints("qwen3_vl_moe")
    if stored != "as transformers saves them":
        source = hub_layout(source, tmp_path / "hub")
    with safe_open(str(source / "model.safetensors"), "np") as weights:
        shape = weights.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == ([4, 48, 64] if stored == "as transformers saves them" else [4, 64, 48])
    result = export_model(ExportRequest(model=str(source), variant="gqa", max_seq_len=MAX_SEQ_LEN), tmp_path / "out")
    report = report_of(result)
    print(f"qwen3_vl_moe gqa fp32, experts {stored}: {summary(report)}")
    assert report["status"] == "passed"
    assert all(run["greedy_equal"] for run in report["components"]["end_to_end"])
    assert "MoE" in {n.op_type for n in onnx.load(str(result.out_dir / contract.MODEL_FILE),
                                                    load_external_data=False).graph.node}


def test_the_deepstack_adds_matter(exports, references, monkeypatch):
    """The end-to-end check can tell the maps: the same export with every map slice of inputs_embeds zeroed (the
    decoder then adds nothing) is far off transformers on the image prompts, and exact on text only."""
    import exporter.runtime.image_text as image_text
    from exporter.validation.image_text import image_text_gates

    embed = image_text.ImageTextModel.embed

    def without_maps(self, input_ids, features=None):
        embeds = embed(self, input_ids, features)
        embeds[..., self.text_hidden:] = 0
        return embeds

    result = exports("qwen3_vl", "attn_dynamic")
    monkeypatch.setattr(image_text.ImageTextModel, "embed", without_maps)
    _, sections = image_text_gates(result.out_dir, None, "cpu", "fp32", "fp32", 4, model=references("qwen3_vl"))
    errors = {s["prompt"]: s["prefill_max_abs_error"] / s["logit_range"] for s in sections["end_to_end"]}
    print(f"qwen3_vl with the deepstack maps zeroed: prefill error / range {errors}")
    assert errors["one image"] > 100 * TOLERANCE and errors["two images"] > 100 * TOLERANCE
    assert errors["text only"] <= TOLERANCE


def test_the_width_is_in_the_contract_the_metadata_and_the_manifest(exports):
    """inputs_embeds [batch, seq, 192] into the decoder, split there into the hidden states and the two maps; the
    vision and embedding graphs say 2 maps (exportfarm.vision.deepstack); the manifest says why the width."""
    result = exports("qwen3_vl", "gqa")
    decoder = onnx.load(str(result.out_dir / contract.MODEL_FILE), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in decoder.graph.input}
    assert dims[contract.INPUTS_EMBEDS] == [contract.BATCH, contract.SEQ, contract.image_text_width(HIDDEN, MAPS)]
    assert dims[contract.POSITION_IDS] == [3, contract.BATCH, contract.SEQ]
    (split,) = [n for n in decoder.graph.node if n.op_type == "Split" and n.input[0] == contract.INPUTS_EMBEDS]
    assert len(split.output) == 1 + MAPS
    meta = json.loads({p.key: p.value for p in decoder.metadata_props}[contract.META_CONFIG])
    assert (meta["architecture"], meta["deepstack"], meta["image_text"]) == ("qwen3", MAPS, "qwen3_vl")
    for file in (contract.VISION_FILE, contract.EMBEDDING_FILE):
        graph = onnx.load(str(result.out_dir / file), load_external_data=False)
        assert {p.key: p.value for p in graph.metadata_props}[contract.META_DEEPSTACK] == str(MAPS)
    entry = result.manifest.data["image_text"]["deepstack"]
    assert (entry["maps"], entry["vision_blocks"], entry["decoder_layers"], entry["inputs_embeds_width"]) == (
        MAPS, [0, 2], [0, 1], 192)
    assert "neither onnxruntime-genai 0.18 nor transformers.js 4.3.2 feeds a decoder" in entry["why"]


def config_with(tmp_path, **vision):
    """The tiny qwen3_vl's config.json with ``vision`` settings changed."""
    _, kwargs = PATCH_SEQUENCE_CONFIGS["qwen3_vl"]
    config = transformers.Qwen3VLConfig(**{**kwargs, "vision_config": {**kwargs["vision_config"], **vision}})
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("indexes, message", [
    ([0, 3], r"deepstack_visual_indexes \[0, 3\] name block\(s\) \[3\] outside its tower of depth 3 \(blocks 0..2\): "
             r"transformers never reaches them.* fix config.json"),
    ([-1], r"name block\(s\) \[-1\] outside its tower of depth 3"),
    ([1, 1], r"deepstack_visual_indexes \[1, 1\] name a block twice"),
    ([2, 0, 1], None),  # three maps into three layers, listed in any order: fine (added in block order)
])
def test_deepstack_settings_the_graph_does_not_compute_are_refused(tmp_path, indexes, message):
    directory = config_with(tmp_path, deepstack_visual_indexes=indexes)
    if message is None:  # map k is block k's, through merger [2, 0, 1].index(k)
        cfg = load_vision_config(directory)
        assert (cfg.deepstack_layers, cfg.deepstack_mergers) == ((0, 1, 2), (1, 2, 0))
        return
    with pytest.raises(ExportError, match=message):
        load_vision_config(directory)


def test_more_maps_than_decoder_layers_are_refused(tmp_path):
    _, kwargs = PATCH_SEQUENCE_CONFIGS["qwen3_vl"]
    transformers.Qwen3VLConfig(**{**kwargs, "text_config": {**kwargs["text_config"], "num_hidden_layers": 1}}
                               ).save_pretrained(tmp_path)
    with pytest.raises(ExportError, match=r"give 2 deepstack maps, but its language model has 1 layers"):
        load_vision_config(tmp_path)


def test_a_deepstack_index_past_the_tower_is_refused_before_anything_is_written(tmp_path):
    checkpoint = make_tiny_vlm_checkpoint("qwen3_vl", tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0, 5]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"name block\(s\) \[5\] outside its tower of depth 3 .* fix config.json"):
        export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_missing_a_deepstack_merger_is_refused_before_anything_is_written(checkpoints, tmp_path):
    """transformers would load it with that merger's weights random (a warning); the export says what is missing."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(checkpoints("qwen3_vl"), checkpoint)
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "deepstack_merger_list.1." not in k},
              str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"names 2 deepstack maps .* each through its own merger, but the checkpoint "
                                          r"lacks model.visual.deepstack_merger_list.1.norm.weight.*is config.json from "
                                          r"this checkpoint\?"):
        export_model(ExportRequest(model=str(checkpoint), max_seq_len=MAX_SEQ_LEN), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_image_positions_are_transformers_get_rope_index(references):
    """Qwen3-VL's get_rope_index (its own, timestamps for video) places an image's tokens as the runtime's rope_index
    does: one image, two images of different sizes, text only."""
    from exporter.runtime.image_text import rope_index
    from exporter.validation.image_text import VALIDATION_GRIDS, image_prompt

    model = references("qwen3_vl")
    for images in (1, 2, 0):
        grids = [(t, 2 * h, 2 * w) for t, h, w in VALIDATION_GRIDS.get(images, [])]
        prompt = image_prompt(images, [t * h * w // 4 for t, h, w in grids], IMAGE_TOKEN, 256, seed=images)
        ids = torch.tensor([prompt])
        want, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            image_grid_thw=torch.tensor(grids) if grids else None)
        np.testing.assert_array_equal(rope_index(np.array(prompt), iter(grids), IMAGE_TOKEN, 2), want[:, 0].numpy())
