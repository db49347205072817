"""What the vision and embedding graphs are sized by, read from an image-text checkpoint's config.json.

transformers' config classes supply the defaults hub configs leave out (a llava-hf config.json names
few of its CLIP tower's values), so the config is read through AutoConfig; everything the builder
cannot express is refused here, by name, before any graph is built.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from exporter.contract import image_text_width
from exporter.errors import ExportError
from exporter.graph.config import _transformers_config, read_raw_config

# The vision towers the builder knows: a ViT with a class token and a pre-norm (CLIP) or without (SigLIP).
CLIP, SIGLIP = "clip", "siglip"
# Dynamic-resolution towers: flattened patches of any grid in, 2-D rotary; window attention (Qwen2.5-VL), or full
# attention per frame after a learned position table resampled to each grid (Qwen3.5).
QWEN2_5_VL, QWEN3_5 = "qwen2_5_vl", "qwen3_5"
# The checkpoints on Qwen3.5's tower: Qwen3.5's own, and Qwen3-VL's, whose tower (transformers' Qwen3VLVisionModel) is
# the same blocks and merger plus its "deepstack" mergers (deepstack_visual_indexes).
QWEN3_5_TOWER_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")
DEEPSTACK_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Pixtral (mistral3's tower): images of their own sizes padded into one batch, 2-D rotary on each patch's (row, column),
# attention within each image, RMSNorms and a gated MLP; its projector merges merge x merge patches into one token.
PIXTRAL = "pixtral"
_TOWERS = {"clip_vision_model": CLIP, "siglip_vision_model": SIGLIP, "idefics3_vision": SIGLIP,
           "smolvlm_vision": SIGLIP}
# Activations as transformers names them -> how the MLPs compute them (encoder.activation).
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu")
SELECT_STRATEGIES = ("default", "full")  # llava: drop the class token's feature, or keep it


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """One image-text checkpoint's vision tower, projector and text embedding, as the graphs need them."""

    model_type: str  # the checkpoint's (the registry's key)
    tower: str  # CLIP or SIGLIP
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int  # layers the graph runs: those up to the deepest feature layer
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    # The hidden states the projector reads, as indices into transformers' ``hidden_states`` (0: the
    # embeddings, i: after layer i); None: the tower's last_hidden_state (post-layernorm).
    feature_layers: tuple[int, ...] | None
    drop_class_token: bool  # llava's "default" strategy: the class token's feature is not an image token
    # Text side: the embedding graph's table and where image features go.
    text_hidden_size: int
    vocab_size: int
    image_token_id: int
    embed_scale: float | None  # gemma3: the token embedding is multiplied by sqrt(hidden)
    # Projector details (only the family's own are set).
    projector_act: str | None = None  # llava
    tokens_per_image: int = 0  # image_features rows per image
    pool_kernel: int = 1  # gemma3's average pool
    scale_factor: int = 1  # idefics3's pixel shuffle
    # Dynamic-resolution towers (QWEN2_5_VL, QWEN3_5; image_size and tokens_per_image 0: they follow
    # image_grid_thw): a patch spans temporal_patch_size frames, spatial_merge_size^2 neighbouring patches become
    # one token, attention stays within windows of ``window`` x ``window`` merged tokens except on
    # full_attention_layers (window 0: no windows, every block attends within each frame).
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    window: int = 0
    full_attention_layers: tuple[int, ...] = ()
    rope_theta: int = 0  # the 2-D rotary's base (an integer, cast to fp32 in the graph)
    # QWEN3_5: rows of the learned square position table, resampled (bilinear) to each frame's patch grid.
    num_position_embeddings: int = 0
    projector_norm_eps: float = 0.0  # PIXTRAL: the projector's RMSNorm (transformers gives it the text rms_norm_eps)
    # Qwen3-VL's deepstack (QWEN3_5 tower): the blocks whose output a deepstack map is taken after, in the order the
    # decoder adds the maps (ascending: transformers collects them block by block), and the deepstack_merger_list
    # entry each goes through (its place in deepstack_visual_indexes). Empty: no deepstack (every other family).
    deepstack_layers: tuple[int, ...] = ()
    deepstack_mergers: tuple[int, ...] = ()

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (QWEN2_5_VL's pixel_values rows): channels x frames x patch^2."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def feature_width(self) -> int:
        """image_features' (and inputs_embeds') last dim: the text hidden size, times 1 + the deepstack maps each
        image token carries beside its merged features (contract.image_text_width)."""
        return image_text_width(self.text_hidden_size, len(self.deepstack_layers))

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_side(self) -> int:
        """Rows (and columns) of the square position table (QWEN3_5), as transformers sizes it."""
        return math.isqrt(self.num_position_embeddings)


def read_vision_config(checkpoint_dir: Path, supported: tuple[str, ...]) -> VisionConfig:
    """config.json -> VisionConfig, refusing (ExportError) a model_type outside ``supported`` and any
    setting the graphs do not express."""
    raw = read_raw_config(Path(checkpoint_dir))
    model_type = raw.get("model_type")
    if model_type not in supported:
        raise ExportError(f"no vision graph for model_type {model_type!r}: the vision builder takes "
                          f"{', '.join(supported)} (image-text checkpoints with a CLIP / SigLIP tower)")
    hf = _transformers_config(Path(checkpoint_dir))
    vision, text = hf.vision_config, hf.get_text_config()
    if model_type == "qwen2_5_vl":
        return _qwen2_5_vl(hf, vision, text)
    if model_type in QWEN3_5_TOWER_TYPES:  # one tower (Qwen3_5MoeVisionModel is Qwen3_5VisionModel; Qwen3-VL's adds deepstack)
        return _qwen3_5(model_type, hf, vision, text)
    if model_type == "mistral3":
        return _mistral3(hf, vision, text)
    tower = _TOWERS.get(vision.model_type)
    if tower is None:
        raise ExportError(f"{model_type}'s vision tower is {vision.model_type!r}, which the vision builder does not "
                          "build: it takes CLIP and SigLIP towers (a ViT with learned absolute positions over one fixed "
                          f"image size: {', '.join(sorted(_TOWERS))})")
    act = vision.hidden_act
    if act not in ACTIVATIONS:
        raise ExportError(f"vision_config.hidden_act {act!r} is not one the vision builder computes "
                          f"({', '.join(ACTIVATIONS)})")
    if vision.hidden_size % vision.num_attention_heads:
        raise ExportError(f"vision_config.hidden_size {vision.hidden_size} is not a multiple of num_attention_heads "
                          f"{vision.num_attention_heads}: fix config.json")
    if vision.image_size % vision.patch_size:
        raise ExportError(f"vision_config.image_size {vision.image_size} is not a multiple of patch_size "
                          f"{vision.patch_size}: fix config.json")
    grid = vision.image_size // vision.patch_size
    image_token = getattr(hf, "image_token_id", None)
    image_token = getattr(hf, "image_token_index", None) if image_token is None else image_token
    if not isinstance(image_token, int):
        raise ExportError(f"{model_type}'s config.json names no image token (image_token_id): fix config.json")
    common = dict(
        model_type=model_type, tower=tower, hidden_size=vision.hidden_size, num_heads=vision.num_attention_heads,
        intermediate_size=vision.intermediate_size, num_layers=vision.num_hidden_layers, image_size=vision.image_size,
        patch_size=vision.patch_size, num_channels=vision.num_channels, layer_norm_eps=float(vision.layer_norm_eps),
        hidden_act=act, feature_layers=None, drop_class_token=False, text_hidden_size=text.hidden_size,
        vocab_size=text.vocab_size, image_token_id=image_token,
        embed_scale=None,
    )
    if model_type == "gemma3":
        side = math.isqrt(hf.mm_tokens_per_image)
        if side * side != hf.mm_tokens_per_image or grid % side:
            raise ExportError(f"gemma3's projector pools {grid}x{grid} patches to mm_tokens_per_image "
                              f"{hf.mm_tokens_per_image}, which must be a square whose side divides {grid}: fix config.json")
        return VisionConfig(**{**common, "embed_scale": text.hidden_size ** 0.5}, tokens_per_image=side * side,
                            pool_kernel=grid // side)
    if model_type == "llava":
        return _llava(hf, common, grid)
    # idefics3 / smolvlm: SigLIP, then the pixel shuffle (scale_factor^2 patches -> one token) and a projection
    scale = int(hf.scale_factor)
    if grid % scale:
        raise ExportError(f"{model_type}'s pixel shuffle groups {scale}x{scale} patches, but the grid is {grid}x{grid} "
                          "patches: image_size / patch_size must be a multiple of scale_factor")
    return VisionConfig(**common, tokens_per_image=(grid // scale) ** 2, scale_factor=scale)


def _llava(hf, common: dict, grid: int) -> VisionConfig:
    strategy = hf.vision_feature_select_strategy
    if strategy not in SELECT_STRATEGIES:
        raise ExportError(f"llava's vision_feature_select_strategy {strategy!r} is not one transformers' LlavaModel "
                          f"applies ({', '.join(SELECT_STRATEGIES)})")
    if hf.projector_hidden_act not in ACTIVATIONS:
        raise ExportError(f"llava's projector_hidden_act {hf.projector_hidden_act!r} is not one the vision builder "
                          f"computes ({', '.join(ACTIVATIONS)})")
    layers = hf.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    total = common["num_layers"] + 1  # transformers' hidden_states: the embeddings, then each layer's output
    if any(not -total <= i < total for i in layers):
        raise ExportError(f"vision_feature_layer {hf.vision_feature_layer} is outside the tower's {total} hidden "
                          f"states (-{total}..{total - 1}): fix config.json")
    resolved = tuple(i % total for i in layers)
    drop = strategy == "default"
    # "default" drops the first token: CLIP's class token (a SigLIP tower has none: its first patch goes alike)
    tokens = grid * grid + (common["tower"] == CLIP) - drop
    return VisionConfig(**{**common, "num_layers": max(resolved), "feature_layers": resolved, "drop_class_token": drop},
                        projector_act=hf.projector_hidden_act, tokens_per_image=tokens)


def _axial_rope_theta(heads_what: str, hidden: int, heads: int, rope_parameters, split: str, model_type: str) -> int:
    """The base of a tower's 2-D axial rotary, refusing (ExportError) a head_dim it cannot split between rows and
    columns (``split`` says how it splits) and a rope other than an axial one of a whole-number theta."""
    if hidden % heads or (hidden // heads) % 4:
        raise ExportError(f"{heads_what} must give a head_dim that is a multiple of 4 ({split}): fix config.json")
    rope = dict(rope_parameters or {})
    theta = rope.get("rope_theta", 10000.0)
    if rope.get("rope_type", "axial") != "axial" or float(theta) != int(theta):
        raise ExportError(f"{model_type}'s vision rope_parameters {rope} are not what the vision builder computes: an "
                          "axial rope whose rope_theta is a whole number")
    return int(theta)


def _patch_sequence(model_type: str, hf, vision, text) -> dict:
    """What the patch-sequence towers' configs (Qwen2.5-VL's, Qwen3.5's) share, as VisionConfig fields, refusing
    what their graphs do not compute: a head_dim the 2-D rotary cannot split, a rope other than an axial one of a
    whole-number theta, patch sizes other than one integer, a merger that does not give the text width."""
    heads, hidden = vision.num_heads, vision.hidden_size
    theta = _axial_rope_theta(f"{model_type}'s vision hidden_size {hidden} over num_heads {heads}", hidden, heads,
                              vision.rope_parameters, "its rotary splits each half between rows and columns",
                              model_type)
    sizes = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
             "spatial_merge_size": vision.spatial_merge_size}
    if not all(isinstance(size, int) and size >= 1 for size in sizes.values()):
        raise ExportError(f"{model_type}'s vision {sizes} must each be one positive integer (the processor's square "
                          "patches and merge blocks): fix config.json")
    if vision.out_hidden_size != text.hidden_size:
        raise ExportError(f"{model_type}'s merger gives {vision.out_hidden_size} channels (vision out_hidden_size) "
                          f"but the text hidden_size is {text.hidden_size}: fix config.json")
    return dict(
        model_type=model_type, hidden_size=hidden, num_heads=heads, intermediate_size=vision.intermediate_size,
        num_layers=vision.depth, image_size=0, patch_size=vision.patch_size, num_channels=vision.in_channels,
        layer_norm_eps=1e-6, feature_layers=None, drop_class_token=False, text_hidden_size=text.hidden_size,
        vocab_size=text.vocab_size, image_token_id=hf.image_token_id, embed_scale=None,
        temporal_patch_size=vision.temporal_patch_size, spatial_merge_size=vision.spatial_merge_size,
        rope_theta=int(theta))


def _qwen2_5_vl(hf, vision, text) -> VisionConfig:
    """Qwen2_5_VisionTransformerPretrainedModel + its PatchMerger: RMSNorm (eps 1e-6, fixed in transformers),
    a gated MLP, 2-D axial rotary, windows of ``window_size // spatial_merge_size // patch_size`` merged tokens."""
    act = vision.hidden_act
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ExportError(f"qwen2_5_vl's vision_config.hidden_act {act!r} is not one the vision builder computes "
                          "for its gated MLP (silu, gelu_pytorch_tanh)")
    common = _patch_sequence("qwen2_5_vl", hf, vision, text)
    merge = vision.spatial_merge_size
    window = vision.window_size // merge // vision.patch_size
    if window < 1:
        raise ExportError(f"qwen2_5_vl's vision window_size {vision.window_size} is under one merged token "
                          f"(spatial_merge_size {merge} x patch_size {vision.patch_size} pixels): fix config.json")
    full = tuple(sorted(set(vision.fullatt_block_indexes)))
    if any(not 0 <= i < vision.depth for i in full):
        raise ExportError(f"qwen2_5_vl's fullatt_block_indexes {list(vision.fullatt_block_indexes)} name blocks "
                          f"outside its depth {vision.depth}: fix config.json")
    return VisionConfig(**common, tower=QWEN2_5_VL, hidden_act=act, window=window, full_attention_layers=full)


def _qwen3_5(model_type: str, hf, vision, text) -> VisionConfig:
    """Qwen3_5VisionModel + its Qwen3_5VisionPatchMerger(use_postshuffle_norm=False): LayerNorms with biases (eps
    1e-6, fixed in transformers), a plain MLP, 2-D axial rotary, full attention within each frame in every block, a
    learned position table that transformers resamples (bilinear, align_corners, fixed in the class) to each grid.
    Qwen3-VL's tower (Qwen3VLVisionModel) is the same plus its deepstack mergers (_deepstack); a Qwen3.5 config that
    names deepstack layers is refused (Qwen3_5VisionModel has no such mergers)."""
    deepstack = list(getattr(vision, "deepstack_visual_indexes", None) or [])
    if deepstack and model_type not in DEEPSTACK_TYPES:
        raise ExportError(f"{model_type}'s vision_config names deepstack_visual_indexes {deepstack}, but Qwen3.5's tower "
                          "(transformers' Qwen3_5VisionModel) has no deepstack features: they are Qwen3-VL's (model_type "
                          "qwen3_vl), whose tower has a merger for each; a Qwen3.5 config.json has none (empty or absent): "
                          "is this config.json from this checkpoint?")
    act = vision.hidden_act
    if act not in ACTIVATIONS:
        raise ExportError(f"{model_type}'s vision_config.hidden_act {act!r} is not one the vision builder computes "
                          f"({', '.join(ACTIVATIONS)})")
    common = _patch_sequence(model_type, hf, vision, text)
    head_dim = getattr(vision, "head_dim", None)
    if head_dim is not None and head_dim != common["hidden_size"] // common["num_heads"]:
        raise ExportError(f"{model_type}'s vision_config.head_dim {head_dim} is not hidden_size / num_heads "
                          f"({common['hidden_size']} / {common['num_heads']}), which its attention splits heads by: "
                          "the rotary would not fit the heads; fix config.json")
    positions = vision.num_position_embeddings
    if not isinstance(positions, int) or positions < 1:
        raise ExportError(f"{model_type}'s vision num_position_embeddings {positions!r} is not a positive number of "
                          "position table rows: fix config.json")
    layers, mergers = _deepstack(model_type, deepstack, vision.depth, text.num_hidden_layers)
    return VisionConfig(**common, tower=QWEN3_5, hidden_act=act, full_attention_layers=tuple(range(vision.depth)),
                        num_position_embeddings=positions, deepstack_layers=layers, deepstack_mergers=mergers)


def _deepstack(model_type: str, indexes: list, depth: int, text_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Qwen3-VL's deepstack_visual_indexes as (the blocks maps are taken after, ascending; each one's merger), as
    transformers' Qwen3VLVisionModel computes them: after block i, if i is listed, deepstack_merger_list[its place in
    the list] on the block's output; the decoder adds the k-th map so collected after its layer k. Refused where
    transformers' tower and decoder would not use every listed merger and map: a block outside the tower, a block
    named twice, more maps than decoder layers."""
    listed = ", ".join(map(str, indexes))
    if any(not isinstance(i, int) or isinstance(i, bool) for i in indexes):
        raise ExportError(f"{model_type}'s vision_config.deepstack_visual_indexes [{listed}] must be vision block "
                          "numbers (integers): fix config.json")
    outside = [i for i in indexes if not 0 <= i < depth]
    if outside:
        raise ExportError(f"{model_type}'s vision_config.deepstack_visual_indexes [{listed}] name block(s) "
                          f"{outside} outside its tower of depth {depth} (blocks 0..{depth - 1}): transformers never "
                          "reaches them, so their deepstack mergers would go unused and the decoder would add fewer maps "
                          "than the list names; fix config.json (each index a vision block below depth)")
    if len(set(indexes)) != len(indexes):
        raise ExportError(f"{model_type}'s vision_config.deepstack_visual_indexes [{listed}] name a block twice: "
                          "transformers takes one map after that block and leaves the second merger unused; fix "
                          "config.json (each block once)")
    if len(indexes) > text_layers:
        raise ExportError(f"{model_type}'s vision_config.deepstack_visual_indexes [{listed}] give {len(indexes)} "
                          f"deepstack maps, but its language model has {text_layers} layers to add them after (one "
                          "map after each of the first layers): fix config.json")
    layers = tuple(sorted(indexes))
    return layers, tuple(indexes.index(i) for i in layers)


# Pixtral's MLP is gated: down(act(gate(x)) * up(x)), act one of these.
PIXTRAL_ACTIVATIONS = ("silu", *ACTIVATIONS)


def _mistral3(hf, vision, text) -> VisionConfig:
    """Mistral3's Pixtral tower (transformers' PixtralVisionModel: a bias-free patch Conv, ln_pre, RMSNorms of eps 1e-5
    fixed in the class, a gated MLP, 2-D rotary over each image's patch grid, attention within each image) and its
    Mistral3MultiModalProjector (RMSNorm of the text rms_norm_eps, the patch merger over spatial_merge_size^2 patches,
    linear_1 -> projector_hidden_act -> linear_2), reading transformers' ``hidden_states[vision_feature_layer]``."""
    if vision.model_type != "pixtral":
        raise ExportError(f"mistral3's vision tower is {vision.model_type!r}, which the vision builder does not build "
                          "for it: it takes a Pixtral tower (vision_config.model_type 'pixtral')")
    layer = hf.vision_feature_layer
    if not isinstance(layer, int):
        raise ExportError(f"mistral3's vision_feature_layer {layer} names several layers, whose features side by "
                          "side transformers' own Mistral3MultiModalProjector cannot normalize (its RMSNorm is one "
                          "layer wide): use one layer (an int) in config.json")
    total = vision.num_hidden_layers + 1  # transformers' hidden_states: ln_pre's output, then each layer's
    if not -total <= layer < total:
        raise ExportError(f"mistral3's vision_feature_layer {layer} is outside the tower's {total} hidden states "
                          f"(-{total}..{total - 1}): fix config.json")
    heads, hidden = vision.num_attention_heads, vision.hidden_size
    theta = _axial_rope_theta(f"mistral3's vision hidden_size {hidden} over num_attention_heads {heads}", hidden,
                              heads, vision.rope_parameters, "Pixtral's rotary gives rows the even frequencies and "
                              "columns the odd ones of each half", "mistral3")
    sizes = {"patch_size": vision.patch_size, "spatial_merge_size": hf.spatial_merge_size}
    if not all(isinstance(size, int) and size >= 1 for size in sizes.values()):
        raise ExportError(f"mistral3's {sizes} must each be one positive integer (square patches and merge blocks, as "
                          "PixtralImageProcessor sizes images): fix config.json")
    if vision.hidden_act not in PIXTRAL_ACTIVATIONS:
        raise ExportError(f"mistral3's vision_config.hidden_act {vision.hidden_act!r} is not one the vision builder "
                          f"computes for Pixtral's gated MLP ({', '.join(PIXTRAL_ACTIVATIONS)})")
    if hf.projector_hidden_act not in ACTIVATIONS:
        raise ExportError(f"mistral3's projector_hidden_act {hf.projector_hidden_act!r} is not one the vision builder "
                          f"computes ({', '.join(ACTIVATIONS)})")
    if not isinstance(hf.image_token_id, int):
        raise ExportError("mistral3's config.json names no image token (image_token_index): fix config.json")
    return VisionConfig(
        model_type="mistral3", tower=PIXTRAL, hidden_size=hidden, num_heads=heads,
        intermediate_size=vision.intermediate_size, num_layers=layer % total, image_size=0,
        patch_size=vision.patch_size, num_channels=vision.num_channels, layer_norm_eps=1e-5,
        hidden_act=vision.hidden_act, feature_layers=(layer % total,), drop_class_token=False,
        text_hidden_size=text.hidden_size, vocab_size=text.vocab_size, image_token_id=hf.image_token_id,
        embed_scale=None, projector_act=hf.projector_hidden_act, spatial_merge_size=hf.spatial_merge_size,
        rope_theta=int(theta), projector_norm_eps=float(text.rms_norm_eps))
