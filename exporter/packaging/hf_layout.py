"""The Hugging Face repository layout that transformers.js and optimum read, made from a finished export.

A farm export keeps ``model.onnx`` + ``model.onnx.data`` at its root (what validation, the benchmark
and onnxruntime-genai read). transformers.js and optimum's ORTModelForCausalLM read a model repository
instead (README "For transformers.js and optimum"):

- ``config.json`` and ``generation_config.json`` of the checkpoint, its tokenizer files and chat template;
- ``onnx/model{suffix}.onnx`` named by dtype as transformers.js names them (``""`` fp32, ``_fp16``,
  ``_q4`` int4 with fp32 activations, ``_q4f16`` int4 with fp16 ones, ``_int8``);
- the weights beside it as ``<file>_data``: transformers.js fetches external data only under that
  name, and only when ``config.json``'s ``transformers.js_config.use_external_data_format`` names
  the file (one chunk here).

Only attn_dynamic exports are laid out: both consumers feed ``attention_mask`` / ``position_ids``
and past / present caches and left-pad a batch. A gqa export's GroupQueryAttention reads right
padding (a left-padded row comes out silently wrong) and neither consumer drives attn_static's
static caches, so those are refused with the reason.

Nothing is re-exported: the graph is the validated one with its external-data locations renamed,
and the weights file is moved (``export --layout hf``), copied (``exportfarm layout hf``) or, in a
worker that only uploads the result, hard-linked (onnx's checker refuses external data with several
links, so never where the source export is checked again), so its bytes and sha256 are the export's. The layout's ``manifest.json`` is the export's with ``layout`` added and ``files`` listing
what this folder holds.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import onnx
from onnx.external_data_helper import _get_all_tensors  # every tensor of the graph and its subgraphs

from exporter.contract import (
    BUILDER_TRACED, DATA_FILE, GENAI_CONFIG_FILE, IMAGE_TEXT_TASK, LOGITS, MANIFEST_CACHE, MANIFEST_FILE, MODEL_FILE,
    split_cache,
)
from exporter.errors import ExportError
from exporter.graph.config import LATENT_TYPES
from exporter.packaging.package import file_entry
from exporter.packaging.source_files import checkpoint_file, side_file_names

LAYOUT = "hf"
ONNX_DIR = "onnx"
CONFIG_FILE = "config.json"
# (weight dtype, activation dtype of the graph's logits) -> transformers.js's file suffix (its dtype name)
SUFFIX = {
    ("fp32", "FLOAT"): ("", "fp32"),
    ("fp16", "FLOAT16"): ("_fp16", "fp16"),
    ("int4", "FLOAT"): ("_q4", "q4"),
    ("int4", "FLOAT16"): ("_q4f16", "q4f16"),
    ("int8", "FLOAT"): ("_int8", "int8"),
}
VARIANT_REASONS = {
    "gqa": "a gqa export's GroupQueryAttention expects right padding, and transformers.js and optimum left-pad "
           "a batch (a padded row would come out silently wrong): export --variant attn_dynamic for the hf layout",
    "attn_static": "neither transformers.js nor optimum drives attn_static's fixed caches (write_indices, "
                   "nonpad_kv_seqlen): export --variant attn_dynamic for the hf layout",
}


def check_request(dtype: str, variant: str, ep: str | None = None) -> None:
    """Refuse, before any work, a request the hf layout cannot hold. The activation dtype of a cuda int4
    export is measured on the checkpoint (fp16 where its activations fit, else refused for this layout:
    activation_range.choose_activations); hf_file_names checks the built graph before validating it."""
    if variant in VARIANT_REASONS:
        raise ExportError(f"no hf layout for a {variant} export: {VARIANT_REASONS[variant]}")
    if dtype not in {d for d, _ in SUFFIX}:
        raise ExportError(f"transformers.js has no file name for {dtype} weights: the hf layout takes "
                          f"{', '.join(sorted({d for d, _ in SUFFIX}))}")
    if dtype == "int8" and ep == "cuda":
        raise ExportError("transformers.js names int8 weights only with fp32 activations (model_int8.onnx), and an "
                          "int8 cuda export computes in fp16 / bf16: export int8 for ep cpu, or int4 for cuda "
                          "(model_q4f16.onnx), for the hf layout")


def hf_file_names(manifest: dict) -> tuple[str, str, str]:
    """(``onnx/model{suffix}.onnx``, its ``_data`` file, transformers.js's dtype name) of an export, or
    ExportError naming why it has no place in the layout."""
    request = manifest["request"]
    check_request(request["dtype"], manifest.get("variant") or request["variant"])
    if (manifest.get("op_census") or {}).get("com.microsoft::GatedDeltaNet"):
        raise ExportError("this export runs gated DeltaNet on GatedDeltaNet, which onnxruntime-node 1.30 (what "
                          "transformers.js 4.3 runs on) has no kernel for: export it with layout hf (CLI --layout hf), "
                          "which runs the recurrence on LinearAttention")
    if (manifest.get("op_census") or {}).get("com.microsoft::MoEGroupRouter"):
        raise ExportError("this export routes its experts on MoEGroupRouter, which onnxruntime-node 1.30 (what "
                          "transformers.js 4.3 runs on) has no kernel for: export it with layout hf (CLI --layout hf), "
                          "which routes in standard ops")
    logits = next((o for o in manifest["graph"]["outputs"] if o["name"] == LOGITS), None)
    key = (request["dtype"], logits["dtype"] if logits else None)
    if key not in SUFFIX:
        known = ", ".join(f"{d} with {a.lower()} activations" for d, a in SUFFIX)
        raise ExportError(f"transformers.js has no file name for {key[0]} weights with {str(key[1]).lower()} "
                          f"activations (it names {known}): export one of those for the hf layout")
    suffix, dtype = SUFFIX[key]
    model = f"model{suffix}.onnx"
    return f"{ONNX_DIR}/{model}", f"{ONNX_DIR}/{model}_data", dtype


WEIGHTS_MODES = ("copy", "move", "link")


def _carry_weights(src: Path, dst: Path, mode: str) -> None:
    """Copy, move or hard-link the weights. A link only where nothing checks either folder with onnx's
    checker while both exist: it refuses external data with more than one link (it reads it as a
    hard-link attack). A filesystem without hard links gets a copy."""
    if mode == "move":
        os.replace(src, dst)
    elif mode == "link":
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    else:
        shutil.copyfile(src, dst)


def relocate_weights(model: onnx.ModelProto, old: str, new: str, src: Path) -> None:
    """Every external tensor of ``model`` (read from ``src``) moved from data file ``old`` to ``new``: the proto's
    ``location`` entries only, no weight is read. ExportError where a tensor lives elsewhere or none is external."""
    renamed = 0
    for tensor in _get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location":
                if entry.value != old:
                    raise ExportError(f"{src} keeps weights in {entry.value!r}, not {old!r}: not a farm export")
                entry.value = new
                renamed += 1
    if not renamed:
        raise ExportError(f"{src} has no external weights to relocate: not a farm export")


def _relocated_graph(src: Path, dst: Path, old: str, new: str) -> None:
    """model.onnx with every external tensor's ``location`` renamed."""
    model = onnx.load(str(src), load_external_data=False)
    relocate_weights(model, old, new, src)
    onnx.save(model, str(dst))


def write_hf_layout(export_dir: Path, out_dir: Path, checkpoint_dir: Path, *, weights: str = "copy") -> dict:
    """Lay the export in ``export_dir`` out as a Hugging Face model repository in ``out_dir`` (new or
    empty). ``checkpoint_dir``: the checkpoint it was exported from (config.json, generation_config.json,
    tokenizer files). The weights file is copied; ``weights`` "move" moves it (the pipeline's staged
    export, dropped afterwards), "link" hard-links it (a worker's export, read by nothing but the
    upload). Written beside ``out_dir`` and renamed into place at the end, so a failure leaves nothing
    behind. Returns the layout's manifest."""
    export_dir, out_dir, checkpoint_dir = Path(export_dir), Path(out_dir), Path(checkpoint_dir)
    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {WEIGHTS_MODES}, got {weights!r}")
    manifest = check_export(export_dir)
    model_name, data_name, dtype = hf_file_names(manifest)
    if checkpoint_file(checkpoint_dir, CONFIG_FILE, required=False) is None:
        raise ExportError(f"{checkpoint_dir} has no {CONFIG_FILE}: pass the checkpoint the export was made from")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory: choose a new directory")
    data_entry = manifest["files"][DATA_FILE]
    if (export_dir / DATA_FILE).stat().st_size != data_entry["size"]:
        raise ExportError(f"{export_dir / DATA_FILE} is {(export_dir / DATA_FILE).stat().st_size} bytes, its manifest "
                          f"says {data_entry['size']}: the export was changed after it was written")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.hf-partial-{uuid.uuid4().hex[:8]}")
    try:
        if manifest.get("task") == IMAGE_TEXT_TASK:  # three sessions (exporter/packaging/hf_image_text.py)
            from exporter.packaging.hf_image_text import write_image_text_layout

            suffix = Path(model_name).stem.removeprefix("model")
            layout_manifest = write_image_text_layout(export_dir, staging, checkpoint_dir, manifest, suffix, weights)
        else:
            layout_manifest = _write(export_dir, staging, checkpoint_dir, manifest, model_name, data_name, dtype,
                                     weights)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return layout_manifest


# Families transformers.js 4.3 cannot drive as a text decoder (model.onnx alone): its Qwen3.5 classes
# compute M-RoPE position ids [3, batch, seq] from config.vision_config for every prompt (a text graph
# takes [batch, seq], and a text checkpoint has no vision_config: "Cannot read properties of undefined
# (reading 'spatial_merge_size')"), and it has no qwen3_5_moe_text model type at all. A qwen3_5 image-text
# checkpoint is exported as its image-text classes load it (graph/language_model.py IMAGE_TEXT_HYBRIDS); what stays
# refused is a text decoder of it (the farm export of its language model alone, as earlier exportfarm versions wrote
# it, laid out afterwards); a farm image-text export of it laid out afterwards is refused for its GatedDeltaNet.
TRANSFORMERSJS_REFUSES = {
    t: "transformers.js 4.3 drives Qwen3.5 only through its image-text classes (M-RoPE position ids from "
       "config.vision_config, embed_tokens + decoder_model_merged files), not a text decoder's model.onnx"
    for t in ("qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")}
TRANSFORMERSJS_REFUSES["qwen3_5"] = (
    TRANSFORMERSJS_REFUSES["qwen3_5_text"] + " (export the checkpoint with layout hf: the vision, embedding and "
    "M-RoPE decoder graphs those classes load are built then)")
TRANSFORMERSJS_REFUSES["granitemoehybrid"] = (
    "transformers.js 4.3 names Granite 4.0-H's states from the legacy layer types (mamba / attention), which "
    "transformers 5 rewrites to linear_attention / full_attention, so it feeds none of them")
TRANSFORMERSJS_REFUSES["falcon_h1"] = (
    "transformers.js 4.3 names Falcon-H1's states from legacy layer types (mamba / attention), where transformers 5 "
    "writes every layer as hybrid, so it feeds none of them")
TRANSFORMERSJS_REFUSES["nemotron_h"] = (
    "transformers.js 4.3 names Nemotron-H's states from legacy layer types (mamba / attention) in layers_block_type, "
    "which transformers 5 writes as linear_attention / full_attention / mlp / moe (and the checkpoints as "
    "hybrid_override_pattern, where it gives every block a KV cache and a state), so it feeds none of them")

# The 2025-26 families transformers.js 4.3 has no model class for ("Unsupported model type"), the latent-attention
# ones among them. deepseek_v3's it has: it allocates each empty past from the graph's own declared input dims
# (addPastKeyValues reads session.inputMetadata), so the hand-built graph's latent cache (one KV head of kv_lora_rank +
# qk_rope_head_dim) runs there (tests/test_hf_layout.py), and the traced graph's two head sizes too (SPLIT_CACHE_TYPES);
# optimum sizes every past per head from config.json and runs neither (LATENT_OPTIMUM, SPLIT_CACHE_OPTIMUM).
for _type in ("glm4_moe", "seed_oss", "exaone4", "ernie4_5_moe", "deepseek_v2", "glm4_moe_lite"):
    TRANSFORMERSJS_REFUSES[_type] = f"transformers.js 4.3 has no {_type} model (\"Unsupported model type\")"
LATENT_OPTIMUM = (
    "optimum's ORTModelForCausalLM sizes every empty past (batch, num_key_value_heads, 0, hidden_size / "
    "num_attention_heads) from config.json, where this export caches multi-head latent attention's latent as one KV "
    "head of kv_lora_rank + qk_rope_head_dim")

TRANSFORMERSJS_REFUSES["gemma4_text"] = (
    "transformers.js 4.3 feeds a cache to every layer, all alike in size from config.json (getKeyValueShapes), "
    "while Gemma 4's global layers have their own head size and KV heads and its KV-shared layers take no cache")
TRANSFORMERSJS_REFUSES["gemma4"] = TRANSFORMERSJS_REFUSES["gemma4_text"]  # its language model, exported alone

# A graph traced by transformers.exporters caches what transformers caches; for latent attention that is the normed
# latent as keys and the rotary key as values, two head sizes (contract.VALUE_HEAD_DIM). transformers.js 4.3 allocates
# each empty past from the graph's own declared input dims (addPastKeyValues reads session.inputMetadata; the names
# from the config's layer count), so it runs such a cache for the model types it has a class for: these (checked under
# Node, tests/test_traced.py). optimum's ORTModelForCausalLM sizes every past alike from config.json and cannot.
SPLIT_CACHE_TYPES = ("deepseek_v3",)
SPLIT_CACHE_OPTIMUM = (
    "optimum's ORTModelForCausalLM sizes every empty past (batch, num_key_value_heads, 0, hidden_size / "
    "num_attention_heads) from config.json, one shape for keys and values, where this export caches values of "
    "another head size than its keys")
TRANSFORMERSJS_CONSUMER = "transformers.js >= 4 on onnxruntime-node / -web"
OPTIMUM_CONSUMER = "optimum ORTModelForCausalLM"


def split_cache_reason(model_type: str | None) -> str | None:
    """Why transformers.js cannot run a cache of two head sizes for ``model_type`` (None: it can)."""
    if model_type in SPLIT_CACHE_TYPES:
        return None
    return (f"this export caches keys and values of two head sizes, which transformers.js 4.3 allocates from the "
            f"graph's own dims for the model types it has a class for ({', '.join(SPLIT_CACHE_TYPES)}), and it has no "
            f"{model_type} model (\"Unsupported model type\"); {SPLIT_CACHE_OPTIMUM}")


def check_family(checkpoint_dir: Path, builder: str | None = None) -> None:
    """ExportError when transformers.js cannot drive the checkpoint's family (TRANSFORMERSJS_REFUSES) as ``builder``
    builds it (contract.BUILDER_TRACED: transformers.exporters' graph, whose cache is transformers' own)."""
    path = checkpoint_file(checkpoint_dir, CONFIG_FILE, required=False)
    if path is not None:
        from exporter.graph.language_model import image_text_type

        model_type = image_text_type(checkpoint_dir)
        _checked_config(json.loads(path.read_text()), image_text=bool(model_type), traced=builder == BUILDER_TRACED)
        if model_type:  # an image-text checkpoint: its family and its processor (hf_image_text.py)
            from exporter.packaging.hf_image_text import check_image_text_checkpoint

            check_image_text_checkpoint(checkpoint_dir, model_type)


def _checked_config(config: dict, image_text: bool = False, traced: bool = False) -> dict:
    """``config`` where transformers.js drives its family, else ExportError; ``image_text``: for an image-text export
    (its vision, embedding and decoder graphs), which a qwen3_5 checkpoint's layout is; ``traced``: for a graph traced
    by transformers.exporters, whose latent-attention cache is transformers' (split_cache_reason), not the hand-built
    graph's that TRANSFORMERSJS_REFUSES names."""
    from exporter.graph.language_model import IMAGE_TEXT_HYBRIDS

    model_type = config.get("model_type")
    if traced and model_type in LATENT_TYPES:
        reason = split_cache_reason(model_type)
        if reason:
            raise ExportError(f"no hf layout for a traced {model_type} model: {reason}; use the farm layout "
                              "(exportfarm's runtime runs it)")
        return config
    reason = TRANSFORMERSJS_REFUSES.get(model_type)
    if reason and not (image_text and model_type in IMAGE_TEXT_HYBRIDS):
        raise ExportError(f"no hf layout for a {config['model_type']} model: {reason}; use the farm layout (onnxruntime-"
                          "genai runs it)")
    return config


def check_cache(manifest: dict, checkpoint_dir: Path) -> None:
    """ExportError when the built export caches keys and values of two head sizes (its manifest's
    contract.MANIFEST_CACHE) for a model type transformers.js has no class for (split_cache_reason)."""
    if not split_cache(manifest.get(MANIFEST_CACHE) or {}):
        return
    model_type = json.loads(checkpoint_file(checkpoint_dir, CONFIG_FILE).read_text()).get("model_type")
    reason = split_cache_reason(model_type)
    if reason:
        raise ExportError(f"no hf layout for this {model_type} export: {reason}; use the farm layout (exportfarm's "
                          "runtime runs it)")


def check_export(export_dir: Path) -> dict:
    """The manifest of a farm-layout export, or ExportError saying what ``export_dir`` is instead."""
    manifest_path = export_dir / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest.get("layout", {}).get("kind") == LAYOUT:
        raise ExportError(f"{export_dir} is already in the hf layout")
    if not manifest or not (export_dir / MODEL_FILE).is_file():
        raise ExportError(f"{export_dir} is not a farm export (no {MANIFEST_FILE} / {MODEL_FILE} at its root)")
    hf_file_names(manifest)
    return manifest


def _write(export_dir: Path, out_dir: Path, checkpoint_dir: Path, manifest: dict, model_name: str, data_name: str,
           dtype: str, weights: str) -> dict:
    (out_dir / ONNX_DIR).mkdir(parents=True)
    _relocated_graph(export_dir / MODEL_FILE, out_dir / model_name, DATA_FILE, Path(data_name).name)
    _carry_weights(export_dir / DATA_FILE, out_dir / data_name, weights)
    traced = (manifest.get("builder") or {}).get("name") == BUILDER_TRACED
    config = _checked_config(json.loads(checkpoint_file(checkpoint_dir, CONFIG_FILE).read_text()), traced=traced)
    check_cache(manifest, checkpoint_dir)
    js_config = dict(config.get("transformers.js_config") or {})
    external = dict(js_config.get("use_external_data_format") or {})
    external[Path(model_name).name] = 1
    js_config.update(use_external_data_format=external, dtype=dtype)
    if dtype in ("fp16", "q4f16"):  # the caches' dtype: transformers.js 3 makes the empty past float32 unless told
        js_config["kv_cache_dtype"] = {**(js_config.get("kv_cache_dtype") or {}), dtype: "float16"}
    config["transformers.js_config"] = js_config
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    files = [model_name, data_name, CONFIG_FILE]

    def carry(source: Path, name: str) -> None:
        """Copy one more file in under its own name: never over one written here, never outside."""
        if name in files or name in (MANIFEST_FILE, GENAI_CONFIG_FILE) or "/" in name or name.startswith("."):
            return
        shutil.copy2(source, out_dir / name)
        files.append(name)

    # The export's tokenizer files (a genai package's tokenizer_config.json carries the special-token flags
    # genai reads; transformers reads them too) and its reports, then what else the checkpoint has.
    for name in manifest["files"]:
        if name not in (MODEL_FILE, DATA_FILE) and (export_dir / name).is_file():
            carry(export_dir / name, name)
    # Every one through the checkpoint's guard: a generation_config.json linked to /proc/self/environ
    # would publish the worker's environment. Refused rather than skipped, as the genai package
    # refuses its tokenizer files: a file the checkpoint names but the layout silently lacks
    # changes what its consumers do, with no word why.
    for name in side_file_names(checkpoint_dir):
        carry(checkpoint_file(checkpoint_dir, name), name)
    layout_manifest = dict(manifest)
    split = split_cache(manifest.get(MANIFEST_CACHE) or {})
    # not optimum's: keys and values of two head sizes (contract.VALUE_HEAD_DIM), or the hand-built latent cache
    not_optimum = (SPLIT_CACHE_OPTIMUM if split else LATENT_OPTIMUM if config.get("model_type") in LATENT_TYPES
                   else None)
    layout_manifest["layout"] = {
        "kind": LAYOUT, "model_file": model_name, "data_file": data_name, "transformers_js_dtype": dtype,
        "from_export": {"export_id": manifest.get("export_id"),
                        "files": {n: manifest["files"][n] for n in (MODEL_FILE, DATA_FILE)}},
        "consumers": [TRANSFORMERSJS_CONSUMER] + ([] if not_optimum else [OPTIMUM_CONSUMER])
                     + (["transformers.js 3 (onnxruntime 1.21)"] if manifest["request"].get("compat") else []),
        # transformers.js sizes each past from the graph; optimum from config.json
        **({"not_for": {OPTIMUM_CONSUMER: not_optimum}} if not_optimum else {}),
    }
    layout_manifest["genai"] = {"package": False, "reason": "the hf layout is not an onnxruntime-genai package (no "
                                "genai_config.json); export with the farm layout for onnxruntime-genai"}
    # The weights are the export's bytes (moved or copied, size checked): their entry is the export's.
    layout_manifest["files"] = {name: manifest["files"][DATA_FILE] if name == data_name else file_entry(out_dir / name)
                                for name in files}
    (out_dir / MANIFEST_FILE).write_text(json.dumps(layout_manifest, indent=2) + "\n")
    return layout_manifest
