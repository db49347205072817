"""Small random-weight image-text checkpoints (config -> transformers model -> save_pretrained), as
exporter.tiny_checkpoint builds the text ones: what the vision tests prove the graphs against.

Towers of 2 layers, hidden 32 in 2 heads, 8 x 8 patches of 4 pixels; a one-layer language model of
hidden 64 (only its embedding is read here). Weights larger than the classes' init (the gemma3
projection is zeros at init) so that every path shows in the features.
"""

from __future__ import annotations

from pathlib import Path

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
             patch_size=4)
IMAGE_TOKEN = 250

VLM_CONFIGS = {
    # image_token_index 256 = vocab_size: an id past the table, which transformers maps to 0 before the lookup.
    "gemma3": ("Gemma3Config", dict(text_config=TEXT, vision_config={**TOWER, "vision_use_head": False},
                                    mm_tokens_per_image=16, image_token_index=256)),
    # llava-1.5's choices: the second-to-last layer, the class token dropped.
    "llava": ("LlavaConfig", dict(text_config={**TEXT, "model_type": "llama"},
                                  vision_config={**TOWER, "model_type": "clip_vision_model", "num_hidden_layers": 3},
                                  vision_feature_layer=-2, vision_feature_select_strategy="default",
                                  image_token_index=IMAGE_TOKEN)),
    # Several feature layers (the embeddings and the last), every token kept.
    "llava_layers": ("LlavaConfig", dict(text_config={**TEXT, "model_type": "llama"},
                                         vision_config={**TOWER, "model_type": "clip_vision_model"},
                                         vision_feature_layer=[0, -1], vision_feature_select_strategy="full",
                                         image_token_index=IMAGE_TOKEN)),
    "idefics3": ("Idefics3Config", dict(text_config={**TEXT, "model_type": "llama"}, vision_config=TOWER,
                                        scale_factor=2, image_token_id=IMAGE_TOKEN)),
    # A 25 x 25 grid: transformers' bucketized position ids repeat rows there (families.idefics3_position_ids).
    "smolvlm": ("SmolVLMConfig", dict(text_config={**TEXT, "model_type": "llama"},
                                      vision_config={**TOWER, "image_size": 100}, scale_factor=5,
                                      image_token_id=IMAGE_TOKEN)),
}

# Checkpoints that carry a tokenizer and an image processor (make_tiny_image_text_processor), apart from VLM_CONFIGS:
# what tests/test_genai_vlm.py runs in onnxruntime-genai. genai 0.18's gemma3 processor expands every image to a
# constant 256 <image_soft_token>, so the tower's 16 x 16 patches (64 pixels in 4-pixel patches) pool to 256
# tokens; the tiny BPE's 300 ids, then <start_of_image> 300, <end_of_image> 301, <image_soft_token> 302.
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
PROCESSOR_CONFIGS = {
    "gemma3_genai": ("Gemma3Config", dict(text_config={**TEXT, "vocab_size": 303, "max_position_embeddings": 1024,
                                                       "bos_token_id": 1, "eos_token_id": 2},
                                          vision_config={**TOWER, "image_size": 64, "vision_use_head": False},
                                          mm_tokens_per_image=256, boi_token_index=300, eoi_token_index=301,
                                          image_token_index=302)),
}

# Dynamic-resolution towers, apart from VLM_CONFIGS: they take flattened patches and image_grid_thw, not
# images of one size (tests/test_vision_qwen.py, not tests/test_vision.py's fixed-size cases). Their whole exports
# (vision, embedding and the M-RoPE decoder, end to end through the pipeline) are tests/test_vlm_qwen.py's.
PATCH_SEQUENCE_CONFIGS = {
    # qwen2_5_vl: 4-pixel patches over 2 frames, 2 x 2 merged, windows of 2 x 2 merged tokens
    # (window_size 16 pixels) on blocks 0 and 2, full attention on 1 and 3; the text side's M-RoPE sections
    # sized to its head_dim 16.
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(
        text_config={**TEXT, "model_type": "qwen2_5_vl_text", "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1, 3],
                           out_hidden_size=TEXT["hidden_size"], hidden_act="silu"),
        image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3)),
}
# qwen3_5: a hybrid language model of one Gated DeltaNet and one gated-attention layer (heads of 64, a quarter of them
# rotated as Qwen3.5 rotates them: 16 rotary dims, 8 pairs in interleaved M-RoPE sections 3 / 3 / 2, what
# GroupQueryAttention's fused rotary takes); a tower of 3 blocks over 4-pixel patches of 2 frames, 2 x 2 merged, whose
# position table is 4 x 4 (num_position_embeddings 16): grids of more and of fewer than 4 patches a side are resampled.
PATCH_SEQUENCE_CONFIGS["qwen3_5"] = ("Qwen3_5Config", dict(
    text_config={**TEXT, "model_type": "qwen3_5_text", "num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2,
                 "layer_types": ["linear_attention", "full_attention"], "head_dim": 64, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
                 "linear_conv_kernel_dim": 4,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True}},
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                       spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=TEXT["hidden_size"],
                       hidden_act="gelu_pytorch_tanh"),
    image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, vision_start_token_id=IMAGE_TOKEN + 2,
    vision_end_token_id=IMAGE_TOKEN + 3))
# qwen2_5_vl with its tokenizer and Qwen2VLImageProcessor (make_tiny_qwen_processor): what
# tests/test_genai_vlm_qwen.py runs in onnxruntime-genai, whose processor writes <|vision_start|>, <|image_pad|>
# and <|vision_end|> into the prompt. The tiny BPE's 300 ids (no BOS, as Qwen's), then QWEN_IMAGE_TOKENS.
QWEN_IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_QWEN = PATCH_SEQUENCE_CONFIGS["qwen2_5_vl"][1]
PATCH_SEQUENCE_CONFIGS["qwen2_5_vl_genai"] = ("Qwen2_5_VLConfig", dict(
    _QWEN, text_config={**_QWEN["text_config"], "vocab_size": 304, "max_position_embeddings": 512},
    vision_start_token_id=300, vision_end_token_id=301, image_token_id=302, video_token_id=303))
# qwen3_5 likewise; its image processor (transformers' AutoImageProcessor for qwen3_5 is Qwen2VLImageProcessor, as
# Qwen3.5's hub repositories name it) normalizes with mean and std 0.5.
_QWEN3_5 = PATCH_SEQUENCE_CONFIGS["qwen3_5"][1]
PATCH_SEQUENCE_CONFIGS["qwen3_5_genai"] = ("Qwen3_5Config", dict(
    _QWEN3_5, text_config={**_QWEN3_5["text_config"], "vocab_size": 304, "max_position_embeddings": 512},
    vision_start_token_id=300, vision_end_token_id=301, image_token_id=302, video_token_id=303))
# qwen3_5_moe: the same tower and layers, 4 experts of width 32 (2 a token) and a shared expert in each.
PATCH_SEQUENCE_CONFIGS["qwen3_5_moe_genai"] = ("Qwen3_5MoeConfig", dict(
    PATCH_SEQUENCE_CONFIGS["qwen3_5_genai"][1],
    text_config={**PATCH_SEQUENCE_CONFIGS["qwen3_5_genai"][1]["text_config"], "model_type": "qwen3_5_moe_text",
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 32}))
QWEN3_5_IMAGE_NORM = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
# qwen3_vl: Qwen3.5's tower (3 blocks, the 4 x 4 position table) with deepstack maps after blocks 0 and 2, which its
# 3-layer qwen3 language model (q / k norms, heads of 16: 8 rotary pairs in interleaved M-RoPE sections 2 / 3 / 3, the
# whole head rotated) adds after its layers 0 and 1 (layer 2 gets none); its own lm_head (tie_word_embeddings False, as
# Qwen3-VL's larger checkpoints).
PATCH_SEQUENCE_CONFIGS["qwen3_vl"] = ("Qwen3VLConfig", dict(
    text_config={**TEXT, "model_type": "qwen3_vl_text", "num_hidden_layers": 3, "bos_token_id": 1, "eos_token_id": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True}},
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                       spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=TEXT["hidden_size"],
                       hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[0, 2]),
    image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, vision_start_token_id=IMAGE_TOKEN + 2,
    vision_end_token_id=IMAGE_TOKEN + 3, tie_word_embeddings=False))
# qwen3_vl_moe: the same tower and deepstack, a qwen3_vl_moe_text of 4 experts of width 24 (2 a token) in every layer
# (24: the stacked experts' two layouts, [4, 48, 64] and [4, 64, 48], are told apart by shape, as transformers tells them).
_QWEN3_VL = PATCH_SEQUENCE_CONFIGS["qwen3_vl"][1]
PATCH_SEQUENCE_CONFIGS["qwen3_vl_moe"] = ("Qwen3VLMoeConfig", dict(
    _QWEN3_VL, text_config={**_QWEN3_VL["text_config"], "model_type": "qwen3_vl_moe_text", "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 24}))
# Both with the tokenizer and image processor (make_tiny_qwen_processor: Qwen2VLImageProcessor, which Qwen3-VL's hub
# repositories name, mean and std 0.5 as theirs): what onnxruntime-genai and transformers.js run.
for _name in ("qwen3_vl", "qwen3_vl_moe"):
    _class, _kwargs = PATCH_SEQUENCE_CONFIGS[_name]
    PATCH_SEQUENCE_CONFIGS[f"{_name}_genai"] = (_class, dict(
        _kwargs, text_config={**_kwargs["text_config"], "vocab_size": 304, "max_position_embeddings": 512},
        vision_start_token_id=300, vision_end_token_id=301, image_token_id=302, video_token_id=303))
# The image processor's pixel bounds: up to 64 x 64 pixels (8 x 8 merged tokens of 8 pixels), at least 16 x 16.
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 16 * 16, 64 * 64


# Pixtral towers (mistral3), apart from VLM_CONFIGS: they take images of their own sizes padded into one batch, with
# image_sizes (tests/test_vlm_mistral3.py). A tower of 2 layers, hidden 32 in 2 heads (head_dim 16: 4 row and 4 column
# rotary frequencies), 4-pixel patches merged 2 x 2 (8 pixels a token side), a mistral language model of hidden 64;
# Mistral3Config's own defaults otherwise (the last layer's features, GELU projector without biases, the head tied).
MISTRAL3_TOWER = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=64, patch_size=4, hidden_act="silu")
PADDED_IMAGES_CONFIGS = {
    "mistral3": ("Mistral3Config", dict(text_config={**TEXT, "model_type": "mistral", "sliding_window": None},
                                        vision_config=MISTRAL3_TOWER, spatial_merge_size=2,
                                        image_token_index=IMAGE_TOKEN)),
}
# The other settings the graph reads: an earlier layer's features (hidden_states[1] of 2: layer 2 unread), an exact
# GELU in the tower's gated MLP, the projector's biases and a head of its own.
PADDED_IMAGES_CONFIGS["mistral3_layer"] = ("Mistral3Config", dict(
    PADDED_IMAGES_CONFIGS["mistral3"][1], vision_config={**MISTRAL3_TOWER, "hidden_act": "gelu"}, vision_feature_layer=-2,
    multimodal_projector_bias=True, tie_word_embeddings=False))
# A Ministral 3 language model (ministral3: yarn from 8 positions with Llama 4's query scale), as Ministral-3's hubs.
PADDED_IMAGES_CONFIGS["mistral3_ministral3"] = ("Mistral3Config", dict(
    PADDED_IMAGES_CONFIGS["mistral3"][1], text_config={**TEXT, "model_type": "ministral3", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}))

# mistral3 with its tokenizer and PixtralImageProcessor (make_tiny_pixtral_processor): what tests/test_genai_vlm_mistral3.py
# runs in onnxruntime-genai, whose mistral3 processor expands each [IMG] of a prompt to the image's rows of [IMG] ending
# in [IMG_BREAK], the last in [IMG_END], and inserts images without one after [INST]. The tiny BPE's 300 ids, then
# PIXTRAL_TOKENS; images up to 64 pixels on their longest edge (8 x 8 tokens).
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
PIXTRAL_LONGEST_EDGE = 64
PADDED_IMAGES_CONFIGS["mistral3_genai"] = ("Mistral3Config", dict(
    PADDED_IMAGES_CONFIGS["mistral3"][1], image_token_index=300,
    text_config={**PADDED_IMAGES_CONFIGS["mistral3"][1]["text_config"], "vocab_size": 305, "max_position_embeddings": 512,
                 "bos_token_id": 1, "eos_token_id": 2}))


def make_tiny_vlm_checkpoint(name: str, out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Write config.json + safetensors of a random ``VLM_CONFIGS[name]`` (or ``PATCH_SEQUENCE_CONFIGS[name]``,
    ``PADDED_IMAGES_CONFIGS[name]``) model to ``out_dir``; returns it."""
    import torch
    import transformers

    class_name, kwargs = {**VLM_CONFIGS, **PATCH_SEQUENCE_CONFIGS, **PROCESSOR_CONFIGS, **PADDED_IMAGES_CONFIGS}[name]
    config = getattr(transformers, class_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or ".ln_q." in param_name:  # ln_q: qwen2_5_vl's merger RMSNorm
                param.uniform_(0.8, 1.2) if "soft_emb_norm" not in param_name else param.uniform_(-0.2, 0.2)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if name in PROCESSOR_CONFIGS:
        make_tiny_image_text_processor(out_dir, config.vision_config.image_size, config.mm_tokens_per_image)
    if name == "qwen2_5_vl_genai":
        make_tiny_qwen_processor(out_dir, config.vision_config)
    if name in ("qwen3_5_genai", "qwen3_5_moe_genai", "qwen3_vl_genai", "qwen3_vl_moe_genai"):
        make_tiny_qwen_processor(out_dir, config.vision_config, **QWEN3_5_IMAGE_NORM)
    if name == "mistral3_genai":
        make_tiny_pixtral_processor(out_dir, config.vision_config.patch_size, config.spatial_merge_size)
    return out_dir


def make_tiny_pixtral_processor(out_dir: Path, patch_size: int, spatial_merge_size: int,
                                longest_edge: int = PIXTRAL_LONGEST_EDGE) -> Path:
    """Write a Pixtral processor beside a checkpoint in ``out_dir`` as a mistral3 hub repository holds it: the tiny
    byte-level BPE (BOS added, as Mistral's) with PIXTRAL_TOKENS after its 300 ids, a PixtralImageProcessor of
    ``longest_edge`` (its defaults otherwise: bicubic, 1/255, CLIP's mean and std) and processor_config.json's
    PixtralProcessor settings (the tower's patch_size, spatial_merge_size, the image tokens). PixtralProcessor itself
    wants torchvision: its two parts and its settings are written, as the hub repositories have them."""
    import json

    import transformers
    from transformers import PreTrainedTokenizerFast

    from exporter.tiny_checkpoint import make_tiny_tokenizer

    out_dir = Path(out_dir)
    base = PreTrainedTokenizerFast.from_pretrained(make_tiny_tokenizer(out_dir, bos=True))
    base.add_special_tokens({"additional_special_tokens": PIXTRAL_TOKENS})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.save_pretrained(out_dir)
    transformers.PixtralImageProcessorPil(size={"longest_edge": longest_edge},
                                          patch_size={"height": patch_size, "width": patch_size}).save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch_size, "spatial_merge_size": spatial_merge_size,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=2) + "\n")
    return out_dir


def make_tiny_image_text_processor(out_dir: Path, image_size: int, image_seq_length: int) -> Path:
    """Write a gemma3 processor beside a checkpoint in ``out_dir``: the tiny byte-level BPE (exporter.tiny_checkpoint,
    BOS added) with <start_of_image>, <end_of_image>, <image_soft_token> after its 300 ids, named as Gemma-3's
    tokenizer_config names them, and a Gemma3ImageProcessor at ``image_size`` (transformers 5 writes
    processor_config.json; its defaults otherwise: bilinear, 1/255, mean and std 0.5)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    from exporter.tiny_checkpoint import make_tiny_tokenizer

    out_dir = Path(out_dir)
    base = PreTrainedTokenizerFast.from_pretrained(make_tiny_tokenizer(out_dir, bos=True))
    base.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS.values())})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    image_processor = transformers.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                 image_seq_length=image_seq_length).save_pretrained(out_dir)
    return out_dir


def make_tiny_qwen_processor(out_dir: Path, vision_config, min_pixels: int = QWEN_MIN_PIXELS,
                             max_pixels: int = QWEN_MAX_PIXELS, **normalization) -> Path:
    """Write a Qwen2.5-VL (or Qwen3.5) processor beside a checkpoint in ``out_dir``: the tiny byte-level BPE (no BOS)
    with QWEN_IMAGE_TOKENS after its 300 ids, and a Qwen2VLImageProcessor of the tower's patch, merge and temporal
    sizes between ``min_pixels`` and ``max_pixels`` (its defaults otherwise: bicubic, 1/255, CLIP's mean and std,
    or ``normalization``'s image_mean and image_std)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    from exporter.tiny_checkpoint import make_tiny_tokenizer

    out_dir = Path(out_dir)
    base = PreTrainedTokenizerFast.from_pretrained(make_tiny_tokenizer(out_dir))
    base.add_special_tokens({"additional_special_tokens": QWEN_IMAGE_TOKENS})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="</s>", pad_token="<pad>",
                                        extra_special_tokens={"image_token": "<|image_pad|>",
                                                              "video_token": "<|video_pad|>"})
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=vision_config.patch_size,
        merge_size=vision_config.spatial_merge_size, temporal_patch_size=vision_config.temporal_patch_size,
        **normalization)
    # Qwen2_5_VLProcessor itself wants a video processor, which needs torchvision: the two parts, as a hub repo has
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    return out_dir
