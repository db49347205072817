"""Tiny image-text checkpoints that carry their own processor (tokenizer, image processor, processor
config, chat template), as a hub repository does: what the hf layout's processor files are generated
from and what transformers.js's AutoProcessor is proven against (tests/test_hf_layout_vlm.py).

The tokenizer is a byte-level BPE of 300 ids whose first ids are the family's special tokens, so the
image token is a row of the table (as in the real checkpoints); images are processed at the tower's
own size (32 x 32), where neither processor has anything to resample; idefics3 / smolvlm split an image of
twice the tower's size into crops (CROPS_PER_SIDE).
"""

from __future__ import annotations

from pathlib import Path

from exporter.tiny_checkpoint import _TINY_CORPUS
from exporter.vision.tiny_checkpoint import TEXT, TOWER, make_tiny_vlm_checkpoint

VOCAB = 300
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The specials of each family's tokenizer in id order (<pad> 0 as TEXT's pad_token_id), and the named ones.
SPECIALS = {
    "gemma3": (["<pad>", "<bos>", "<eos>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"],
               {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}),
    "llava": (["<pad>", "<s>", "</s>", "<image>"], {"image_token": "<image>"}),
}
# idefics3 / smolvlm: the tokens their processors write (transformers.js's Idefics3Processor writes these strings
# whatever the tokenizer names), the row / column tags of up to 6 x 6 crops as in the published tokenizers.
CROPS_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
_CROPS_SPECIALS = (["<pad>", "<s>", "</s>", *CROPS_TOKENS.values()]
                   + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
SPECIALS["idefics3"] = (_CROPS_SPECIALS, {})
SPECIALS["smolvlm"] = (_CROPS_SPECIALS, CROPS_TOKENS)  # SmolVLMProcessor reads them from the tokenizer
IMAGE_TOKEN = {"gemma3": "<image_soft_token>", "llava": "<image>", "idefics3": "<image>", "smolvlm": "<image>"}
# What a prompt names an image with: gemma3's processor expands <start_of_image>, the others <image>.
PROMPT_IMAGE = {"gemma3": "<start_of_image>", "llava": "<image>", "idefics3": "<image>", "smolvlm": "<image>"}
# idefics3 / smolvlm's image processors: an image resized to CROPS_PER_SIDE crops of the tower's size on its longest
# edge, split into them, and the whole image resized to one more (do_image_splitting, as the published processors do).
# Resampled with BOX where the published ones use LANCZOS: transformers.js resizes the crops with its own bilinear
# Resize whatever the checkpoint names, and an image of 2 x 2 pixel blocks is resized alike by BOX and that (exactly),
# so the tests compare the exports, not two resamplers.
CROPS_PER_SIDE = 2


def _tokenizer(case: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, named = SPECIALS[case]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(_TINY_CORPUS) * 4, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=specials[0], bos_token=specials[1],
                                   eos_token=specials[2],
                                   extra_special_tokens=named if case in ("gemma3", "smolvlm") else {})


def make_tiny_vlm_repo(case: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a random ``case`` (gemma3, llava, idefics3 or smolvlm) image-text checkpoint with its processor to
    ``out_dir``. smolvlm's is written as its hub repositories hold it (tokenizer, image processor,
    processor_config.json, chat_template.json): transformers' SmolVLMProcessor itself wants a video processor
    (torchvision) and num2words."""
    import transformers

    out_dir = Path(out_dir)
    tokenizer = _tokenizer(case)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[case])
    size = TOWER["image_size"]
    text = {**TEXT, "vocab_size": VOCAB}
    if case == "gemma3":
        processor = transformers.Gemma3Processor(
            image_processor=transformers.Gemma3ImageProcessor(size={"height": size, "width": size},
                                                              image_mean=[0.5] * 3, image_std=[0.5] * 3),
            tokenizer=tokenizer, image_seq_length=16, chat_template=CHAT_TEMPLATE)
        overrides = dict(text_config=text, image_token_index=image_token_id,
                         boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                         eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"))
    elif case == "llava":
        # llava-1.5's processor settings: the class token counted by num_additional_image_tokens, then dropped
        # again by the "default" strategy (what its processor_config.json says on the hub)
        processor = transformers.LlavaProcessor(
            image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                            crop_size={"height": size, "width": size}),
            tokenizer=tokenizer, patch_size=TOWER["patch_size"], vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
        overrides = dict(text_config={**text, "model_type": "llama"}, image_token_index=image_token_id)
    elif case in ("idefics3", "smolvlm"):
        from exporter.vision.tiny_checkpoint import VLM_CONFIGS

        tower = VLM_CONFIGS[case][1]["vision_config"]
        crop = tower["image_size"]
        seq_len = (crop // tower["patch_size"] // VLM_CONFIGS[case][1]["scale_factor"]) ** 2
        image_class = {"idefics3": transformers.Idefics3ImageProcessorPil,
                       "smolvlm": transformers.SmolVLMImageProcessorPil}[case]
        image_processor = image_class(size={"longest_edge": CROPS_PER_SIDE * crop},
                                      max_image_size={"longest_edge": crop}, do_image_splitting=True,
                                      resample=transformers.image_utils.PILImageResampling.BOX)
        processor = (transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                                    image_seq_len=seq_len, chat_template=CHAT_TEMPLATE)
                     if case == "idefics3" else None)
        overrides = dict(text_config={**text, "model_type": "llama"}, image_token_id=image_token_id)
    else:
        raise ValueError(f"no tiny processor for {case!r}: gemma3, llava, idefics3 or smolvlm")
    make_tiny_vlm_checkpoint(case, out_dir, seed=seed, **overrides)
    if processor is None:  # smolvlm: its parts and settings, as a hub repository holds them
        import json

        tokenizer.save_pretrained(out_dir)
        image_processor.save_pretrained(out_dir)
        (out_dir / "processor_config.json").write_text(json.dumps(
            {"image_seq_len": seq_len, "processor_class": "SmolVLMProcessor"}, indent=2) + "\n")
        (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
        return out_dir
    if case == "gemma3":
        _shrink_embeddings(out_dir / "model.safetensors", 0.1)
    processor.save_pretrained(out_dir)
    return out_dir


def _shrink_embeddings(path: Path, scale: float) -> None:
    """Scale the token table: times gemma3's sqrt(hidden), a random table outweighs every layer, and the
    tied head reads the current token back, so greedy repeats it whatever the positions (a test that
    cannot see them)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith("embed_tokens.weight"):
            tensors[name] = tensors[name] * scale
    save_file(tensors, str(path), metadata={"format": "pt"})
