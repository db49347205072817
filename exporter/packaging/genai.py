"""Package stage, onnxruntime-genai part: genai_config.json and the tokenizer files beside model.onnx.

onnxruntime-genai loads a folder, not a model file: genai_config.json names the decoder's inputs and
outputs, its head geometry, the special token ids and the search defaults, and the tokenizer files
sit next to it. A folder with a missing or wrong config (or without a tokenizer) is the most common
reason an export "does not run in genai", so the config is written from the same graph contract the
exporter built (docs/graph-contracts.md) and checked against the graph's real input/output names.

Only ``gqa`` and ``attn_dynamic`` are genai packages: genai feeds ``input_ids``, ``attention_mask``,
``position_ids`` and the past/present caches, nothing else, so ``attn_static`` (which needs
``write_indices`` and ``nonpad_kv_seqlen``) gets its tokenizer files but no genai_config.json, and the
manifest says why.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from exporter.graph.config import ModelConfig
from exporter.packaging.package import MODEL_FILE
from exporter.packaging.source_files import GENERATION_CONFIG_FILE, checkpoint_file, tokenizer_file_names
from exporter.request import EP, ExportRequest, Variant
from exporter.contract import (
    ATTENTION_MASK, CONV_STATE, GENAI_CONFIG_FILE, INPUT_IDS, LOGITS, POSITION_IDS, RECURRENT_STATE, SSM_STATE,
    cache_names, state_names,
)
from exporter.graph.config import GATED_DELTANET, MAMBA2

# The release CI loads these packages with (tests/test_genai.py); its PyPI wheel runs on the separately
# installed onnxruntime package (>= 1.31), the one that must run our opset-24 graphs.
GENAI_MIN_VERSION = "0.18"
GENAI_RUNTIME = f"onnxruntime-genai >= {GENAI_MIN_VERSION}"
# Hugging Face model_type -> genai model.type; all are in genai's plain decoder list (ModelType::IsLLM).
# The graph carries everything model-specific (soft-caps, windows, norms), so OLMo 2, which genai
# 0.18 does not name, runs as its generic "decoder".
GENAI_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
    "gemma3_text": "gemma3_text", "granite": "granite", "olmo2": "decoder", "smollm3": "smollm3",
    # Mixtures of experts: the experts are ops in the graph; to genai's generator a plain decoder.
    "mixtral": "decoder", "qwen2_moe": "decoder", "qwen3_moe": "decoder", "olmoe": "decoder", "granitemoe": "decoder",
    "gpt_oss": "decoder", "phimoe": "decoder",
    # Hybrids: genai's recurrent-state cache finds the layers whose past_recurrent_names / past_conv_names
    # the graph has (absolute layer indices), whatever the type. "qwen3" feeds 2-D position_ids (where the
    # graph takes them); genai's own qwen3_5_text type feeds M-RoPE's [3, batch, seq], which a text graph
    # does not take, and it has no qwen3_next. lfm2's conv-only cache comes with the type and its
    # decoder.layer_types. genai 0.18 has no nemotron_h type: its generic decoder finds the Mamba2 states the
    # same way (tests/test_genai.py generates transformers' tokens with it). (qwen3_5 / qwen3_5_moe: the language
    # model of such a checkpoint exported alone; an image-text checkpoint of them is an image-text package of genai's
    # qwen3_5 / qwen3_5_moe type instead, genai_image_text.py.)
    "qwen3_next": "qwen3", "qwen3_5_text": "qwen3", "qwen3_5": "qwen3", "qwen3_5_moe_text": "qwen3",
    "qwen3_5_moe": "qwen3", "lfm2": "lfm2", "lfm2_moe": "lfm2_moe", "granitemoehybrid": "granitemoehybrid",
    "nemotron_h": "decoder", "falcon_h1": "decoder",
    # DeepSeek-V3's latent attention caches one KV head of kv_lora_rank + qk_rope_head_dim (head_size in the config):
    # to genai a grouped-query decoder; the absorption is in the graph.
    "glm4_moe": "decoder", "deepseek_v3": "decoder", "ernie4_5_moe": "decoder", "llama4_text": "decoder",
    "deepseek_v2": "decoder", "glm4_moe_lite": "decoder",
    # The 2025-26 dense families: what differs from llama is in the graph (norm layouts, rotary pairing, query scales).
    "seed_oss": "decoder", "ernie4_5": "decoder", "olmo3": "decoder", "exaone4": "decoder", "ministral3": "decoder",
    "hunyuan_v1_dense": "decoder", "cohere2": "decoder", "apertus": "decoder",
    # Gemma 4: genai reads each cache's KV heads and head size off the graph's inputs (its per-layer KV shapes); the
    # per-layer inputs are computed in the graph from input_ids; the KV-shared layers are the last ones and carry no
    # cache, so genai's layers are the ones before them (_genai_layers).
    "gemma4_text": "decoder", "gemma4": "decoder",
}
# A graph traced by transformers.exporters (exporter/graph/traced.py) carries everything model-specific
# and takes the attn_dynamic contract's inputs, which genai's generic decoder feeds.
TRACED_GENAI_TYPE = "decoder"
# genai's own graph inputs: the ones its decoder state knows how to feed.
_GENAI_FED_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
_LAYER_MARK = 987654321  # an index no model has, replaced by %d to turn a cache name into genai's template
_STATIC_CACHE_REASON = (
    "attn_static reads write_indices and nonpad_kv_seqlen (int64 [batch]), which onnxruntime-genai never feeds: "
    "its decoder feeds input_ids, attention_mask, position_ids and the past/present caches only, also in its "
    "fixed-length cache mode; use the gqa or attn_dynamic variant to run in onnxruntime-genai"
)

# A cache whose values have a head size of their own (contract.VALUE_HEAD_DIM: transformers' latent-attention cache,
# traced). genai's DefaultKeyValueCache gives a layer's key and value one shape (decoder.head_size, or the key input's
# dims), which the graph refuses for the values ("Got invalid dimensions for input: past_key_values.0.value ... index:
# 3"; onnxruntime-genai 0.18, the genai gate on a package written anyway).
_SPLIT_CACHE_REASON = (
    "the export caches values {value} wide beside keys {key} wide (transformers' latent-attention cache: the normed "
    "latent as keys, the rotary key as values), and onnxruntime-genai allocates a layer's past and present keys and "
    "values with one shape (decoder.head_size, or the key input's dims), so it would feed values {key} wide, which "
    "the graph refuses; run it with exportfarm's runtime or transformers.js (the hf layout), or export the model "
    "type's hand-built graph where exportfarm has one (builder auto), which onnxruntime-genai runs"
)


@dataclasses.dataclass
class GenaiPackage:
    """What the genai part of packaging wrote, and whether onnxruntime-genai can load the folder."""

    files: list[str]  # written into the export directory: genai_config.json (when a package) + tokenizer files
    package: bool  # onnxruntime_genai.Model can load the folder and generate
    reason: str | None  # why it is not a package, or what a package lacks (no tokenizer); None when complete
    tokenizer_files: list[str]
    config: dict | None = None  # the genai_config.json written, if any
    special_tokens: dict = dataclasses.field(default_factory=dict)  # align_special_tokens' writes

    @property
    def tokenizer(self) -> str:
        return "copied" if self.tokenizer_files else "missing"

    def manifest_entry(self) -> dict:
        return {
            "package": self.package,
            "runtime": GENAI_RUNTIME if self.package else None,
            "reason": self.reason,
            "config": GENAI_CONFIG_FILE if self.config is not None else None,
            # what genai runs the folder as (its model.type: a text decoder type, or an image-text one such as qwen3_5)
            **({"model_type": self.config["model"]["type"]} if self.config is not None else {}),
            "files": list(self.files),
            "tokenizer": self.tokenizer,
            **({"special_tokens": self.special_tokens, "tokenizer_use": GENAI_TOKENIZER_USE}
               if self.special_tokens else {}),
        }


def write_genai_package(
    out_dir: Path,
    source_dir: Path,
    config: ModelConfig,
    variant: Variant,
    request: ExportRequest,
    input_names: Sequence[str],
    output_names: Sequence[str],
    traced: bool = False,
) -> GenaiPackage:
    """Copy the checkpoint's tokenizer files and, where genai can drive the graph, write genai_config.json.

    ``input_names`` / ``output_names`` are the built graph's: the config is checked against them, so a
    contract change can never leave a config that names inputs the model does not have. ``traced``: the
    graph was traced by transformers.exporters (genai's generic decoder type drives it).
    """
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    tokenizer_files = copy_tokenizer_files(source_dir, out_dir)
    reason = genai_unsupported_reason(config, variant, input_names, traced)
    if reason is None and not (request.max_seq_len or config.max_position_embeddings):
        # bloom's ALiBi has no position table, and genai needs a context length to size its search
        reason = ("the model sets no max_position_embeddings and the request no max_seq_len: onnxruntime-genai needs a "
                  "context length; export with max_seq_len (CLI --max-seq-len) for a genai package")
    if reason is not None:
        return GenaiPackage(list(tokenizer_files), False, reason, tokenizer_files)
    special, unusable = align_special_tokens(source_dir, out_dir) if tokenizer_files else ({}, None)
    genai_config = build_genai_config(config, variant, request, input_names, output_names, source_dir, traced)
    (out_dir / GENAI_CONFIG_FILE).write_text(json.dumps(genai_config, indent=4) + "\n")
    note = None
    if not tokenizer_files:
        note = (
            "the source checkpoint has no tokenizer files: onnxruntime_genai.Model loads and generates from "
            "token ids, but onnxruntime_genai.Tokenizer needs tokenizer.json (or tokenizer.model) and "
            "tokenizer_config.json in the folder"
        )
    elif "tokenizer_config.json" not in tokenizer_files or not {"tokenizer.json", "tokenizer.model"} & set(
        tokenizer_files
    ):
        note = "onnxruntime_genai.Tokenizer needs tokenizer_config.json and tokenizer.json (or tokenizer.model)"
    elif unusable:
        note = unusable
    return GenaiPackage([GENAI_CONFIG_FILE, *tokenizer_files], True, note, tokenizer_files, genai_config,
                        special_tokens=special)


# onnxruntime-extensions (genai's tokenizer) picks its tokenizer kernel by tokenizer_config.json's
# tokenizer_class, "Fast" suffix dropped: these names get its Unigram kernel, every other one its BPE
# kernel, which reads tokenizer.json's model.vocab as an object (a Unigram vocab is a list of pairs).
_GENAI_UNIGRAM_CLASSES = {"", "T5Tokenizer", "ChatGLMTokenizer", "XLMRobertaTokenizer", "MarianTokenizer",
                          "DebertaV2Tokenizer", "SentencePieceBackend"}
# How genai's tokenizer is called to give transformers' ids (genai builds it with special tokens off).
GENAI_TOKENIZER_USE = (
    "onnxruntime-genai encodes without special tokens by default: for plain text call "
    "tokenizer.update_options(add_special_tokens=True) first (this package's tokenizer_config.json says which "
    "ones transformers adds); for chat, render with tokenizer.apply_chat_template and encode with the default"
)


def align_special_tokens(source_dir: Path, out_dir: Path) -> tuple[dict, str | None]:
    """Make the package's tokenizer add the special tokens transformers' tokenizer adds, for
    onnxruntime-genai: (what was written, why genai cannot use the tokenizer or None).

    genai's tokenizer (onnxruntime-extensions) decides BOS / EOS from tokenizer_config.json's
    ``add_bos_token`` / ``add_eos_token`` and ``bos_token`` / ``eos_token`` where they are booleans
    and strings, else by looking for the token's text in tokenizer.json's post-processor, else by
    the tokenizer class; transformers (5.x) follows the post-processor. The two disagree where a
    checkpoint's config says one thing and its post-processor another (a real gemma3_text's BOS).
    What transformers' tokenizer does is observed (a text encoded with and without special tokens)
    and written as explicit booleans and token texts into the package's tokenizer_config.json, and
    where it adds no BOS (EOS) while the post-processor still names that token, the post-processor's
    template is written without it (genai would add it back). A Unigram tokenizer.json under a
    class genai reads as BPE cannot load in genai at all ("type must be object, but is array"):
    that is returned as the reason, files untouched."""
    config_path, json_path = out_dir / "tokenizer_config.json", out_dir / "tokenizer.json"
    if not config_path.is_file():
        return {}, None
    config, tokenizer_json = _read_json(config_path), _read_json(json_path)
    if not config:
        return {}, "tokenizer_config.json is not a JSON object this packager can read: left as the checkpoint has it"
    model_type = (tokenizer_json.get("model") or {}).get("type")
    tokenizer_class = str(config.get("tokenizer_class") or "")
    if model_type not in (None, "BPE") and tokenizer_class.removesuffix("Fast") not in _GENAI_UNIGRAM_CLASSES:
        return {}, (f"onnxruntime-genai cannot load this tokenizer: tokenizer.json holds a {model_type} model, and "
                    f"tokenizer_class {tokenizer_class or '(none)'} makes genai read it as BPE ('type must be object, "
                    "but is array'); re-save the tokenizer with transformers 5 (which writes it as BPE), or "
                    "tokenize with transformers and feed genai token ids")
    from exporter.validation import text

    try:
        # the one validation's gates use too (kept while the files are unchanged: loaded once)
        hf = text.load_tokenizer(source_dir)
        if hf is None:  # vocab.json / merges.txt only
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(source_dir))
    except Exception as err:  # the package still carries the files; the genai gate reports what loads
        return {}, f"transformers cannot load the checkpoint's tokenizer ({str(err).splitlines()[0][:160]})"
    added = text.added_special_ids(hf)
    if added is None or len(added[0]) > 1 or len(added[1]) > 1:
        said = "tokens inside the text" if added is None else f"{added[0]} before and {added[1]} after a text"
        return {}, (f"transformers' tokenizer adds {said}: genai's tokenizer can add one BOS and one EOS only; "
                    "tokenize with transformers and feed genai token ids")
    prefix, suffix = added
    written = {"add_bos_token": bool(prefix), "add_eos_token": bool(suffix)}
    if prefix:
        written["bos_token"] = hf.convert_ids_to_tokens(prefix[0])
    if suffix:
        written["eos_token"] = hf.convert_ids_to_tokens(suffix[0])
    config.update(written)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    processor = tokenizer_json.get("post_processor")
    named = json.dumps(processor, ensure_ascii=False) if processor else ""
    drop = [t for t, added in ((hf.bos_token, prefix), (hf.eos_token, suffix)) if t and not added and t in named]
    if drop:
        changed = _without_tokens(processor, set(drop))
        if changed != processor:
            tokenizer_json["post_processor"] = changed
            json_path.write_text(json.dumps(tokenizer_json, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
            written["post_processor_dropped"] = sorted(drop)
    return written, None


def _without_tokens(processor: dict, tokens: set[str]) -> dict:
    """A tokenizer.json post-processor with ``tokens`` taken out of its templates (inside a Sequence,
    each step); other processors as they are."""
    if processor.get("type") == "Sequence":
        return {**processor, "processors": [_without_tokens(p, tokens) for p in processor.get("processors", [])]}
    if processor.get("type") != "TemplateProcessing":
        return processor
    out = dict(processor)
    for key in ("single", "pair"):
        out[key] = [piece for piece in processor.get(key, [])
                    if not (isinstance(piece, dict) and piece.get("SpecialToken", {}).get("id") in tokens)]
    out["special_tokens"] = {k: v for k, v in processor.get("special_tokens", {}).items() if k not in tokens}
    return out


def copy_tokenizer_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files present in ``source_dir``; returns their names (sorted). Each must
    really be inside the checkpoint (``checkpoint_file``): the copies are published."""
    names = tokenizer_file_names(source_dir)
    for name in names:
        shutil.copyfile(checkpoint_file(source_dir, name), out_dir / name)
    return names


def genai_unsupported_reason(config: ModelConfig, variant: Variant, input_names: Sequence[str],
                             traced: bool = False) -> str | None:
    """Why onnxruntime-genai cannot run this graph, or None when it can."""
    if variant is Variant.ATTN_STATIC:
        return _STATIC_CACHE_REASON
    if config.architecture not in GENAI_MODEL_TYPES and not traced:
        return f"onnxruntime-genai has no decoder model type for {config.architecture!r}"
    if config.value_size != config.kv_size:
        return _SPLIT_CACHE_REASON.format(value=config.value_head_dim, key=config.head_dim)
    past_key, past_value, _, _ = _cache_templates(variant)
    cached = _cache_layers(config)
    if cached != list(config.attention_layers) and cached != list(range(len(cached))):
        return (f"layers {sorted(set(config.attention_layers) - set(cached))} read other layers' keys and values and "
                "carry no cache, and they are not the last layers: onnxruntime-genai numbers a model's caches 0..n-1")
    fed = set(_GENAI_FED_INPUTS)
    fed.update(t % i for t in (past_key, past_value) for i in cached)
    fed.update(t % i for t, _ in _state_templates(config).values() for i in range(config.num_layers) if config.is_recurrent(i))
    unfed = [name for name in input_names if name not in fed]
    if unfed:
        return f"graph inputs {', '.join(unfed)} are not ones onnxruntime-genai feeds"
    return None


def _cache_layers(config: ModelConfig) -> list[int]:
    """The attention layers with a KV cache of their own (not gemma4's KV-shared ones)."""
    return [i for i in config.attention_layers if config.has_cache(i)]


def _genai_layers(config: ModelConfig) -> int:
    """genai's num_hidden_layers: the layers whose caches it feeds (past_key_values.0 .. n-1); where the last layers
    share earlier layers' keys and values and carry none (gemma4), the layers before them."""
    cached = _cache_layers(config)
    return len(cached) if cached != list(config.attention_layers) else config.num_layers


def build_genai_config(
    config: ModelConfig,
    variant: Variant,
    request: ExportRequest,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source_dir: Path,
    traced: bool = False,
) -> dict:
    """The genai_config.json of a ``gqa`` / ``attn_dynamic`` export (keys as onnxruntime-genai's config.cpp reads)."""
    past_key, past_value, present_key, present_value = _cache_templates(variant)
    for template, names in ((past_key, input_names), (past_value, input_names),
                            (present_key, output_names), (present_value, output_names)):
        missing = [template % i for i in _cache_layers(config) if template % i not in names]
        if missing:
            raise AssertionError(f"graph contract and genai config disagree: {missing} not in the graph")
    inputs = {name: name for name in _GENAI_FED_INPUTS if name in input_names}
    inputs.update(past_key_names=past_key, past_value_names=past_value)
    outputs = {"logits": LOGITS, "present_key_names": present_key, "present_value_names": present_value}
    for kind, (past, present) in _state_templates(config).items():  # a hybrid's recurrent states
        recurrent = [i for i in range(config.num_layers) if config.is_recurrent(i)]
        missing = [t % i for t, names in ((past, input_names), (present, output_names)) for i in recurrent
                   if t % i not in names]
        if missing:
            raise AssertionError(f"graph contract and genai config disagree: {missing} not in the graph")
        key = CONV_STATE if kind == CONV_STATE else RECURRENT_STATE  # genai's one key for a state matrix (ssm too)
        inputs[f"past_{key}_names"], outputs[f"present_{key}_names"] = past, present
    # The rotary tables are baked for this many positions: genai must not run past them.
    context_length = request.max_seq_len or config.max_position_embeddings
    generation = _read_checkpoint_json(source_dir, GENERATION_CONFIG_FILE)
    bos, eos, pad = special_token_ids(source_dir, generation)
    provider_options = []
    if request.ep is EP.CUDA:
        # CUDA graph capture stays off: genai then feeds a max_length-wide mask, which only a graph
        # built for it handles, and attn_dynamic's growing caches cannot be captured at all.
        provider_options.append({"cuda": {"enable_cuda_graph": "0"}})
    model = {
        "type": TRACED_GENAI_TYPE if traced else GENAI_MODEL_TYPES[config.architecture],
        "context_length": context_length,
        "vocab_size": config.vocab_size,
    }
    if bos is not None:
        model["bos_token_id"] = bos
    if eos:
        model["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        model["pad_token_id"] = pad
    session_options = {"log_id": "onnxruntime-genai", "provider_options": provider_options}
    if request.ep is EP.CPU:
        session_options["intra_op_num_threads"] = CPU_INTRA_OP_THREADS
    model["decoder"] = {
        "session_options": session_options,
        "filename": MODEL_FILE,
        "head_size": config.head_dim,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": _genai_layers(config),
        "num_key_value_heads": config.num_kv_heads,
        "inputs": inputs,
        "outputs": outputs,
    }
    if config.recurrent is not None and config.recurrent.kind not in (GATED_DELTANET, MAMBA2):
        # genai's conv-only cache (LFM2): every layer not full_attention carries past_conv_names.
        model["decoder"]["layer_types"] = list(config.layer_types)
        model["decoder"]["conv_cache_size"] = config.recurrent.conv_state
    return {"model": model, "search": search_defaults(generation, variant, context_length)}


# A CPU package's intra-op thread count: 0 hands the choice to onnxruntime (one thread per physical
# core). Left unset, onnxruntime-genai uses half the logical CPUs (at most 16), which assumes two
# hardware threads per core: on a machine with one per core (many cloud VMs; this project's 2-core CI
# machine) that is half the cores. SmolLM2-135M int4 through genai's generator there: 7.2-7.9 ms/token
# with 0 against 10.3 unset, and the genai builder's own package alike (7.3 vs 10.3;
# benchmarks/results/cpu_matrix.json has both ways for both packages). On two threads per core the
# two counts are the same; past 16 physical cores onnxruntime's is larger than genai's cap (not measured).
CPU_INTRA_OP_THREADS = 0


def search_defaults(generation: dict, variant: Variant, context_length: int) -> dict:
    """genai's search section: the checkpoint's generation_config.json where it says, genai's defaults elsewhere."""

    def pick(key, default, kind):
        value = generation.get(key)
        return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    early_stopping = generation.get("early_stopping")
    return {
        "do_sample": bool(generation.get("do_sample", False)),
        "num_beams": pick("num_beams", 1, int),
        "num_return_sequences": pick("num_return_sequences", 1, int),
        "temperature": pick("temperature", 1.0, float),
        "top_k": pick("top_k", 50, int),
        "top_p": pick("top_p", 1.0, float),
        "repetition_penalty": pick("repetition_penalty", 1.0, float),
        "no_repeat_ngram_size": pick("no_repeat_ngram_size", 0, int),
        "length_penalty": pick("length_penalty", 1.0, float),
        "diversity_penalty": pick("diversity_penalty", 0.0, float),
        "early_stopping": early_stopping if isinstance(early_stopping, bool) else True,
        "min_length": pick("min_length", 0, int),
        # generation_config's max_length (often a default 20) is not the model's limit; the context is.
        "max_length": context_length,
        # GroupQueryAttention reads and writes one max_length buffer in place; attn_dynamic's present
        # is past concatenated with the new keys, so it needs a fresh, longer buffer every step.
        "past_present_share_buffer": variant is Variant.GQA,
    }


def special_token_ids(source_dir: Path, generation: dict | None = None) -> tuple[int | None, list[int], int | None]:
    """(bos, eos list, pad) as transformers' generate would use them.

    generation_config.json first, then config.json, then the tokenizer's own tokens. Where
    generation_config.json names no eos, the tokenizer's eos_token is added: chat models end a turn
    with it while config.json often names only the pretraining end-of-text token.
    """
    generation = _read_checkpoint_json(source_dir, GENERATION_CONFIG_FILE) if generation is None else generation
    config = _read_checkpoint_json(source_dir, "config.json")
    config = {**config.get("text_config", {}), **config}

    def first(key):
        for source in (generation, config):
            if source.get(key) is not None:
                return source[key]
        return _tokenizer_token_id(source_dir, key.removesuffix("_id"))

    eos = first("eos_token_id")
    eos = [int(e) for e in eos] if isinstance(eos, list) else [] if eos is None else [int(eos)]
    if generation.get("eos_token_id") is None:
        turn_end = _tokenizer_token_id(source_dir, "eos_token")
        if turn_end is not None and turn_end not in eos:
            eos.append(turn_end)
    bos, pad = first("bos_token_id"), first("pad_token_id")
    if pad is None and eos:
        pad = eos[0]  # genai pads batches with it; any id works under the attention mask
    return (None if bos is None else int(bos)), eos, (None if pad is None else int(pad))


def _tokenizer_token_id(source_dir: Path, name: str) -> int | None:
    """The id of tokenizer_config.json's ``name`` (bos_token, eos_token, ...) in tokenizer.json, if both say."""
    token = _read_checkpoint_json(source_dir, "tokenizer_config.json").get(name)
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tokenizer = _read_checkpoint_json(source_dir, "tokenizer.json")
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    return None


def _state_templates(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """A hybrid's recurrent states as genai's templates: kind -> (past, present); {} for a transformer.
    (genai's keys: past_conv_names / past_recurrent_names and their present_* twins.)"""
    if config.recurrent is None:
        return {}
    kinds = [CONV_STATE] + ([RECURRENT_STATE] if config.recurrent.kind == GATED_DELTANET else
                            [SSM_STATE] if config.recurrent.kind == MAMBA2 else [])
    return {kind: tuple(name.replace(str(_LAYER_MARK), "%d") for name in state_names(_LAYER_MARK, kind)) for kind in kinds}


def _cache_templates(variant: Variant) -> tuple[str, str, str, str]:
    """The cache names of docs/graph-contracts.md as genai's %d templates (past key, past value, present ...)."""
    return tuple(name.replace(str(_LAYER_MARK), "%d") for name in cache_names(variant, _LAYER_MARK))


def _read_checkpoint_json(source_dir: Path, name: str) -> dict:
    """A JSON file of the checkpoint as ``_read_json`` reads it ({} where absent), opened through the
    checkpoint's guard: what it says is written into genai_config.json, which is published."""
    path = checkpoint_file(source_dir, name, required=False)
    return {} if path is None else _read_json(path)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
