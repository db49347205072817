"""Vision-encoder and embedding graphs of image-text checkpoints (issue 48), built with onnx-ir from
config.json and the lazy checkpoint weights, equal to transformers' on the same weights.

Families (``FAMILIES``, keyed by config.json's model_type): gemma3 (SigLIP + pooled, soft-normed
projection), llava (CLIP or SigLIP tower, vision_feature_layer(s), vision_feature_select_strategy,
the MLP projector), idefics3 and smolvlm (SigLIP + pixel shuffle + projection). Anything else, or a
setting these graphs do not compute, is refused with an ExportError naming it.

Contract (names in exporter.vision.graphs; opset 24 + com.microsoft, IR 11):

vision graph (``build_vision_graph``)
    in  ``pixel_values``    float32 [num_images, channels, image_size, image_size]: the image
        processor's output, one image (or tile) per row. idefics3 / smolvlm: the processor's 5-D
        [batch, images, ...] flattened, all-zero padding images dropped, every patch real (no
        pixel_attention_mask: each tile is image_size square, as their processors make them).
    out ``image_features``  dtype [num_images, tokens_per_image, text hidden_size]: transformers'
        ``get_image_features(pixel_values)`` pooler output per image (gemma3: mm_tokens_per_image rows;
        llava: the patches, less the class token under "default"; idefics3: patches / scale_factor^2).

embedding graph (``build_embedding_graph``)
    in  ``input_ids``       int64 [batch_size, sequence_length]
    in  ``image_features``  dtype [num_images, tokens_per_image, text hidden_size] (num_images may be 0)
    out ``inputs_embeds``   dtype [batch_size, sequence_length, text hidden_size]: the token embedding
        (gemma3 scaled by sqrt(hidden_size)) with image feature rows, in order, at the image-token
        positions, as transformers' masked_scatter merges them. The prompt must hold exactly
        num_images * tokens_per_image image tokens (more index past the features: onnxruntime errors).

Both models carry metadata ``exportfarm.vision.tokens_per_image``, ``.image_token_id`` and ``.image_size``.
"""

from exporter.vision.config import VisionConfig
from exporter.vision.families import FAMILIES, VisionFamily
from exporter.vision.graphs import (
    IMAGE_FEATURES,
    INPUT_IDS,
    INPUTS_EMBEDS,
    PIXEL_VALUES,
    build_embedding_graph,
    build_vision_graph,
    load_vision_config,
)

__all__ = [
    "FAMILIES", "IMAGE_FEATURES", "INPUTS_EMBEDS", "INPUT_IDS", "PIXEL_VALUES", "VisionConfig", "VisionFamily",
    "build_embedding_graph", "build_vision_graph", "load_vision_config",
]
