"""Vision-encoder and embedding graphs of image-text checkpoints (issue 48), built with onnx-ir from
config.json and the lazy checkpoint weights, equal to transformers' on the same weights.

Families (``FAMILIES``, keyed by config.json's model_type): gemma3 (SigLIP + pooled, soft-normed
projection), llava (CLIP or SigLIP tower, vision_feature_layer(s), vision_feature_select_strategy,
the MLP projector), idefics3 and smolvlm (SigLIP + pixel shuffle + projection), qwen2_5_vl (dynamic
resolution: Conv3d patches, 2-D rotary, window attention, the PatchMerger; exporter.vision.qwen2_5_vl), qwen3_5
(the same patches and rotary, a learned position table resampled to each grid, full attention per frame, its
merger; exporter.vision.qwen3_5), qwen3_vl and qwen3_vl_moe (Qwen3.5's tower plus its deepstack mergers: below),
mistral3 (Pixtral over images of their own sizes padded into one batch, 2-D rotary, attention per image, the Mistral3
projector and patch merger; exporter.vision.pixtral).
Anything else (qwen2_vl, paligemma, ...), or a setting these graphs do not compute, is refused with an ExportError
naming it.

Contract (names in exporter.vision.graphs; opset 24 + com.microsoft, IR 11):

vision graph (``build_vision_graph``)
    in  ``pixel_values``    float32 [num_images, channels, image_size, image_size]: the image
        processor's output, one image (or tile) per row. idefics3 / smolvlm: the processor's 5-D
        [batch, images, ...] flattened, all-zero padding images dropped, every patch real (no
        pixel_attention_mask: each tile is image_size square, as their processors make them). Their hf
        layout's vision_encoder takes the 5-D crops and pixel_attention_mask themselves, as transformers.js
        feeds them (``build_crops_vision_graph``, exporter.vision.crops).
    out ``image_features``  dtype [num_images * tokens_per_image, text hidden_size]: transformers'
        ``get_image_features(pixel_values)`` pooler output, image after image (gemma3: mm_tokens_per_image
        rows each; llava: the patches, less the class token under "default"; idefics3: patches /
        scale_factor^2). 2-D for every family: onnxruntime-genai preallocates it so, transformers.js
        flattens any rank.

qwen2_5_vl's and qwen3_5's vision graphs take any image size the processor makes (one graph, no Loop, the
layout computed from image_grid_thw: exporter.vision.patch_grid):
    in  ``pixel_values``    float32 [num_patches, channels * temporal_patch_size * patch_size^2]: the
        processor's flattened patches, image after image.
    in  ``image_grid_thw``  int64 [num_images, 3]: the processor's (frames, patch rows, patch columns).
    out ``image_features``  dtype [num_image_tokens, text hidden_size], num_image_tokens = sum(t * h * w) /
        spatial_merge_size^2: ``get_image_features``' per-image tuple concatenated. 2-D, because images
        differ in token count (a ragged 3-D tensor does not exist) and the embedding only needs the rows in
        order. The input names are onnxruntime-genai's Qwen2.5-VL processor's (transformers.js' Qwen2-VL
        feeds ``grid_thw``: its layout would rename the input). A grid of several frames gives
        ``get_video_features``' result (tested), though no embedding graph takes it.

qwen3_vl's (and qwen3_vl_moe's) vision graph is qwen3_5's with Qwen3-VL's "deepstack": D = len(deepstack_visual_indexes)
more feature maps, the outputs of those vision blocks each through its own merger, which transformers' language model
adds to its hidden states at the image positions after its layers 0..D-1. Neither onnxruntime-genai 0.18 nor
transformers.js 4.3.2 feeds a decoder anything but inputs_embeds, and both hand it the vision graph's rows inside
inputs_embeds unchanged (genai sizes image_features and inputs_embeds by genai_config's decoder.hidden_size;
transformers.js copies each feature row into its token's inputs_embeds row, whatever its width). So the maps ride in
the rows: image_features and inputs_embeds are text hidden x (1 + D) wide (exporter.contract.image_text_width),
[merged | map 0 | ... | map D-1] at an image token, [embedding | zeros] at a text token, and the decoder adds slice k + 1
after its layer k. Both graphs carry ``exportfarm.vision.deepstack`` = D.

mistral3's vision graph takes images of their own sizes (one graph, no Loop, everything per image computed from
image_sizes: exporter.vision.pixtral):
    in  ``pixel_values``    float32 [num_images, channels, height, width]: each image top-left, zero-padded to the
        batch's largest height and width (PixtralImageProcessor's batch).
    in  ``image_sizes``     int64 [num_images, 2], optional: each image's (height, width) in pixels. An overridable
        initializer of default [[0, 0]] (0: the image is the whole of pixel_values), which onnxruntime leaves out of a
        session's inputs: onnxruntime-genai (one image a run, at its own size) and transformers.js (one image) feed
        pixel_values alone.
    out ``image_features``  dtype [num_image_tokens, text hidden_size]: per image (height // (patch * merge)) x
        (width // (patch * merge)) rows, row-major, image after image (get_image_features' tuple concatenated): the
        [IMG] tokens' rows; [IMG_BREAK] and [IMG_END] are ordinary tokens.

embedding graph (``build_embedding_graph``)
    in  ``input_ids``       int64 [batch_size, sequence_length]
    in  ``image_features``  dtype [num_image_tokens, text hidden_size], the vision graph's rows (0 rows: text
        only, a decode step); qwen2_5_vl, qwen3_5: video tokens (video_token_id) are not merged: they keep their
        table row
    out ``inputs_embeds``   dtype [batch_size, sequence_length, text hidden_size]: the token embedding
        (gemma3 scaled by sqrt(hidden_size)) with image feature rows, in order, at the image-token
        positions, as transformers' masked_scatter merges them. The prompt must hold exactly
        num_images * tokens_per_image image tokens (more index past the features: onnxruntime errors).

Both models carry metadata ``exportfarm.vision.tokens_per_image``, ``.image_token_id`` and ``.image_size``
(qwen2_5_vl, qwen3_5: tokens_per_image and image_size 0, as both follow image_grid_thw; their vision graphs also carry
``exportfarm.vision.spatial_merge_size``, which places an image's tokens on M-RoPE's streams; mistral3: 0 as well, its
vision graph carrying ``.patch_size`` and ``.spatial_merge_size``, which give an image's token grid from its size).
"""

from exporter.vision.config import VisionConfig
from exporter.vision.families import FAMILIES, VisionFamily
from exporter.vision.graphs import (
    IMAGE_FEATURES,
    IMAGE_GRID_THW,
    IMAGE_SIZES,
    INPUT_IDS,
    INPUTS_EMBEDS,
    PIXEL_VALUES,
    build_crops_vision_graph,
    build_embedding_graph,
    build_vision_graph,
    check_vision_checkpoint,
    load_vision_config,
)

__all__ = [
    "FAMILIES", "IMAGE_FEATURES", "IMAGE_GRID_THW", "IMAGE_SIZES", "INPUTS_EMBEDS", "INPUT_IDS", "PIXEL_VALUES",
    "VisionConfig", "VisionFamily",
    "build_crops_vision_graph", "build_embedding_graph", "build_vision_graph", "check_vision_checkpoint",
    "load_vision_config",
]
