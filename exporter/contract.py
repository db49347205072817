"""The graph contract in one place: what an export's model.onnx takes and gives, and what its folder holds.

docs/graph-contracts.md explains it; everything that builds, drives, checks, packages or compares
an export (task, runtime, bench, genai, gates, diff, workers, services) takes names, dims, cache
shapes, metadata keys, the static-cache counts, file names and the dtype table from here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from exporter.request import Variant

# --- graph inputs and outputs ---------------------------------------------------------------------

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
WRITE_INDICES = "write_indices"  # attn_static: tokens already cached, per row
NONPAD_KV_SEQLEN = "nonpad_kv_seqlen"  # attn_static: tokens cached after this step's scatter, per row
LOGITS = "logits"
# An image-text export's decoder takes the merged embeddings where a text export takes input_ids:
# [batch, seq, hidden] in the activation dtype, already scaled (gemma3's sqrt(hidden) is the
# embedding graph's, never applied again), everything else as the variant's text contract.
INPUTS_EMBEDS = "inputs_embeds"

# Symbolic dimensions.
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
MAX_SEQ_LEN_DIM = "max_seq_len"


def cache_names(variant: Variant, layer: int) -> tuple[str, str, str, str]:
    """(key in, value in, key out, value out) of one layer's cache."""
    if Variant(variant) is Variant.ATTN_STATIC:
        return f"key_cache.{layer}", f"value_cache.{layer}", f"updated_key_cache.{layer}", f"updated_value_cache.{layer}"
    return (f"past_key_values.{layer}.key", f"past_key_values.{layer}.value", f"present.{layer}.key",
            f"present.{layer}.value")


def cache_pairs(variant: Variant, num_layers: int) -> list[tuple[str, str]]:
    """(cache input, the output it becomes) for every layer, keys then values."""
    pairs = []
    for layer in range(num_layers):
        k_in, v_in, k_out, v_out = cache_names(variant, layer)
        pairs += [(k_in, k_out), (v_in, v_out)]
    return pairs


def cache_kind(name: str) -> str:
    """"key" or "value": which of a layer's two caches the cache input or output ``name`` is (any variant's)."""
    if name.startswith(("past_key_values.", "present.")):
        return name.rsplit(".", 1)[1]
    return "value" if name.startswith(("value_cache.", "updated_value_cache.")) else "key"


def input_for_output(name: str) -> str | None:
    """The cache input an output updates (present.0.key -> past_key_values.0.key), else None."""
    if name.startswith(tuple(f"present_{kind}." for kind in STATE_KINDS)):
        return "past_" + name.removeprefix("present_")
    if name.startswith("present."):
        _, layer, kind = name.split(".")
        return f"past_key_values.{layer}.{kind}"
    if name.startswith("updated_"):
        return name.removeprefix("updated_")
    return None


# --- recurrent state (hybrids: docs/graph-contracts.md "Recurrent state") ---------------------------
# A recurrent layer carries fixed-size states instead of a KV cache, past_* in and present_* out by the
# same name after the prefix, zeros at the start of a sequence, in every variant alike.
CONV_STATE, RECURRENT_STATE = "conv", "recurrent"  # the convolution's last inputs; the recurrence's matrix
SSM_STATE = "ssm"  # Mamba2's state matrix (transformers.js's name for it)
STATE_KINDS = (CONV_STATE, RECURRENT_STATE, SSM_STATE)


def state_names(layer: int, kind: str) -> tuple[str, str]:
    """(input, output) of one recurrent layer's state of ``kind``."""
    return f"past_{kind}.{layer}", f"present_{kind}.{layer}"


def is_state_input(name: str) -> bool:
    return name.startswith(tuple(f"past_{kind}." for kind in STATE_KINDS))


def state_dims(kind: str, *, taps: int = 0, channels: int = 0, heads: int = 0, key_dim: int = 0,
               value_dim: int = 0, key_major: bool = False) -> list:
    """A state's declared dims: conv [batch, taps - 1, channels] (channels last, as the layer's
    input runs), recurrent [batch, value_heads, value_dim, key_dim] (GatedDeltaNet's layout, fp32;
    ``key_major``: [batch, value_heads, key_dim, value_dim], LinearAttention's, in the hf layout)."""
    if kind == CONV_STATE:
        return [BATCH, taps - 1, channels]
    return [BATCH, heads, key_dim, value_dim] if key_major else [BATCH, heads, value_dim, key_dim]


def step_inputs(variant: Variant) -> tuple[str, ...]:
    """The non-cache inputs of a variant, in graph order."""
    variant = Variant(variant)
    if variant is Variant.GQA:
        return INPUT_IDS, ATTENTION_MASK
    if variant is Variant.ATTN_DYNAMIC:
        return INPUT_IDS, ATTENTION_MASK, POSITION_IDS
    return INPUT_IDS, POSITION_IDS


# --- cache layouts --------------------------------------------------------------------------------


def cache_dims(variant: Variant, num_kv_heads: int, head_dim: int, *, output: bool = False) -> list:
    """Declared dims of a cache input (or output): attn_static [batch, max_seq_len, kv_heads*head_dim]
    (BSNH, what the kernels read natively), the others [batch, kv_heads, past|total, head_dim]. A value
    cache of its own head size (``VALUE_HEAD_DIM``) is declared with that one."""
    if Variant(variant) is Variant.ATTN_STATIC:
        return [BATCH, MAX_SEQ_LEN_DIM, num_kv_heads * head_dim]
    return [BATCH, num_kv_heads, TOTAL if output else PAST, head_dim]


def cache_shape(variant: Variant, batch: int, positions: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """A concrete cache buffer: ``positions`` slots (the static buffer, or the past length)."""
    if Variant(variant) is Variant.ATTN_STATIC:
        return batch, positions, num_kv_heads * head_dim
    return batch, num_kv_heads, positions, head_dim


def static_cache_counts(cached: np.ndarray | list[int], new_tokens: int) -> dict[str, np.ndarray]:
    """attn_static per-row counters: write_indices = tokens already cached (where this step writes),
    nonpad_kv_seqlen = the count *after* this step's scatter. Counting before the scatter is the
    classic bug: the logits come out silently wrong."""
    cached = np.asarray(cached, dtype=np.int64)
    return {WRITE_INDICES: cached, NONPAD_KV_SEQLEN: cached + new_tokens}


# --- image-text exports: the vision and embedding graphs beside the decoder (exporter.vision) ------
PIXEL_VALUES = "pixel_values"  # vision in: float32 [num_images, channels, image_size, image_size]
IMAGE_FEATURES = "image_features"  # vision out, embedding in: [num_image_tokens, text hidden], image after image
NUM_IMAGES = "num_images"  # the symbolic dim of pixel_values (and image_grid_thw)
IMAGE_TEXT_TASK = "image-text-to-text"  # the manifest's "task" of such an export
VISION, EMBEDDING, DECODER = "vision", "embedding", "decoder"  # the manifest's component names


def image_text_step_inputs(variant: Variant, mrope: bool = False) -> tuple[str, ...]:
    """``step_inputs`` of an image-text decoder: ``inputs_embeds`` in place of ``input_ids``; ``mrope``: a decoder
    with multimodal rotary takes ``position_ids`` [3, batch, seq] in every variant (gqa's last, after the mask)."""
    names = tuple(INPUTS_EMBEDS if name == INPUT_IDS else name for name in step_inputs(variant))
    return names + (POSITION_IDS,) if mrope and POSITION_IDS not in names else names


# M-RoPE (qwen2_5_vl's language model, docs/graph-contracts.md "M-RoPE"): position_ids hold three position streams per
# token, temporal / height / width (transformers' get_rope_index), where every other decoder takes one.
MROPE_STREAMS = 3


def position_ids_dims(mrope: bool = False) -> list:
    """Declared dims of ``position_ids``: [batch, seq], or [3, batch, seq] for a multimodal rotary (M-RoPE)."""
    return [MROPE_STREAMS, BATCH, SEQ] if mrope else [BATCH, SEQ]


# --- model metadata -------------------------------------------------------------------------------

META_PREFIX = "exportfarm."
META_VARIANT, META_DTYPE, META_EP, META_CONFIG = (f"{META_PREFIX}{k}" for k in ("variant", "dtype", "ep", "config"))
# "compat" on an export for older onnxruntime (exporter/graph/target.py); absent on the current target.
META_TARGET = f"{META_PREFIX}target"
# Who built the graph: absent (or BUILDER_HAND) on exportfarm's own graphs, BUILDER_TRACED on one traced by
# transformers' own exporter and mapped onto the attn_dynamic contract (exporter/graph/traced.py). The
# manifest's "builder" names it with its version.
META_BUILDER = f"{META_PREFIX}builder"
BUILDER_HAND, BUILDER_TRACED = "exportfarm", "transformers.exporters"
# The vision and embedding graphs carry these, so a runtime can check a prompt's image tokens against the features.
META_TOKENS_PER_IMAGE = f"{META_PREFIX}vision.tokens_per_image"
META_IMAGE_TOKEN_ID = f"{META_PREFIX}vision.image_token_id"
META_IMAGE_SIZE = f"{META_PREFIX}vision.image_size"
# qwen2_5_vl's vision graph: patches merged per side into one token, which a runtime needs to place an image's
# tokens on M-RoPE's height / width streams (image_grid_thw's rows and columns / this).
META_SPATIAL_MERGE_SIZE = f"{META_PREFIX}vision.spatial_merge_size"
IMAGE_GRID_THW = "image_grid_thw"  # qwen2_5_vl's vision in: int64 [num_images, 3] (frames, patch rows, patch columns)
# mistral3's (Pixtral's) vision in beside pixel_values padded to the batch's largest image: int64 [num_images, 2], each
# image's (height, width) in pixels. Optional (an overridable initializer whose default [[0, 0]] reads each image as the
# whole of pixel_values, what onnxruntime-genai's per-image runs and transformers.js's one image feed).
IMAGE_SIZES = "image_sizes"
# idefics3 / smolvlm in the hf layout (transformers.js's Idefics3 classes feed them, exporter.vision.crops):
# pixel_values float32 [batch_size, num_crops, channels, image_size, image_size], each prompt's images split into crops
# and the prompts' crops zero-padded to the batch's most, and this bool [batch_size, num_crops, image_size, image_size]
# (True: a real pixel). The farm layout's vision graph takes the real crops alone, 4-D.
PIXEL_ATTENTION_MASK = "pixel_attention_mask"
NUM_CROPS = "num_crops"
# mistral3's vision graph: pixels per patch side, which with spatial_merge_size gives an image's token grid
# (height // (patch_size * spatial_merge_size) rows of width // (patch_size * spatial_merge_size) tokens).
META_PATCH_SIZE = f"{META_PREFIX}vision.patch_size"
# qwen3_vl's vision and embedding graphs: how many "deepstack" maps ride beside each image token's merged features
# (docs/graph-contracts.md "qwen3_vl"). Neither consumer's decoder has an input for them (onnxruntime-genai 0.18
# feeds the decoder inputs_embeds alone, transformers.js 4.3.2 likewise), so they travel in the embeddings themselves:
# image_features and inputs_embeds are image_text_width(hidden, maps) wide, [merged | map 0 | ... | map D-1], a text
# token's row [its embedding | zeros], and the decoder adds slice k + 1 after its layer k.
META_DEEPSTACK = f"{META_PREFIX}vision.deepstack"


def image_text_width(hidden: int, deepstack: int = 0) -> int:
    """The last dim of image_features and inputs_embeds: the text hidden size, times 1 + the number of deepstack
    maps each image token carries (qwen3_vl; 0 for every other family)."""
    return hidden * (1 + deepstack)


# Keys of the JSON under META_CONFIG.
CONFIG_KEYS = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_seq_len",
               "context_length")
# The value caches' head size where it is not the keys' ``head_dim`` (transformers' latent-attention cache, traced:
# keys kv_lora_rank wide, values qk_rope_head_dim wide); absent, values are ``head_dim`` wide as keys (every
# hand-built export). Not the model config's ``v_head_dim``, which is not what such a cache holds.
VALUE_HEAD_DIM = "value_head_dim"
# The manifest's entry for an export whose caches are of two head sizes: {num_kv_heads, head_dim, value_head_dim}.
MANIFEST_CACHE = "cache"


def head_dim_entries(head_dim: int, value_head_dim: int | None = None) -> dict:
    """The head sizes as META_CONFIG's JSON carries them: ``head_dim``, and ``VALUE_HEAD_DIM`` only where the
    values' differs (so an export whose caches are alike is described as it always was)."""
    entries = {"head_dim": int(head_dim)}
    if value_head_dim is not None and int(value_head_dim) != int(head_dim):
        entries[VALUE_HEAD_DIM] = int(value_head_dim)
    return entries


def value_head_dim(config: dict) -> int:
    """The value caches' head size of an export, from its META_CONFIG JSON (or its manifest's ``MANIFEST_CACHE``)."""
    return int(config.get(VALUE_HEAD_DIM) or config["head_dim"])


def split_cache(config: dict) -> bool:
    """Whether an export's value caches are of another head size than its keys (META_CONFIG's JSON or the
    manifest's ``MANIFEST_CACHE``): consumers that size both from one head size cannot run it."""
    return bool(config) and VALUE_HEAD_DIM in config and value_head_dim(config) != int(config["head_dim"])


# --- how a batch's rows of different lengths are fed (the manifest's "padding") -------------------

PADDING = {
    "attn_dynamic": {"batch": "left or right padding", "why": "attention_mask and position_ids are inputs; "
                     "Attention masks every row's padding (transformers.js and optimum left-pad)"},
    "gqa": {"batch": "right padding only", "why": "GroupQueryAttention takes each row's length from "
            "attention_mask's sum and assumes its tokens come first (onnxruntime-genai pads this way); a "
            "left-padded row comes out wrong; one row is unaffected"},
    "attn_static": {"batch": "no padding: each row's write_indices / nonpad_kv_seqlen", "why": "rows advance "
                    "independently in the fixed caches"},
}


# --- files of an export folder --------------------------------------------------------------------

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MANIFEST_FILE = "manifest.json"
REPORT_JSON = "parity_report.json"
REPORT_MD = "parity_report.md"
BENCH_FILE = "benchmark.json"
BENCH_PLOT = "benchmark.png"
BENCH_MD = "benchmark.md"
DIFF_JSON = "diff.json"
DIFF_MD = "diff.md"
GENAI_CONFIG_FILE = "genai_config.json"
MODEL_FILES = (MODEL_FILE, DATA_FILE)
# An image-text export's other two graphs, each with its own weights file (<file>.data) beside model.onnx.
VISION_FILE = "vision.onnx"
# onnxruntime-genai's image processor of an image-text export (onnxruntime-extensions' transforms; genai_config's
# vision.config_filename), apart from the processor_config.json transformers and transformers.js read.
GENAI_IMAGE_PROCESSOR_FILE = "ort_image_processor.json"
EMBEDDING_FILE = "embedding.onnx"


def data_file(model_file: str) -> str:
    """The external-weights file of a graph file (model.onnx -> model.onnx.data)."""
    return f"{model_file}.data"


# --- dtypes ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DType:
    """One element type as every layer names it."""

    name: str  # the request's: fp32 | fp16 | bf16 (or an index type)
    onnx: int  # onnx.TensorProto's enum value (onnx_ir's DataType has the same values)
    ort: str  # onnxruntime's type string, e.g. "tensor(float16)"
    numpy: type  # numpy dtype; bfloat16 is ml_dtypes'

    @property
    def ir(self):
        import onnx_ir

        return onnx_ir.DataType(self.onnx)


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


# The TensorProto values are spelled out so that importing the contract stays cheap (no onnx).
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("fp32", 1, "tensor(float)", np.float32),
    DType("fp16", 10, "tensor(float16)", np.float16),
    DType("bf16", 16, "tensor(bfloat16)", _bfloat16()),
    DType("int64", 7, "tensor(int64)", np.int64),
    DType("int32", 6, "tensor(int32)", np.int32),
)}
BY_ORT = {d.ort: d for d in DTYPES.values()}
BY_ONNX = {d.onnx: d for d in DTYPES.values()}
REDUCED_PRECISION = ("fp16", "bf16")


def numpy_of_ort(type_string: str) -> type:
    """numpy dtype of an ORT input/output type string, bfloat16 included."""
    try:
        return BY_ORT[type_string].numpy
    except KeyError:
        raise ValueError(f"no numpy dtype for onnxruntime type {type_string}") from None
