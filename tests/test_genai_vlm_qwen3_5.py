"""Qwen3.5 and Qwen3.5-MoE image-text checkpoints: their farm export is the image-text one (vision.onnx, embedding.onnx
and the hybrid decoder on inputs_embeds: gated DeltaNet on GatedDeltaNet with past_conv.i / past_recurrent.i, gated
attention with its KV cache, experts on MoE, interleaved M-RoPE positions [3, batch, seq]), validated by the farm's
image-text gates, and a package of onnxruntime-genai 0.18's own qwen3_5 / qwen3_5_moe type, which genai runs as it runs
qwen2_5_vl and qwen3_vl: og.Model on the folder, its QwenImageProcessor on a PNG (the transforms written from the
checkpoint's Qwen2VLImageProcessor), a Generator fed with set_inputs, genai's own M-RoPE positions. Its multimodal
decoder state carries the recurrent states as its text decoder does (src/models/multi_modal.cpp DecoderState:
CreateRecurrentState, named by genai_config's past_conv_names / past_recurrent_names). Its greedy tokens and every
step's logits equal transformers' generate on the ids, patches and grid genai's processor made, which equal
transformers' own processor's; a text prompt gives them through the processor and through append_tokens alike.

Until this, the farm layout exported such a checkpoint's language model alone as genai's text type ("qwen3");
tests/test_hybrid.py and tests/test_genai.py keep that text export on qwen3_5_text / qwen3_5_moe_text."""

from __future__ import annotations

import functools
import gc
import json
import shutil

import onnx
import pytest

from exporter import contract
from exporter.graph.language_model import IMAGE_TEXT_HYBRIDS
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.tiny_checkpoint import HYBRID_ARCHITECTURES, TEXT_HYBRID_ARCHITECTURES
from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint
from tests.genai_greedy import genai_greedy, genai_multimodal_run
from tests.test_genai_vlm_qwen import (
    MAX_SEQ_LEN, NEW_TOKENS, TEXT_PROMPT, check_image_and_text_prompts, check_two_images_in_one_prompt, png,
)

og = pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name, variant) -> (the farm export of the tiny checkpoint, transformers' model, its image processor and
    tokenizer). qwen3_5 in gqa is exported with validation (the image-text gates: one image, two images, text only)."""
    root = tmp_path_factory.mktemp("genai-qwen3_5")

    @functools.cache
    def checkpoint(name: str):
        path = make_tiny_vlm_checkpoint(f"{name}_genai", root / f"{name}-ckpt", seed=2)
        reference = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
        processor = (transformers.AutoImageProcessor.from_pretrained(str(path)),
                     transformers.AutoTokenizer.from_pretrained(str(path)))
        return path, reference, processor

    @functools.cache
    def make(name: str, variant: str):
        path, reference, processor = checkpoint(name)
        request = ExportRequest(model=str(path), variant=variant, static_cache=variant == "attn_static",
                                max_seq_len=MAX_SEQ_LEN)
        validate = (name, variant) == ("qwen3_5", "gqa")
        return export_model(request, root / f"{name}-{variant}", validate=validate), reference, processor

    return make


@pytest.mark.parametrize("name, variant", [("qwen3_5", "gqa"), ("qwen3_5_moe", "attn_dynamic")])
def test_genai_generates_transformers_tokens_on_an_image_and_on_text(family, tmp_path, name, variant):
    """One image + text, then the text prompt through genai's processor (check_image_and_text_prompts) and through
    append_tokens (how a text package is driven)."""
    result, reference, hf_processor = family(name, variant)
    model = og.Model(str(result.out_dir))
    runs = check_image_and_text_prompts(model, reference, hf_processor, png(tmp_path, 48, 64, seed=3),
                                        f"{name} {variant}")
    ids, ref_tokens = runs["text only"]  # the text API a text package's users drive it with: the same tokens
    assert genai_greedy(model, ids[0].tolist(), NEW_TOKENS, through_eos=True) == ref_tokens


def test_two_images_of_different_sizes_in_one_prompt(family, tmp_path):
    """genai's processor pads each image's patches to the largest's (zero rows it drops, one vision run per image);
    transformers on the unpadded patches gives the same tokens."""
    result, reference, _ = family("qwen3_5", "gqa")
    check_two_images_in_one_prompt(og.Model(str(result.out_dir)), reference, tmp_path, "qwen3_5")


def test_the_farm_export_is_the_validated_image_text_package(family, tmp_path):
    """What the farm layout now writes for a Qwen3.5 checkpoint: three graphs, the decoder on inputs_embeds and M-RoPE
    positions with its recurrence on GatedDeltaNet (as the text export runs it), the image-text gates passed, and
    genai_config.json of type qwen3_5 naming the states. Without past_conv_names / past_recurrent_names genai feeds
    no state (the decoder stops: "Missing Input: past_conv.0"): those keys are what carries them."""
    result, _, _ = family("qwen3_5", "gqa")
    out, manifest = result.out_dir, result.manifest.data
    # (the text-export tests of the hybrids leave these checkpoints to this file)
    assert set(HYBRID_ARCHITECTURES) - set(TEXT_HYBRID_ARCHITECTURES) == set(IMAGE_TEXT_HYBRIDS)
    assert result.report.passed and manifest["status"] == "ready", result.report.summary()
    assert manifest["task"] == contract.IMAGE_TEXT_TASK and manifest["image_text"]["model_type"] == "qwen3_5"
    assert (out / contract.VISION_FILE).is_file() and (out / contract.EMBEDDING_FILE).is_file()
    graph = onnx.load(str(out / contract.MODEL_FILE), load_external_data=False).graph
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert contract.INPUT_IDS not in inputs and inputs[contract.POSITION_IDS] == [3, "batch_size", "sequence_length"]
    assert {"past_conv.0", "past_recurrent.0", "past_key_values.1.key"} <= set(inputs)
    ops = {n.op_type for n in graph.node}
    assert {"GatedDeltaNet", "CausalConvWithState"} <= ops and "LinearAttention" not in ops
    genai = manifest["genai"]
    assert genai["package"] is True and genai["reason"] is None and genai["model_type"] == "qwen3_5"
    config = json.loads((out / contract.GENAI_CONFIG_FILE).read_text())
    model = config["model"]
    assert model["type"] == "qwen3_5" and model["decoder"]["hidden_size"] == 64
    assert (model["image_token_id"], model["vision_start_token_id"], model["video_token_id"]) == (302, 300, 303)
    decoder = model["decoder"]
    assert (decoder["inputs"]["past_conv_names"], decoder["inputs"]["past_recurrent_names"]) == (
        "past_conv.%d", "past_recurrent.%d")
    assert (decoder["outputs"]["present_conv_names"], decoder["outputs"]["present_recurrent_names"]) == (
        "present_conv.%d", "present_recurrent.%d")
    vision = model["vision"]
    assert vision["inputs"] == {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"}
    assert (vision["spatial_merge_size"], vision["patch_size"]) == (2, 4) and "window_size" not in vision
    transforms = json.loads((out / contract.GENAI_IMAGE_PROCESSOR_FILE).read_text())["processor"]
    ops = {t["operation"]["type"]: t["operation"].get("attrs") for t in transforms["transforms"]}
    assert ops["Normalize"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert ops["PatchImage"] == {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}

    stateless = tmp_path / "stateless"
    shutil.copytree(out, stateless)
    for side, keys in (("inputs", ("past_conv_names", "past_recurrent_names")),
                       ("outputs", ("present_conv_names", "present_recurrent_names"))):
        for key in keys:
            del decoder[side][key]
    (stateless / contract.GENAI_CONFIG_FILE).write_text(json.dumps(config))
    og_model = og.Model(str(stateless))
    with pytest.raises(Exception) as refused:
        genai_multimodal_run(og_model, og_model.create_multimodal_processor()(TEXT_PROMPT), 1)
    message = str(refused.value)
    del refused, og_model  # a live og.Model's threads slow the torch work of the tests after this one
    gc.collect()
    assert "Missing Input: past_conv.0" in message


def test_what_the_image_text_export_cannot_be_is_said(family):
    """attn_static: exported, no genai package, the reason in the manifest (genai feeds no write_indices). (A bf16
    export is the image-text package as the fp32 one is: tests/test_vlm_bf16.py.)"""
    result, _, _ = family("qwen3_5", "attn_static")
    assert result.manifest.data["genai"]["package"] is False
    assert "attn_static reads write_indices" in result.manifest.data["genai"]["reason"]
