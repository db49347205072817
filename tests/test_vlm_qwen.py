"""Qwen2.5-VL image-text exports end to end (issue 48): one export_model request on the tiny qwen2_5_vl checkpoint
gives vision.onnx (patches + image_grid_thw -> 2-D features), embedding.onnx and model.onnx, a qwen2 decoder with
multimodal rotary (M-RoPE) taking inputs_embeds and position_ids [3, batch, seq] in every variant. The runtime places
each token on the temporal / height / width streams as transformers' get_rope_index does (and offsets decode steps
by its rope_deltas); the pipeline's validation runs the three graphs against transformers' generate on one image,
two images of different sizes and text only. What cannot be exported is refused by name."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest

from exporter import contract
from exporter.errors import ExportError
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.vision.tiny_checkpoint import IMAGE_TOKEN, make_tiny_vlm_checkpoint
from tests.conftest import VARIANTS
from tests.test_vlm import report_of, summary

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_SEQ_LEN = 96  # validation's two-image prompt: 24 + 6 image tokens, 12 text tokens, 24 decode steps
FP32_TOLERANCE = 1e-4  # of the logit range (prefill) and of the features' range (vision, embedding)
TEXT_SECTION = [2, 3, 3]  # the tiny text model's mrope_section (head_dim 16: 8 rotary pairs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_vlm_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl") / "ckpt")


@pytest.fixture(scope="module")
def qwen_export(tmp_path_factory, checkpoint):
    """qwen_export(variant, dtype="fp32", validate=True) -> ExportResult, exported once per arguments."""
    root = tmp_path_factory.mktemp("qwen-exports")

    @functools.cache
    def make(variant: str, dtype: str = "fp32", validate: bool = True):
        request = ExportRequest(model=str(checkpoint), dtype=dtype, ep="cpu", variant=variant,
                                static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN)
        return export_model(request, root / f"{variant}-{dtype}{'' if validate else '-unvalidated'}", validate=validate)

    return make


@pytest.fixture(scope="module")
def reference(checkpoint):
    from exporter.validation.image_text import load_image_text_reference

    return load_image_text_reference(checkpoint)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_export_generates_transformers_tokens(qwen_export, variant):
    """The pipeline's own validation: every gate passes, image features and merged embeddings within 1e-4 of their
    range, the three graphs' greedy tokens (free-running) equal transformers' generate on every prompt."""
    result = qwen_export(variant)
    report = report_of(result)
    print(f"qwen2_5_vl {variant} fp32: {summary(report)}")
    assert report["status"] == "passed" and result.manifest.data["status"] == "ready"
    sections = report["components"]
    assert [s["prompt"] for s in sections["end_to_end"]] == ["one image", "two images", "text only"]
    # one 8 x 8-patch image (16 tokens); two of 8 x 12 and 6 x 4 patches (24 + 6 tokens), each with its own grid
    assert [s["image_tokens"] for s in sections["embedding"]] == [16, 30, 0]
    assert [s["shape"] for s in sections["vision"]] == [[16, 64], [30, 64]]
    for section in sections["vision"] + sections["embedding"]:
        assert section["max_abs_error_of_range"] <= FP32_TOLERANCE
    for run in sections["end_to_end"]:
        assert run["prefill_max_abs_error"] <= FP32_TOLERANCE * run["logit_range"]
        assert run["greedy_equal"] and len(run["greedy_tokens"]) == 24


def test_fp16_export_passes_except_near_ties(qwen_export):
    report = report_of(qwen_export("attn_dynamic", "fp16"))
    print(f"qwen2_5_vl attn_dynamic fp16: {summary(report)}")
    assert report["status"] == "passed", report["failed_gates"]
    for run in report["components"]["end_to_end"]:
        assert not run["mismatches"]  # a differing token only at a near tie


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_takes_three_position_streams(qwen_export, variant):
    """The decoder's step inputs are contract.image_text_step_inputs(variant, mrope=True): position_ids [3, batch, seq]
    in every variant (gqa's after the mask); the rotary tables are gathered once per stream and every layer rotates
    q and k with the opset-23 RotaryEmbedding per token; gqa's GroupQueryAttention rotates nothing itself."""
    result = qwen_export(variant)
    decoder = onnx.load(str(result.out_dir / contract.MODEL_FILE), load_external_data=False)
    graph = decoder.graph
    inputs = {i.name: i for i in graph.input}
    steps = [i.name for i in graph.input if not i.name.startswith(("past_key_values.", "key_cache.", "value_cache."))
             and i.name not in (contract.WRITE_INDICES, contract.NONPAD_KV_SEQLEN)]
    assert steps == list(contract.image_text_step_inputs(variant, mrope=True))
    dims = [d.dim_param or d.dim_value for d in inputs[contract.POSITION_IDS].type.tensor_type.shape.dim]
    assert dims == contract.position_ids_dims(mrope=True) == [3, contract.BATCH, contract.SEQ]
    ops = [n.op_type for n in graph.node]
    assert "MRotaryEmbedding" not in ops and ops.count("RotaryEmbedding") == 2  # q and k of its one layer
    assert ops.count("Gather") >= 2  # cos and sin rows of the three streams, once
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            assert {a.name: a.i for a in node.attribute}.get("do_rotary", 0) == 0
    meta = {p.key: p.value for p in decoder.metadata_props}
    assert json.loads(meta[contract.META_CONFIG])["mrope_section"] == TEXT_SECTION
    vision = onnx.load(str(result.out_dir / contract.VISION_FILE), load_external_data=False)
    assert [i.name for i in vision.graph.input] == [contract.PIXEL_VALUES, contract.IMAGE_GRID_THW]
    assert {p.key: p.value for p in vision.metadata_props}[contract.META_SPATIAL_MERGE_SIZE] == "2"


def test_positions_are_transformers_get_rope_index(reference):
    """rope_index (numpy) on prompts of one image, two images of different sizes and text only equals transformers'
    get_rope_index, positions and rope_deltas alike."""
    from exporter.runtime.image_text import rope_index
    from exporter.validation.image_text import VALIDATION_GRIDS, image_prompt

    for images in (1, 2, 0):
        grids = [(t, 2 * h, 2 * w) for t, h, w in VALIDATION_GRIDS.get(images, [])]
        tokens = [t * h * w // 4 for t, h, w in grids]
        prompt = image_prompt(images, tokens, IMAGE_TOKEN, 256, seed=images)
        ids = torch.tensor([prompt])
        want, delta = reference.model.get_rope_index(
            ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            image_grid_thw=torch.tensor(grids) if grids else torch.zeros((0, 3), dtype=torch.long))
        ours = rope_index(np.array(prompt), iter(grids), IMAGE_TOKEN, 2)
        np.testing.assert_array_equal(ours, want[:, 0].numpy())
        assert int(ours.max()) + 1 - len(prompt) == int(delta[0, 0])
        assert images == 0 or int(delta[0, 0]) < 0  # an image's tokens take fewer positions than tokens


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_batch_of_image_prompts(qwen_export, reference, variant):
    """Two prompts of different lengths, each with its own image (grids 8 x 12 and 6 x 4 patches), prefilled as one
    batch (attn_dynamic left-padded, gqa right-padded, attn_static row by row) and decoded together, teacher-forced:
    every row's logits equal transformers' generate on the left-padded batch, each row's positions from its own
    image and its own rope_deltas."""
    from exporter.runtime.image_text import open_image_text
    from exporter.validation.image_text import image_prompt, validation_patches

    runtime = open_image_text(qwen_export(variant).out_dir, prepack=False, spin=False)
    pixels, grid = validation_patches(2, 2, runtime.vision.get_inputs()[0].shape[1], seed=7)
    prompts = [image_prompt(1, [24], IMAGE_TOKEN, 256, text_tokens=9, seed=3),
               image_prompt(1, [6], IMAGE_TOKEN, 256, text_tokens=5, seed=4)]
    longest = max(map(len, prompts))
    padded = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = reference.generate(input_ids=padded, attention_mask=mask, pixel_values=torch.from_numpy(pixels),
                                 image_grid_thw=torch.from_numpy(grid), mm_token_type_ids=(padded == IMAGE_TOKEN).int(),
                                 max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
    want = [step.numpy() for step in out.logits]
    tokens = out.sequences[:, longest:].numpy()
    runtime.clear()
    runtime.encode(pixels, grid)
    state = runtime.decoder.new_state(2)
    got = [runtime.decoder.prefill(prompts, state)]
    for i in range(3):
        got.append(runtime.decoder.step(tokens[:, i], state))
    worst = max(float(np.abs(g - w).max() / np.ptp(w)) for g, w in zip(got, want))
    print(f"qwen2_5_vl {variant} ragged batch of two image prompts: max |err| / range {worst:.2e}")
    assert worst <= FP32_TOLERANCE


def test_one_dimensional_positions_would_not_match(qwen_export, reference, monkeypatch):
    """The end-to-end check can tell M-RoPE from a 1-D rope: the same export fed every stream the token's 1-D
    position (what a text runtime feeds) is far off transformers on an image prompt, and exact on text only."""
    import exporter.runtime.image_text as image_text
    from exporter.validation.image_text import image_text_gates

    text_positions = lambda ids, grids, token, merge, start=0: np.broadcast_to(  # noqa: E731
        np.arange(start, start + len(ids)), (3, len(ids)))
    monkeypatch.setattr(image_text, "rope_index", text_positions)
    result = qwen_export("attn_dynamic")
    _, sections = image_text_gates(result.out_dir, None, "cpu", "fp32", "fp32", 4, model=reference)
    errors = {s["prompt"]: s["prefill_max_abs_error"] / s["logit_range"] for s in sections["end_to_end"]}
    print(f"qwen2_5_vl with 1-D positions: prefill error / range {errors}")
    assert errors["one image"] > 100 * FP32_TOLERANCE and errors["two images"] > 100 * FP32_TOLERANCE
    assert errors["text only"] <= FP32_TOLERANCE


@pytest.mark.parametrize("change, variant, message", [
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), "attn_static",
     r"sliding layers under attn_static find their window from position_ids as cache slots, which M-RoPE's "
     r"positions are not: use the attn_dynamic or gqa variant"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}), "attn_dynamic",
     r"mrope_section \[2, 2, 2\] is exported as three sections filling half the rotary dims \(8\)"),
], ids=["static-sliding-window", "mrope-section-short"])
def test_what_cannot_be_built_is_refused_by_name(tmp_path, change, variant, message):
    from exporter.vision.tiny_checkpoint import PATCH_SEQUENCE_CONFIGS

    _, kwargs = PATCH_SEQUENCE_CONFIGS["qwen2_5_vl"]
    checkpoint = make_tiny_vlm_checkpoint("qwen2_5_vl", tmp_path / "ckpt",
                                          text_config={**kwargs["text_config"], **change})
    request = ExportRequest(model=str(checkpoint), variant=variant, static_cache=variant == "attn_static",
                            max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ExportError, match=message):
        export_model(request, tmp_path / "out", validate=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
