"""The hf layout of an image-text export: the three sessions transformers.js 4.x's image-text-to-text
models load, made from a finished export (vision.onnx, embedding.onnx, model.onnx) and the checkpoint's
own processor.

transformers.js 4.3.2 (models/modeling_utils.js, image_text_to_text_forward) runs, per prompt:
``embed_tokens`` on ``input_ids`` alone, ``vision_encoder`` on ``pixel_values`` (its features of any rank
flattened to [-1, hidden]), the merge in JavaScript (the k-th image token takes feature row k, counts must
match), then ``decoder_model_merged`` on ``inputs_embeds``, ``attention_mask``, ``position_ids`` only where
declared, and the caches; every decode step's token through ``embed_tokens`` again. So:

- ``onnx/vision_encoder{suffix}.onnx``: the export's vision graph, its weights moved under the new name.
- ``onnx/embed_tokens{suffix}.onnx``: built here from the embedding graph's table (the same bytes, moved),
  ``input_ids`` only, gemma3's sqrt(hidden) scale the embedding graph's own constant. The export's
  embedding graph takes ``image_features`` too, which transformers.js refuses ("Missing the following
  inputs"). An image token is its own row unless its id lies past the table (then row 0), as transformers
  embeds it; the merge overwrites it in a prompt with an image. qwen3_vl's rows are as wide as the embedding graph's
  (its table row, then zeros where the deepstack maps go: exporter.contract.image_text_width), because
  transformers.js's merge (default_merge_input_ids_with_features) copies each vision_encoder row whole into its
  token's inputs_embeds row and feeds decoder_model_merged only what embed_tokens and that merge give it: the wide
  feature rows land whole, deepstack maps included, and the decoder takes them apart.
- ``onnx/decoder_model_merged{suffix}.onnx``: the decoder. gemma3's declares no ``position_ids``:
  transformers.js feeds gemma3 1-based positions (``start_index`` 1 for paligemma / gemma3) where
  transformers counts from 0, so the graph computes them from ``attention_mask`` (cumsum - 1, padding 1,
  the last sequence_length columns), as transformers' generate does.
- ``preprocessor_config.json`` (flat, with processor_class and do_normalize, which transformers.js does not
  default) and ``processor_config.json`` (flat), from the checkpoint's processor. llava's image-token count
  is transformers.js's floor(h / patch)^2 + num_additional_image_tokens, without transformers' "-1" for the
  "default" strategy (the class token dropped), so the count written is the one that gives transformers'
  token count.
- tokenizer files and the chat template (transformers.js's Gemma3Processor loads chat_template.jinja).

Each session mounts only its own ``{file}_data`` in a browser, so no two files share weights here: the
decoder's tied LM head and ``embed_tokens`` keep a table each, as in the farm export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from exporter import contract
from exporter.errors import ExportError
from exporter.packaging.package import file_entry

ONNX_DIR = "onnx"
PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The farm export's graph -> transformers.js's session (file) name.
SESSIONS = {contract.VISION: "vision_encoder", contract.EMBEDDING: "embed_tokens",
            contract.DECODER: "decoder_model_merged"}
EXPORT_FILES = {contract.VISION: contract.VISION_FILE, contract.EMBEDDING: contract.EMBEDDING_FILE,
                contract.DECODER: contract.MODEL_FILE}
# Families transformers.js 4.3.2 drives with inputs the vision graph does not take, refused for the hf layout.
_PIXEL_SHUFFLE = ("transformers.js 4.3 feeds {family}'s vision encoder 5-D pixel_values [batch, crops, 3, H, W] "
                  "(the image split into crops) and a pixel_attention_mask, and transformers drops the all-zero "
                  "padding crops of a batch by value before the tower; the vision graph takes whole images "
                  "[num_images, 3, H, W]")
REFUSED_FAMILIES = {family: _PIXEL_SHUFFLE.format(family=family) for family in ("idefics3", "smolvlm")}
# Families whose transformers processor is built only with its video processor (torchvision), of which transformers.js
# reads the image half: its processor class (transformers.js's name) over the checkpoint's image processor settings.
IMAGE_ONLY_PROCESSORS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_5": "Qwen3VLProcessor",
                         "qwen3_5_moe": "Qwen3VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                         "qwen3_vl_moe": "Qwen3VLProcessor"}
# Families whose transformers processor class wants torchvision (PixtralProcessor), whose settings transformers.js reads
# from preprocessor_config.json: written from the image processor and processor_config.json's own settings.
PIXTRAL_PROCESSORS = ("mistral3",)
# Positions from 1 in transformers.js (models/modeling_utils.js decoder_forward), from 0 in transformers.
ONE_BASED_POSITIONS = ("gemma3",)


def check_image_text_checkpoint(checkpoint_dir: Path, model_type: str) -> None:
    """ExportError, before any build, where transformers.js cannot run an image-text export of the
    checkpoint: a family it feeds differently, or no processor to generate its processor files from."""
    from exporter.packaging.source_files import checkpoint_file

    if model_type in REFUSED_FAMILIES:
        raise ExportError(f"no hf layout for a {model_type} image-text export: {REFUSED_FAMILIES[model_type]}; "
                          "export it with layout farm")
    if not any(checkpoint_file(checkpoint_dir, name, required=False) for name in (PROCESSOR_FILE, PREPROCESSOR_FILE)):
        raise ExportError(f"{checkpoint_dir} has no {PROCESSOR_FILE} or {PREPROCESSOR_FILE}: transformers.js's "
                          "AutoProcessor needs the checkpoint's processor (image processor, image token) for the "
                          "hf layout; pass a checkpoint saved with its processor, or export with layout farm")
    if model_type in PIXTRAL_PROCESSORS:  # the processor's token geometry must be the tower's
        from exporter.vision import load_vision_config

        own, cfg = _pixtral_settings(checkpoint_dir), load_vision_config(checkpoint_dir)
        for key, ours in (("patch_size", cfg.patch_size), ("spatial_merge_size", cfg.spatial_merge_size)):
            if own[key] != ours:
                raise ExportError(f"{checkpoint_dir}'s {PROCESSOR_FILE} gives {key} {own[key]} where the vision tower's "
                                  f"is {ours}: transformers.js's PixtralProcessor would write other image token counts "
                                  "than the vision graph gives; fix processor_config.json")


def session_files(manifest: dict, decoder_suffix: str) -> dict[str, str]:
    """{component: onnx/<session>{suffix}.onnx}. The vision and embedding graphs are never quantized: their
    suffix is their own dtype's (fp32 "", fp16 "_fp16") whatever the decoder's weights are."""
    from exporter.packaging.hf_layout import SUFFIX, check_request

    files = {contract.DECODER: f"{ONNX_DIR}/{SESSIONS[contract.DECODER]}{decoder_suffix}.onnx"}
    for name in (contract.VISION, contract.EMBEDDING):
        dtype = manifest["image_text"]["components"][name]["dtype"]
        weights = {"FLOAT": "fp32", "FLOAT16": "fp16"}.get(dtype)
        if weights is None:
            check_request("bf16", "attn_dynamic")  # transformers.js has no bf16 file name: refused by its words
        files[name] = f"{ONNX_DIR}/{SESSIONS[name]}{SUFFIX[(weights, dtype)][0]}.onnx"
    return files


def _dtype_name(file: str) -> str:
    from exporter.packaging.hf_layout import SUFFIX

    suffix = Path(file).stem.removeprefix(next(s for s in SESSIONS.values() if Path(file).stem.startswith(s)))
    return next(name for s, name in SUFFIX.values() if s == suffix)


def embed_tokens_graph(embedding: onnx.ModelProto, image_token_id: int) -> onnx.ModelProto:
    """``input_ids`` [batch_size, sequence_length] -> ``inputs_embeds``: the embedding graph's table lookup
    (its table and scale initializers, unchanged) without the image features, as wide as the embedding graph's
    inputs_embeds (qwen3_vl: the table row, then zeros for the deepstack maps)."""
    inits = {t.name: t for t in embedding.graph.initializer}
    gather = next((n for n in embedding.graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and inits[n.input[0]].data_location == TensorProto.EXTERNAL), None)
    if gather is None:
        raise ExportError("the export's embedding graph has no table lookup (Gather of an external table)")
    table = inits[gather.input[0]]
    vocab, hidden = table.dims
    scale = next((n for n in embedding.graph.node if n.op_type == "Mul" and n.input[0] == gather.output[0]
                  and n.input[1] in inits), None)
    nodes, initializers, ids = [], [table], contract.INPUT_IDS
    if image_token_id >= vocab:  # transformers looks such an id up as 0 (its row does not exist)
        initializers += [helper.make_tensor("image_token_id", TensorProto.INT64, [], [image_token_id]),
                         helper.make_tensor("row_zero", TensorProto.INT64, [], [0])]
        nodes += [helper.make_node("Equal", [ids, "image_token_id"], ["is_image"]),
                  helper.make_node("Where", ["is_image", "row_zero", ids], ["text_ids"])]
        ids = "text_ids"
    nodes.append(helper.make_node("Gather", [table.name, ids], ["embedded" if scale else contract.INPUTS_EMBEDS],
                                  axis=0))
    if scale is not None:  # gemma3's sqrt(hidden), the embedding graph's constant (rounded to its dtype)
        initializers.append(inits[scale.input[1]])
        nodes.append(helper.make_node("Mul", ["embedded", scale.input[1]], [contract.INPUTS_EMBEDS]))
    meta = {p.key: p.value for p in embedding.metadata_props}
    width = contract.image_text_width(hidden, int(meta.get(contract.META_DEEPSTACK, 0)))
    if width > hidden:  # qwen3_vl: zeros where an image token's row carries its deepstack maps
        nodes[-1].output[0] = "unpadded"
        initializers.append(helper.make_tensor("deepstack_pads", TensorProto.INT64, [6], [0, 0, 0, 0, 0, width - hidden]))
        nodes.append(helper.make_node("Pad", ["unpadded", "deepstack_pads"], [contract.INPUTS_EMBEDS]))
    graph = helper.make_graph(
        nodes, "embed_tokens",
        [helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [contract.BATCH, contract.SEQ])],
        [helper.make_tensor_value_info(contract.INPUTS_EMBEDS, table.data_type, [contract.BATCH, contract.SEQ, width])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=embedding.ir_version,
                              producer_name=embedding.producer_name, producer_version=embedding.producer_version)
    for prop in embedding.metadata_props:
        model.metadata_props.add(key=prop.key, value=prop.value)
    return model


def positions_from_mask(decoder: onnx.ModelProto) -> None:
    """Replace the decoder's ``position_ids`` input by the positions transformers' generate computes:
    cumsum(attention_mask) - 1, padding at 1, the last sequence_length columns (the step's tokens)."""
    graph = decoder.graph
    index = next((i for i, v in enumerate(graph.input) if v.name == contract.POSITION_IDS), None)
    if index is None:
        return
    del graph.input[index]
    mask = next(v for v in graph.input if v.name == contract.ATTENTION_MASK)
    consts = [helper.make_tensor(name, TensorProto.INT64, dims, values) for name, dims, values in (
        ("positions.axis", [], [1]), ("positions.one", [], [1]), ("positions.zero", [], [0]),
        ("positions.end", [1], [np.iinfo(np.int64).max]), ("positions.axes", [1], [1]))]
    mask64 = contract.ATTENTION_MASK
    nodes = []
    if mask.type.tensor_type.elem_type != TensorProto.INT64:
        nodes.append(helper.make_node("Cast", [mask64], ["positions.mask"], to=TensorProto.INT64))
        mask64 = "positions.mask"
    nodes += [
        helper.make_node("CumSum", [mask64, "positions.axis"], ["positions.cumsum"]),
        helper.make_node("Sub", ["positions.cumsum", "positions.one"], ["positions.counted"]),
        helper.make_node("Equal", [mask64, "positions.zero"], ["positions.padding"]),
        helper.make_node("Where", ["positions.padding", "positions.one", "positions.counted"], ["positions.all"]),
        helper.make_node("Shape", [contract.INPUTS_EMBEDS], ["positions.steps"], start=1, end=2),
        helper.make_node("Neg", ["positions.steps"], ["positions.start"]),
        helper.make_node("Slice", ["positions.all", "positions.start", "positions.end", "positions.axes"],
                         [contract.POSITION_IDS]),
    ]
    graph.initializer.extend(consts)
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + old)


def _carry(src: Path, dst: Path, mode: str) -> None:
    from exporter.packaging.hf_layout import _carry_weights

    _carry_weights(src, dst, mode)


def _processor_files(checkpoint_dir: Path, config: dict) -> dict[str, dict | str]:
    """{file: content} of preprocessor_config.json, processor_config.json (and the chat template where the
    checkpoint keeps it elsewhere), generated from the checkpoint's own processor."""
    import transformers

    from exporter.packaging.source_files import checkpoint_file

    for name in (PROCESSOR_FILE, PREPROCESSOR_FILE, CHAT_TEMPLATE_FILE, "chat_template.json"):
        checkpoint_file(checkpoint_dir, name, required=False)  # refused where one leads outside the checkpoint
    if config.get("model_type") in IMAGE_ONLY_PROCESSORS:
        return _image_only_processor_files(checkpoint_dir, IMAGE_ONLY_PROCESSORS[config["model_type"]])
    if config.get("model_type") in PIXTRAL_PROCESSORS:
        return _pixtral_processor_files(checkpoint_dir)
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint_dir))
    image = processor.image_processor.to_dict()
    image.pop("processor_class", None)
    image.setdefault("do_normalize", bool(image.get("image_mean") is not None))
    preprocessor = {**image, "processor_class": type(processor).__name__}
    own = {k: v for k, v in processor.to_dict().items()
           if k not in ("image_processor", "tokenizer", "chat_template", "audio_tokenizer")}
    own["processor_class"] = type(processor).__name__
    if config.get("model_type") == "llava" and own.get("vision_feature_select_strategy") == "default":
        # transformers: floor(h / p) * floor(w / p) + num_additional_image_tokens - 1 ("default" drops the
        # class token); transformers.js (models/llava/processing_llava.js) has no "- 1".
        own["num_additional_image_tokens"] = int(own.get("num_additional_image_tokens") or 0) - 1
    files: dict[str, dict | str] = {PREPROCESSOR_FILE: preprocessor, PROCESSOR_FILE: own}
    if getattr(processor, "chat_template", None) and not checkpoint_file(checkpoint_dir, CHAT_TEMPLATE_FILE,
                                                                         required=False):
        files[CHAT_TEMPLATE_FILE] = processor.chat_template
    if config.get("model_type") == "gemma3" and CHAT_TEMPLATE_FILE not in files and not checkpoint_file(
            checkpoint_dir, CHAT_TEMPLATE_FILE, required=False):
        raise ExportError(f"{checkpoint_dir} has no chat template, which transformers.js's Gemma3Processor loads "
                          f"({CHAT_TEMPLATE_FILE}): pass the checkpoint with its chat template")
    return files


def write_image_text_layout(export_dir: Path, out_dir: Path, checkpoint_dir: Path, manifest: dict,
                            decoder_suffix: str, weights: str) -> dict:
    """Write the image-text export in ``export_dir`` into ``out_dir`` (the caller's staging folder) as
    transformers.js loads it; returns the layout's manifest."""
    from exporter.packaging.hf_layout import CONFIG_FILE, LAYOUT, _checked_config, relocate_weights
    from exporter.packaging.source_files import checkpoint_file, side_file_names

    model_type = manifest["image_text"]["model_type"]
    check_image_text_checkpoint(checkpoint_dir, model_type)
    files = session_files(manifest, decoder_suffix)
    (out_dir / ONNX_DIR).mkdir(parents=True)
    for name, file in files.items():
        source = export_dir / EXPORT_FILES[name]
        model = onnx.load(str(source), load_external_data=False)
        data = f"{Path(file).name}_data"
        if name == contract.EMBEDDING:
            model = embed_tokens_graph(model, int(manifest["image_text"]["image_token_id"]))
        if name == contract.DECODER and model_type in ONE_BASED_POSITIONS:
            positions_from_mask(model)
        relocate_weights(model, contract.data_file(source.name), data, source)
        onnx.save(model, str(out_dir / file))
        _carry(export_dir / contract.data_file(source.name), out_dir / ONNX_DIR / data, weights)
    config = _checked_config(json.loads(checkpoint_file(checkpoint_dir, CONFIG_FILE).read_text()), image_text=True)
    js_config = dict(config.get("transformers.js_config") or {})
    js_config["use_external_data_format"] = {
        **(js_config.get("use_external_data_format") or {}), **{Path(f).name: 1 for f in files.values()}}
    dtypes = {SESSIONS[name]: _dtype_name(file) for name, file in files.items()}
    js_config["dtype"] = dtypes[SESSIONS[contract.DECODER]] if len(set(dtypes.values())) == 1 else dtypes
    decoder_dtype = dtypes[SESSIONS[contract.DECODER]]
    if decoder_dtype in ("fp16", "q4f16"):  # the empty first-step cache is float32 unless told
        js_config["kv_cache_dtype"] = {**(js_config.get("kv_cache_dtype") or {}), decoder_dtype: "float16"}
    config["transformers.js_config"] = js_config
    written = {CONFIG_FILE: json.dumps(config, indent=2) + "\n"}
    for name, content in _processor_files(checkpoint_dir, config).items():
        written[name] = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
    for name, text in written.items():
        (out_dir / name).write_text(text)
    names = [*files.values(), *(f"{f}_data" for f in files.values()), *written]
    for name in side_file_names(checkpoint_dir):  # tokenizer files, generation_config.json, the chat template
        if name not in names and "/" not in name and not name.startswith("."):
            shutil.copy2(checkpoint_file(checkpoint_dir, name), out_dir / name)
            names.append(name)
    layout_manifest = dict(manifest)
    layout_manifest["layout"] = {
        "kind": LAYOUT, "task": contract.IMAGE_TEXT_TASK,
        "sessions": {SESSIONS[name]: file for name, file in files.items()},
        "model_file": files[contract.DECODER], "data_file": f"{files[contract.DECODER]}_data",
        "transformers_js_dtype": js_config["dtype"],
        "position_ids": "computed in the decoder from attention_mask (transformers.js feeds gemma3 1-based ones)"
                        if model_type in ONE_BASED_POSITIONS else "fed by transformers.js",
        "from_export": {"export_id": manifest.get("export_id"),
                        "files": {n: manifest["files"][n] for f in EXPORT_FILES.values()
                                  for n in (f, contract.data_file(f)) if n in manifest["files"]}},
        "consumers": ["transformers.js >= 4 (AutoProcessor, AutoModelForImageTextToText) on onnxruntime-node / -web"],
    }
    layout_manifest["genai"] = {"package": False, "reason": "the hf layout is not an onnxruntime-genai package (no "
                                "genai_config.json); export with the farm layout for onnxruntime-genai"}
    data_of = {f"{files[name]}_data": contract.data_file(EXPORT_FILES[name]) for name in files}
    layout_manifest["files"] = {
        name: manifest["files"][data_of[name]] if name in data_of and data_of[name] in manifest["files"]
        else file_entry(out_dir / name) for name in names}
    (out_dir / contract.MANIFEST_FILE).write_text(json.dumps(layout_manifest, indent=2) + "\n")
    return layout_manifest


def _image_only_processor_files(checkpoint_dir: Path, processor_class: str) -> dict[str, dict | str]:
    """preprocessor_config.json and processor_config.json of a family in IMAGE_ONLY_PROCESSORS: the checkpoint's image
    processor (transformers' name without its backend suffix: transformers.js knows Qwen2VLImageProcessor, not
    Qwen2VLImageProcessorPil) under ``processor_class``."""
    import transformers

    image = transformers.AutoImageProcessor.from_pretrained(str(checkpoint_dir)).to_dict()
    image.pop("processor_class", None)
    image["image_processor_type"] = image["image_processor_type"].removesuffix("Pil").removesuffix("Fast")
    image.setdefault("do_normalize", bool(image.get("image_mean") is not None))
    return {PREPROCESSOR_FILE: {**image, "processor_class": processor_class},
            PROCESSOR_FILE: {"processor_class": processor_class}}


def _pixtral_processor_files(checkpoint_dir: Path) -> dict[str, dict | str]:
    """preprocessor_config.json and processor_config.json of a mistral3 checkpoint for transformers.js 4.3's
    PixtralProcessor: its PixtralImageProcessor reads the tower's patch_size (an int) and spatial_merge_size from
    preprocessor_config.json and resizes to multiples of their product within the longest edge, as transformers'
    PixtralProcessor has its image processor do; the processor reads the image tokens, patch_size and
    spatial_merge_size from processor_config.json (the checkpoint's, flat)."""
    import transformers

    own = _pixtral_settings(checkpoint_dir)
    image = transformers.AutoImageProcessor.from_pretrained(str(checkpoint_dir)).to_dict()
    image.pop("processor_class", None)
    image["image_processor_type"] = "PixtralImageProcessor"  # (transformers.js has no Pil / Fast suffixed names)
    image.setdefault("do_normalize", bool(image.get("image_mean") is not None))
    preprocessor = {**image, "patch_size": own["patch_size"], "spatial_merge_size": own["spatial_merge_size"],
                    "processor_class": "PixtralProcessor"}
    return {PREPROCESSOR_FILE: preprocessor, PROCESSOR_FILE: own}


def _pixtral_settings(checkpoint_dir: Path) -> dict:
    """processor_config.json's PixtralProcessor settings, flat (the image tokens defaulted as transformers defaults
    them), or ExportError where it does not give the tower's patch_size and spatial_merge_size, which transformers.js's
    PixtralProcessor counts an image's tokens by."""
    from exporter.packaging.source_files import checkpoint_file

    own_file = checkpoint_file(checkpoint_dir, PROCESSOR_FILE, required=False)
    own = json.loads(own_file.read_text()) if own_file else {}
    own = {k: v for k, v in own.items() if k not in ("image_processor", "tokenizer", "chat_template")}
    missing = [k for k in ("patch_size", "spatial_merge_size") if not isinstance(own.get(k), int)]
    if missing:
        raise ExportError(f"{checkpoint_dir} has no {PROCESSOR_FILE} naming {' and '.join(missing)} (PixtralProcessor's "
                          "settings), which transformers.js's PixtralProcessor counts an image's tokens by: pass the "
                          "checkpoint with its processor, or export with layout farm")
    return {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", **own,
            "processor_class": "PixtralProcessor"}
