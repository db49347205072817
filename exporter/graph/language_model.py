"""The language model of an image-text checkpoint, as the decoder of an image-text export (issue 48).

An image-text checkpoint (gemma3, llava, idefics3, smolvlm, qwen2_5_vl, qwen3_vl, qwen3_5, mistral3: the families
exporter.vision builds) holds a text model the exporter already builds (gemma3_text, llama, mistral, ministral3, qwen2,
qwen3_5_text, ...) under a
prefix of its own (``language_model.model.``, ``model.language_model.``, ``model.text_model.``). Its config is the
checkpoint's text_config read as that text model's; its architecture is the text architecture with the
weight names moved under the prefix. What an image-text export cannot be yet is refused here, in one
preflight, before anything is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from exporter.errors import ExportError
from exporter.graph.architectures import qwen3_vl_moe
from exporter.graph.architectures.base import Architecture
from exporter.graph.config import LANGUAGE_MODEL_OF, ModelConfig, read_raw_config


# Language models that are a text architecture the exporter builds under a name of their own: qwen2_5_vl's is qwen2
# (q / k / v biases) with multimodal rotary (rope_parameters' mrope_section: position_ids [3, batch, seq]); qwen3_vl's
# qwen3 (q / k norms) with interleaved M-RoPE (rotary.MROPE_INTERLEAVED, by the text config's own model_type) and its
# deepstack adds (LanguageModel.deepstack); qwen3_vl_moe's qwen3_moe, its experts stored stacked
# (architectures/qwen3_vl_moe.py) and always renormalized (config._moe_config).
TEXT_ARCHITECTURE_OF = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """An image-text checkpoint's language model: what build_model builds the decoder from."""

    model_type: str  # the image-text checkpoint's (gemma3, llava, ...)
    config: ModelConfig  # text_config's; config.architecture is the text model_type
    architecture: Architecture  # the text architecture, its weights under the checkpoint's prefix
    # Qwen3-VL's deepstack maps, added after the decoder's layers 0 .. deepstack - 1 at the image positions; they reach
    # the decoder inside inputs_embeds (contract.image_text_width). 0: none (every other family).
    deepstack: int = 0


# Image-text checkpoints of LANGUAGE_MODEL_OF whose export is nonetheless the image-text one (vision, embedding, the
# hybrid decoder on inputs_embeds with M-RoPE positions [3, batch, seq]) in every layout: both consumers run Qwen3.5 as
# an image-text model, text prompts included. transformers.js's Qwen3.5 classes (Qwen3_5ForConditionalGeneration, and
# Qwen3_5ForCausalLM on such a checkpoint) run embed_tokens + decoder_model_merged with positions from its own
# get_rope_index (layout hf); onnxruntime-genai 0.18's qwen3_5 / qwen3_5_moe types are multimodal (its model_type.h
# IsVLM, IsQwenVLFamily: QwenImageProcessor, its own M-RoPE positions) and its MultiModalLanguageModel's decoder state
# carries a hybrid's recurrent states as its text decoder does (multi_modal.cpp DecoderState: CreateRecurrentState),
# so the farm layout's genai package is that type (tests/test_genai_vlm_qwen3_5.py), as genai's own builder makes a
# Qwen3.5 decoder on inputs_embeds unless told otherwise. Until then the farm layout exported the language model alone
# as genai's text type; genai runs the image-text package on a text prompt too (append_tokens included), with the
# same tokens. A bf16 export of them is the image-text package too, as every family's (image_text_type says where it
# was validated; the hf layout refuses bf16, as for a text export).
IMAGE_TEXT_HYBRIDS = ("qwen3_5", "qwen3_5_moe")


def image_text_type(checkpoint_dir: Path) -> str | None:
    """The model_type of an image-text checkpoint (config.json has a vision_config), None for a text one.
    gemma4's image-text checkpoints are not: the exporter takes their language model alone (LANGUAGE_MODEL_OF);
    Qwen3.5's are (IMAGE_TEXT_HYBRIDS), in every dtype: a tiny qwen3_5's bf16 image-text export, like qwen3_vl's and
    qwen3_vl_moe's, passes the farm's gates on an H100 (benchmarks/results/h100/vlm_cuda_issue48_stop57.json; six other
    families' in benchmarks/results/h100/vlm_cuda_issue48_stop56.json). The tiny qwen3_5_moe's fp16 one passes with two
    steps named router near ties (validation/routing.py); its bf16 one does not, told that bf16 is unsafe for it and to
    export fp16 (h100/vlm_cuda_issue48_stop58.json; README, "Image-text models"): validation quarantines such an export,
    as it would its language model alone."""
    raw = read_raw_config(Path(checkpoint_dir))
    model_type = raw.get("model_type")
    if not isinstance(raw.get("vision_config"), dict):
        return None
    if model_type not in LANGUAGE_MODEL_OF or model_type in IMAGE_TEXT_HYBRIDS:
        return model_type
    return None


# Qwen3-VL's "deepstack" (transformers' Qwen3VLTextModel._deepstack_process): feature maps from the vision layers in
# deepstack_visual_indexes, each through its own merger, ADDED to the hidden states at the image positions after the
# first decoder layers. Not droppable (benchmarks/qwen3_vl_deepstack.py, a tiny random Qwen3-VL, fp32: logits 42-49% of
# the range off on an image prompt without them): they ride in the wide inputs_embeds (contract.image_text_width).
DEEPSTACK_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def check_image_text_request(request, checkpoint_dir: Path) -> None:
    """Refuse (ExportError) what an image-text export cannot be yet: a family the vision builder does not
    take, a language model the exporter does not build, an hf layout transformers.js cannot run (bf16 is refused for it
    earlier, as for a text export: ExportRequest.resolved_variant), the compat target, a traced graph."""
    from exporter.vision import FAMILIES, check_vision_checkpoint

    model_type = image_text_type(checkpoint_dir)
    if model_type not in FAMILIES:
        raise ExportError(f"image-text checkpoints of model_type {model_type!r} are not exported yet: the vision and "
                          f"embedding graphs are built for {', '.join(FAMILIES)} (exporter.vision.FAMILIES); an "
                          "export needs all three graphs to run an image prompt")
    if request.layout == "hf":  # the families and checkpoints transformers.js cannot run (hf_image_text.py)
        from exporter.packaging.hf_image_text import check_image_text_checkpoint

        check_image_text_checkpoint(checkpoint_dir, model_type)
    if request.compat:
        raise ExportError("an image-text export is built for the current onnxruntime only (its vision graph uses "
                          "opset-24 Attention): drop compat")
    if request.builder == "traced":
        raise ExportError("transformers.exporters does not build the vision and embedding graphs of an image-text "
                          "checkpoint: drop builder traced (the hand-built graphs export it)")
    check_vision_checkpoint(checkpoint_dir)  # refuses a tower, a setting or missing weights the vision builder needs
    language_model(checkpoint_dir)  # refuses a language model the exporter does not build


def language_model(checkpoint_dir: Path) -> LanguageModel:
    """The language model of the image-text checkpoint at ``checkpoint_dir`` (ExportError where the exporter
    does not build it)."""
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import _transformers_config, check_config_values, text_model_config
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.vision import FAMILIES, load_vision_config

    checkpoint_dir = Path(checkpoint_dir)
    raw = read_raw_config(checkpoint_dir)
    model_type = raw.get("model_type")
    check_config_values(raw)
    text = _transformers_config(checkpoint_dir).get_text_config()
    text_type = TEXT_ARCHITECTURE_OF.get(text.model_type, text.model_type)
    if text_type not in ARCHITECTURES:
        raise ExportError(f"{model_type}'s language model is a {text.model_type!r}, which the exporter does not build "
                          f"(it builds {', '.join(sorted(ARCHITECTURES))})")
    config = text_model_config(text, text_type)
    if getattr(text, "tie_word_embeddings", None) is None:  # qwen2_5_vl_text: the checkpoint's top-level setting
        config = dataclasses.replace(config, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
    if config.per_layer_input:
        raise ExportError(f"{text.model_type} reads its token ids inside the decoder (per-layer inputs), which an "
                          "image-text decoder taking inputs_embeds does not have")
    checkpoint = Checkpoint(checkpoint_dir)
    embed = FAMILIES[model_type].module_names(checkpoint).embed_tokens
    prefix = embed.removesuffix("embed_tokens.weight")
    heads = [n for n in checkpoint.names() if n.endswith("lm_head.weight")]
    if not heads and not config.tie_word_embeddings and _transformers_config(checkpoint_dir).tie_word_embeddings:
        # transformers ties the ForConditionalGeneration model's head by the top-level setting (mistral3's text_config
        # says False where Mistral3Config's default True ties it), and save_pretrained then stores no head
        config = dataclasses.replace(config, tie_word_embeddings=True)
    if heads and config.tie_word_embeddings and _transformers_config(checkpoint_dir).tie_word_embeddings is False:
        # and by the same top-level setting it unties a head the checkpoint holds (qwen3_vl_moe's text_config defaults
        # to tied, Qwen3VLMoeConfig to untied): the stored head is the one transformers reads
        config = dataclasses.replace(config, tie_word_embeddings=False)
    if len(heads) > 1 or (not heads and not config.tie_word_embeddings):
        raise ExportError(f"the checkpoint holds {len(heads) or 'no'} LM head weights ({', '.join(heads) or 'none'}) "
                          "where its text_config describes one: is config.json from this checkpoint?")
    head = heads[0] if heads else "lm_head.weight"
    deepstack = len(load_vision_config(checkpoint_dir).deepstack_layers) if model_type in DEEPSTACK_TYPES else 0
    layout = ARCHITECTURES[text_type]
    if text.model_type == "qwen3_vl_moe_text" and config.moe is not None:  # its experts' layout, from their shapes
        sparse = config.moe.sparse_layers.index(True) if any(config.moe.sparse_layers) else 0
        stored = _under(qwen3_vl_moe.TEXT, prefix, head).moe_name(sparse, qwen3_vl_moe.EXPERTS[0])
        shape = tuple(checkpoint.shape(stored)) if stored in checkpoint else ()
        layout = qwen3_vl_moe.stored_layout(shape, config.moe.expert_intermediate)
    return LanguageModel(model_type, config, _under(layout, prefix, head), deepstack)


def _under(text: Architecture, prefix: str, head: str) -> Architecture:
    """``text`` with its layers, embedding and final norm under ``prefix`` and its LM head named ``head``."""

    class UnderPrefix(type(text)):
        @staticmethod
        def layer_prefix(i: int) -> str:
            return f"{prefix}layers.{i}"

    UnderPrefix.embed_tokens = f"{prefix}embed_tokens.weight"
    UnderPrefix.final_norm = f"{prefix}norm.weight"
    UnderPrefix.lm_head = head
    UnderPrefix.lm_head_bias = head.removesuffix("weight") + "bias"
    UnderPrefix.__name__ = UnderPrefix.__qualname__ = f"{type(text).__name__}Of{text.model_type}"
    return UnderPrefix(**{f.name: getattr(text, f.name) for f in dataclasses.fields(text)})
