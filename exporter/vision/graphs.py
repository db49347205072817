"""The two graphs of an image-text export besides its decoder: the vision encoder (tower + projector)
and the embedding (token embedding with image features scattered into the image-token positions).
Their input and output names and metadata keys are exporter.contract's (exporter.vision's docstring
states the contract)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporter import __version__
from exporter.contract import (
    BATCH, IMAGE_FEATURES, IMAGE_SIZES, INPUT_IDS, INPUTS_EMBEDS, META_DEEPSTACK, META_IMAGE_SIZE, META_IMAGE_TOKEN_ID,
    META_PATCH_SIZE, META_SPATIAL_MERGE_SIZE, META_TOKENS_PER_IMAGE, NUM_CROPS, NUM_IMAGES, PIXEL_ATTENTION_MASK,
    PIXEL_VALUES, SEQ,
)
from exporter.errors import ExportError
from exporter.graph.components.graph import GraphBuilder
from exporter.graph.target import CURRENT
from exporter.packaging.checkpoint import Checkpoint
from exporter.vision.config import VisionConfig, read_vision_config
from exporter.vision.encoder import vision_tower
from exporter.vision.families import FAMILIES, VisionFamily

# Dynamic-resolution towers (qwen2_5_vl, qwen3_5): the processor's grid beside its flattened patches, and the
# symbolic dims of both. (To move into exporter.contract beside PIXEL_VALUES.)
from exporter.contract import IMAGE_GRID_THW  # noqa: E402  vision in: int64 [num_images, 3] (frames, patch rows, patch columns)
NUM_PATCHES, NUM_IMAGE_TOKENS = "num_patches", "num_image_tokens"

FLOAT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _input(name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))


def _output(value: ir.Value, name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    """Name a graph output and stamp its type and shape (op shape inference is not trusted)."""
    value.name, value.type, value.shape = name, ir.TensorType(dtype), ir.Shape(dims)
    return value


def _model(b: GraphBuilder, inputs, outputs, name: str, cfg: VisionConfig) -> ir.Model:
    graph = ir.Graph(inputs, outputs, nodes=b.tape.nodes, initializers=b.tape.initializers,
                     opset_imports={"": CURRENT.opset, "com.microsoft": 1}, name=name)
    model = ir.Model(graph, ir_version=CURRENT.ir_version, producer_name="exportfarm", producer_version=__version__)
    model.metadata_props.update({META_TOKENS_PER_IMAGE: str(cfg.tokens_per_image),
                                 META_IMAGE_TOKEN_ID: str(cfg.image_token_id), META_IMAGE_SIZE: str(cfg.image_size)})
    if cfg.deepstack_layers:  # what a runtime splits the wide rows by (contract.image_text_width)
        model.metadata_props[META_DEEPSTACK] = str(len(cfg.deepstack_layers))
    return model


def load_vision_config(checkpoint_dir: Path) -> VisionConfig:
    """The checkpoint's VisionConfig (tokens_per_image, image_token_id, image_size, ...), or an ExportError
    saying why the vision builder does not take it."""
    return read_vision_config(Path(checkpoint_dir), tuple(FAMILIES))


def _prepare(checkpoint_dir: Path, dtype: ir.DataType) -> tuple[VisionConfig, VisionFamily, Checkpoint]:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"the vision graphs compute in fp32, fp16 or bf16, not {dtype}")
    cfg = load_vision_config(checkpoint_dir)
    return cfg, FAMILIES[cfg.model_type], Checkpoint(Path(checkpoint_dir))


def check_vision_checkpoint(checkpoint_dir: Path) -> VisionConfig:
    """The checkpoint's VisionConfig, refusing (ExportError) before any build what the graphs could not read: a
    setting load_vision_config refuses, modules it cannot find, or a deepstack merger config.json names and the
    checkpoint does not hold (or holds more of than config.json names)."""
    return _prepare_checked(checkpoint_dir, ir.DataType.FLOAT)[0]


def _prepare_checked(checkpoint_dir: Path, dtype: ir.DataType) -> tuple[VisionConfig, VisionFamily, Checkpoint]:
    """``_prepare``, then check_vision_checkpoint's refusals on what it read (config and headers read once)."""
    from exporter.vision.qwen3_5 import deepstack_merger_prefix

    cfg, family, checkpoint = _prepare(checkpoint_dir, dtype)
    tower = family.module_names(checkpoint).tower
    if cfg.deepstack_layers or any(n.startswith(f"{tower}deepstack_merger_list.") for n in checkpoint.names()):
        mergers = len(cfg.deepstack_layers)
        want = [f"{deepstack_merger_prefix(tower, k)}{module}.{tensor}" for k in range(mergers)
                for module in ("norm", "linear_fc1", "linear_fc2") for tensor in ("weight", "bias")]
        missing = [name for name in want if name not in checkpoint]
        extra = sorted({n for n in checkpoint.names() if n.startswith(f"{tower}deepstack_merger_list.")} - set(want))
        if missing or extra:
            raise ExportError(
                f"{cfg.model_type}'s config.json names {mergers} deepstack maps (vision_config.deepstack_visual_indexes "
                f"{list(cfg.deepstack_layers)}), each through its own merger, but the checkpoint "
                + (f"lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing else
                   f"also holds {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
                + ": is config.json from this checkpoint? (a checkpoint saved by transformers' Qwen3VL classes holds "
                  "deepstack_merger_list.0 .. D-1, D the length of deepstack_visual_indexes)")
    return cfg, family, checkpoint


def build_vision_graph(checkpoint_dir: Path, dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    """``pixel_values`` [num_images, channels, image_size, image_size] fp32 -> ``image_features``
    [num_images * tokens_per_image, text hidden] in ``dtype``: what transformers' ``get_image_features``
    gives per image (the tower, then the family's projector), image after image. Weights stay lazy."""
    cfg, family, checkpoint = _prepare_checked(checkpoint_dir, dtype)
    names = family.module_names(checkpoint)
    b = GraphBuilder(checkpoint, dtype)
    if family.patch_sequence_tower is not None:
        return _patch_sequence_vision_graph(b, cfg, family, names.tower, names.projector)
    if family.padded_images_tower is not None:
        return _padded_images_vision_graph(b, cfg, family, names.tower, names.projector)
    pixels = _input(PIXEL_VALUES, ir.DataType.FLOAT, [NUM_IMAGES, cfg.num_channels, cfg.image_size, cfg.image_size])
    # Image processors give fp32; the tower computes in the model dtype, as transformers casts to it.
    x = pixels if dtype == ir.DataType.FLOAT else b.op("Cast", [pixels], {"to": dtype})
    states = vision_tower(b, x, cfg, names.tower, family.position_ids(cfg))
    features = family.projector(b, states, cfg, names.projector)
    # 2-D, the images' rows one after another: what onnxruntime-genai preallocates (and feeds the embedding
    # with no rows on a text-only prompt) and what transformers.js flattens any rank to, so one graph serves all.
    features = b.op("Reshape", [features, b.ints(-1, cfg.text_hidden_size)])
    out = _output(features, IMAGE_FEATURES, dtype, [NUM_IMAGE_TOKENS, cfg.text_hidden_size])
    return _model(b, [pixels], [out], f"{cfg.model_type}_vision", cfg)


def build_crops_vision_graph(checkpoint_dir: Path, dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    """idefics3 / smolvlm as transformers.js 4.3 feeds them: ``pixel_values`` fp32 [batch_size, num_crops, channels,
    image_size, image_size] and ``pixel_attention_mask`` bool [batch_size, num_crops, image_size, image_size] ->
    ``image_features`` [num_image_tokens, text hidden] in ``dtype``: transformers' get_image_features (the all-zero
    padding crops dropped, the patch attention mask from the pixel mask, the tower reading it, the connector), the
    real crops' tokens in order. The farm vision graph's tower and projector (build_vision_graph) on the same weights
    (same initializer names); it takes the real crops alone, whole."""
    from exporter.vision import crops

    cfg, family, checkpoint = _prepare_checked(checkpoint_dir, dtype)
    if cfg.model_type not in crops.CROPS_FAMILIES:
        raise ValueError(f"{cfg.model_type} takes no crops: build_vision_graph builds its vision graph")
    names = family.module_names(checkpoint)
    b = GraphBuilder(checkpoint, dtype)
    size = cfg.image_size
    pixels = _input(PIXEL_VALUES, ir.DataType.FLOAT, [BATCH, NUM_CROPS, cfg.num_channels, size, size])
    mask = _input(PIXEL_ATTENTION_MASK, ir.DataType.BOOL, [BATCH, NUM_CROPS, size, size])
    x, masks = crops.real_crops(b, pixels, mask, cfg)
    patches = crops.patch_mask(b, masks, cfg)
    states = vision_tower(b, x, cfg, names.tower, crops.position_ids(b, patches, cfg), crops.key_mask(b, patches, cfg))
    features = b.op("Reshape", [family.projector(b, states, cfg, names.projector), b.ints(-1, cfg.text_hidden_size)])
    out = _output(features, IMAGE_FEATURES, dtype, [NUM_IMAGE_TOKENS, cfg.text_hidden_size])
    return _model(b, [pixels, mask], [out], f"{cfg.model_type}_vision_crops", cfg)


def _patch_sequence_vision_graph(b: GraphBuilder, cfg: VisionConfig, family: VisionFamily, tower: str,
                                 merger: str) -> ir.Model:
    """qwen2_5_vl, qwen3_5, qwen3_vl: ``pixel_values`` fp32 [num_patches, patch_dim] + ``image_grid_thw`` int64
    [num_images, 3] -> ``image_features`` [num_image_tokens, cfg.feature_width], the images' merged tokens one after
    another (transformers' get_image_features, its per-image tuple concatenated; qwen3_vl: each row its pooler_output
    then its deepstack_features side by side)."""
    pixels = _input(PIXEL_VALUES, ir.DataType.FLOAT, [NUM_PATCHES, cfg.patch_dim])
    grid = _input(IMAGE_GRID_THW, ir.DataType.INT64, [NUM_IMAGES, 3])
    x = pixels if b.dtype == ir.DataType.FLOAT else b.op("Cast", [pixels], {"to": b.dtype})
    features = family.patch_sequence_tower(b, x, grid, cfg, tower, merger)
    out = _output(features, IMAGE_FEATURES, b.dtype, [NUM_IMAGE_TOKENS, cfg.feature_width])
    model = _model(b, [pixels, grid], [out], f"{cfg.model_type}_vision", cfg)
    # what a runtime places an image's tokens on M-RoPE's height / width streams by (exporter.runtime.image_text)
    model.metadata_props[META_SPATIAL_MERGE_SIZE] = str(cfg.spatial_merge_size)
    return model


# The padded images' symbolic dims (mistral3).
HEIGHT, WIDTH = "height", "width"


def _padded_images_vision_graph(b: GraphBuilder, cfg: VisionConfig, family: VisionFamily, tower: str,
                                projector: str) -> ir.Model:
    """mistral3: ``pixel_values`` fp32 [num_images, channels, height, width] (each image top-left, zero-padded to the
    batch's largest, as PixtralImageProcessor pads) + ``image_sizes`` int64 [num_images, 2] (each image's height and
    width in pixels) -> ``image_features`` [num_image_tokens, text hidden], each image's (height // (patch x merge)) x
    (width // (patch x merge)) tokens row-major, image after image (get_image_features' tuple concatenated).

    ``image_sizes`` is optional: an initializer of the same name, [[0, 0]], is its default (ONNX's overridable
    initializer, which onnxruntime leaves out of a session's inputs), under which each image is the whole of
    pixel_values. So onnxruntime-genai, which runs one image at a time at its own size, and transformers.js, which
    feeds one image, run this graph on pixel_values alone; the farm's runtime feeds both."""
    pixels = _input(PIXEL_VALUES, ir.DataType.FLOAT, [NUM_IMAGES, cfg.num_channels, HEIGHT, WIDTH])
    sizes = _input(IMAGE_SIZES, ir.DataType.INT64, [NUM_IMAGES, 2])
    sizes.const_value = ir.tensor(np.zeros((1, 2), np.int64), name=IMAGE_SIZES)
    x = pixels if b.dtype == ir.DataType.FLOAT else b.op("Cast", [pixels], {"to": b.dtype})
    features = family.padded_images_tower(b, x, sizes, cfg, tower, projector)
    out = _output(features, IMAGE_FEATURES, b.dtype, [NUM_IMAGE_TOKENS, cfg.text_hidden_size])
    model = _model(b, [pixels, sizes], [out], f"{cfg.model_type}_vision", cfg)
    model.graph.register_initializer(sizes)
    # what a runtime counts each image's tokens by (exporter.runtime.image_text.PaddedImagesModel)
    model.metadata_props.update({META_SPATIAL_MERGE_SIZE: str(cfg.spatial_merge_size),
                                 META_PATCH_SIZE: str(cfg.patch_size)})
    return model


def build_embedding_graph(checkpoint_dir: Path, dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    """``input_ids`` [batch, seq] int64 + ``image_features`` [num_image_tokens, text hidden] (the vision
    graph's rows; 0 rows: text only) -> ``inputs_embeds`` [batch, seq, text hidden], as transformers merges them: the token embedding
    (gemma3: times sqrt(hidden), rounded to ``dtype``), then the image features, in order, into the
    positions holding the image token (``masked_scatter``). An image token's own row is never read, so
    an image token id past the vocabulary (gemma3 allows it) is fine; ``num_images`` may be 0.

    qwen3_vl: both are cfg.feature_width wide (contract.image_text_width): an image token's row is its wide feature
    row ([merged | deepstack maps]), a text token's its embedding then zeros, so the decoder's add of each map slice
    after its first layers is transformers' add at the image positions alone."""
    cfg, family, checkpoint = _prepare(checkpoint_dir, dtype)
    names = family.module_names(checkpoint)
    b = GraphBuilder(checkpoint, dtype)
    hidden = cfg.feature_width
    ids = _input(INPUT_IDS, ir.DataType.INT64, [BATCH, SEQ])
    features = _input(IMAGE_FEATURES, dtype, [NUM_IMAGE_TOKENS, hidden])
    is_image = b.op("Equal", [ids, b.scalar_i64(cfg.image_token_id)])
    # The k-th image token (row-major over batch and sequence) takes feature row k: row k + 1 of the
    # features behind one zero row, which every other position indexes (and which keeps the Gather
    # valid when there are no images). An image token past the features (one the model generated in a
    # decode step, where there are none) is embedded as transformers embeds it without pixel_values.
    rows = b.op("Concat", [b.constant(np.zeros((1, hidden), dtype.numpy()), "vision_zero_row"),
                           b.op("Reshape", [features, b.ints(-1, hidden)])], {"axis": 0})
    flags = b.op("Cast", [b.op("Reshape", [is_image, b.ints(-1)])], {"to": ir.DataType.INT64})
    order = b.op("Mul", [b.op("CumSum", [flags, b.scalar_i64(0)]), flags])
    available = b.op("Sub", [b.op("Shape", [rows], {"start": 0, "end": 1}), b.scalar_i64(1)])
    has_feature = b.op("And", [b.op("Cast", [order], {"to": ir.DataType.BOOL}),
                               b.op("LessOrEqual", [order, available])])
    order = b.op("Where", [has_feature, order, b.scalar_i64(0)])
    has_feature = b.op("Reshape", [has_feature, b.op("Shape", [ids])])
    # gemma3 looks every image token up as id 0 (its id may lie past the table); the others their own row.
    text_ids = b.op("Where", [is_image if cfg.model_type == "gemma3" else has_feature, b.scalar_i64(0), ids])
    x = b.op("Gather", [b.weight(names.embed_tokens), text_ids], {"axis": 0})
    if cfg.embed_scale is not None:
        x = b.op("Mul", [x, b.scalar(cfg.embed_scale)])
    if hidden > cfg.text_hidden_size:  # qwen3_vl: a text token carries no deepstack map (zeros: nothing is added)
        # zeros expanded to [batch, seq, maps' width] beside it: onnxruntime-gpu 1.31.1 has no bf16 CUDA Pad (a bf16
        # export's session failed to initialize: "Provider type for Pad node ... is not set"); Expand and Concat have
        extra = hidden - cfg.text_hidden_size
        zeros = b.op("Expand", [b.constant(np.zeros((1, 1, extra), dtype.numpy()), "deepstack_text_zeros"),
                                b.op("Concat", [b.op("Shape", [ids]), b.ints(extra)], {"axis": 0})])
        x = b.op("Concat", [x, zeros], {"axis": -1})
    picked = b.op("Gather", [rows, b.op("Reshape", [order, b.op("Shape", [ids])])], {"axis": 0})
    merged = b.op("Where", [b.op("Unsqueeze", [has_feature, b.ints(-1)]), picked, x])
    out = _output(merged, INPUTS_EMBEDS, dtype, [BATCH, SEQ, hidden])
    return _model(b, [ids, features], [out], f"{cfg.model_type}_embedding", cfg)
