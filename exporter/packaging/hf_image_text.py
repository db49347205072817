"""The hf layout of an image-text export: the three sessions transformers.js 4.x's image-text-to-text
models load, made from a finished export (vision.onnx, embedding.onnx, model.onnx) and the checkpoint's
own processor.

transformers.js 4.3.2 (models/modeling_utils.js, image_text_to_text_forward) runs, per prompt:
``embed_tokens`` on ``input_ids`` alone, ``vision_encoder`` on ``pixel_values`` (its features of any rank
flattened to [-1, hidden]), the merge in JavaScript (the k-th image token takes feature row k, counts must
match), then ``decoder_model_merged`` on ``inputs_embeds``, ``attention_mask``, ``position_ids`` only where
declared, and the caches; every decode step's token through ``embed_tokens`` again. So:

- ``onnx/vision_encoder{suffix}.onnx``: the export's vision graph, its weights moved under the new name. idefics3 /
  smolvlm: transformers.js's Idefics3ForConditionalGeneration feeds ``pixel_values`` [batch, crops, 3, S, S] (each
  prompt's images split into crops, the prompts' crops zero-padded to the batch's most) and ``pixel_attention_mask``
  [batch, crops, S, S] bool (Idefics3ImageProcessor._call); the graph for them (exporter.vision.crops) drops the
  all-zero crops, makes the patch attention mask and reads the tower through it, as transformers'
  get_image_features does, on the export's vision weights (the same initializers, their bytes moved).
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
- tokenizer files and the chat template (transformers.js's Gemma3Processor loads chat_template.jinja; its tokenizer
  reads chat_template.jinja, written from chat_template.json where a SmolVLM repository keeps it there).
- idefics3 / smolvlm: transformers.js's Idefics3Processor (models/idefics3/processing_idefics3.js) expands each
  ``<image>`` of a prompt to ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` x ``<image>`` per crop and
  the global image's ``<fake_token_around_image><global-img>...``, those token strings written into its code (where
  transformers' SmolVLMProcessor reads them from the tokenizer), and ``image_seq_len`` from processor_config.json; its
  image processor reads ``size``, ``max_image_size`` and ``do_image_splitting`` from preprocessor_config.json. A
  checkpoint whose processor would give other tokens or crops than the graphs take is refused (_crops_settings).

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
from exporter.vision.crops import CROPS_FAMILIES
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
# Families whose vision_encoder takes transformers.js's crops and pixel mask (exporter.vision.crops), and the
# processor_class transformers.js knows each by.
CROPS_PROCESSORS = {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}
assert set(CROPS_PROCESSORS) == set(CROPS_FAMILIES), "one processor class per crops family (exporter.vision.crops)"
# The token strings transformers.js 4.3.2's Idefics3Processor writes (its fake_image_token, image_token,
# global_img_token fields), whatever the tokenizer names.
CROPS_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                "global_image_token": "<global-img>"}
# Idefics3Processor's / SmolVLMProcessor's image_seq_len where processor_config.json names none.
IDEFICS3_IMAGE_SEQ_LEN = 169
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
    checkpoint: no processor to generate its processor files from, or one whose settings would feed the graphs
    otherwise than they compute (idefics3 / smolvlm, mistral3)."""
    from exporter.packaging.source_files import checkpoint_file

    if not any(checkpoint_file(checkpoint_dir, name, required=False) for name in (PROCESSOR_FILE, PREPROCESSOR_FILE)):
        raise ExportError(f"{checkpoint_dir} has no {PROCESSOR_FILE} or {PREPROCESSOR_FILE}: transformers.js's "
                          "AutoProcessor needs the checkpoint's processor (image processor, image token) for the "
                          "hf layout; pass a checkpoint saved with its processor, or export with layout farm")
    if model_type in CROPS_PROCESSORS:  # the processor's crops and image tokens must be what the graphs take
        _crops_settings(checkpoint_dir, model_type)
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
    if config.get("model_type") in CROPS_PROCESSORS:
        return _crops_processor_files(checkpoint_dir, config["model_type"])
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
        relocate_weights(model, contract.data_file(source.name), data, source)  # the weights' file under its new name
        if name == contract.VISION and model_type in CROPS_PROCESSORS:
            model = crops_vision_encoder(checkpoint_dir, model, manifest["image_text"]["components"][name])
        if name == contract.EMBEDDING:
            model = embed_tokens_graph(model, int(manifest["image_text"]["image_token_id"]))
        if name == contract.DECODER and model_type in ONE_BASED_POSITIONS:
            positions_from_mask(model)
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
    # and the export's reports, as a text layout carries them (not its genai package's files: no genai_config.json
    # here, whose decoder file name the layout does not have)
    for name in (contract.REPORT_JSON, contract.REPORT_MD, contract.BENCH_FILE):
        if name in manifest["files"] and name not in names and (export_dir / name).is_file():
            shutil.copy2(export_dir / name, out_dir / name)
            names.append(name)
    layout_manifest = dict(manifest)
    layout_manifest["layout"] = {
        "kind": LAYOUT, "task": contract.IMAGE_TEXT_TASK,
        "sessions": {SESSIONS[name]: file for name, file in files.items()},
        "model_file": files[contract.DECODER], "data_file": f"{files[contract.DECODER]}_data",
        "transformers_js_dtype": js_config["dtype"],
        "position_ids": "computed in the decoder from attention_mask (transformers.js feeds gemma3 1-based ones)"
                        if model_type in ONE_BASED_POSITIONS else "fed by transformers.js",
        **({"vision_encoder": "transformers.js's crops: pixel_values [batch, crops, 3, S, S] and pixel_attention_mask; "
                              "the all-zero padding crops dropped and the patch mask read as transformers' "
                              "get_image_features does, on the export's vision weights (exporter.vision.crops)"}
           if model_type in CROPS_PROCESSORS else {}),
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


def crops_vision_encoder(checkpoint_dir: Path, farm: onnx.ModelProto, component: dict) -> onnx.ModelProto:
    """idefics3 / smolvlm's vision_encoder: exporter.vision.build_crops_vision_graph in the export's vision dtype, each
    checkpoint weight the farm vision graph's own initializer of that name (``farm``, already relocated: its external
    entries are the layout's), so the bytes are the export's. ``component``: the manifest's vision entry, whose
    recipes (checkpoint tensors, slices, dtype) every weight must repeat: a name alone does not prove the same bytes."""
    import onnx_ir as ir

    from exporter.packaging.package import initializer_sources
    from exporter.vision.graphs import build_crops_vision_graph

    model = build_crops_vision_graph(checkpoint_dir, ir.DataType[component["dtype"]])
    external = {t.name: t for t in farm.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    recipes = component["initializers"]
    for name, source in initializer_sources(model).items():
        if source.get("computed"):
            continue  # the crops graph's own constants (position buckets, shapes): inline
        if recipes.get(name) != source:
            raise ExportError(f"the export's vision graph has no weight {name} as the crops vision_encoder reads it "
                              f"({recipes.get(name)} vs {source}): re-export the checkpoint")
        if name in external:
            entries = {e.key: e.value for e in external[name].external_data}
            value = model.graph.initializers[name]
            value.const_value = ir.ExternalTensor(
                entries["location"], int(entries.get("offset", 0)), int(entries["length"]), value.const_value.dtype,
                shape=value.const_value.shape, name=name, base_dir=".")
    return ir.serde.serialize_model(model)


def _crops_settings(checkpoint_dir: Path, model_type: str) -> tuple[dict, dict]:
    """(the image processor's settings, processor_config.json's flat) of an idefics3 / smolvlm checkpoint, or
    ExportError where transformers.js's Idefics3Processor would feed other crops or write other image tokens than the
    vision and embedding graphs take: crops of another size than the tower's image_size, another image_seq_len than
    the tower's tokens per crop, image tokens of other names than those its code writes, an image token id not
    config.json's."""
    import transformers

    from exporter.packaging.source_files import checkpoint_file
    from exporter.vision import load_vision_config

    cfg = load_vision_config(checkpoint_dir)
    try:
        image = transformers.AutoImageProcessor.from_pretrained(str(checkpoint_dir)).to_dict()
    except (OSError, ValueError) as err:
        raise ExportError(f"{checkpoint_dir}'s image processor does not load ({err}): transformers.js's "
                          f"{CROPS_PROCESSORS[model_type]} reads its settings for the hf layout; pass the checkpoint "
                          "with its processor") from err
    own_file = checkpoint_file(checkpoint_dir, PROCESSOR_FILE, required=False)
    own = json.loads(own_file.read_text()) if own_file else {}
    nested = ("image_processor", "tokenizer", "chat_template", "video_processor")
    own = {k: v for k, v in own.items() if k not in nested}
    crop = (image.get("max_image_size") or {}).get("longest_edge")
    if crop != cfg.image_size:
        raise ExportError(f"{checkpoint_dir}'s image processor makes crops of max_image_size {crop} pixels where the "
                          f"vision tower's image_size is {cfg.image_size}: the hf layout's vision_encoder takes crops "
                          "of the tower's size (as the published Idefics3 / SmolVLM processors make them); fix "
                          "max_image_size.longest_edge or export with layout farm")
    if not (image.get("size") or {}).get("longest_edge"):
        raise ExportError(f"{checkpoint_dir}'s image processor has no size.longest_edge, which transformers.js's "
                          "Idefics3ImageProcessor resizes every image by: fix preprocessor_config.json")
    seq_len = int(own.get("image_seq_len", IDEFICS3_IMAGE_SEQ_LEN))
    if seq_len != cfg.tokens_per_image:
        raise ExportError(f"{checkpoint_dir}'s processor writes image_seq_len {seq_len} image tokens a crop where the "
                          f"vision graph gives {cfg.tokens_per_image} ((image_size / patch_size)^2 / scale_factor^2): "
                          f"fix image_seq_len in {PROCESSOR_FILE}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir))
    except (OSError, ValueError) as err:
        raise ExportError(f"{checkpoint_dir}'s tokenizer does not load ({err}): transformers.js's "
                          f"{CROPS_PROCESSORS[model_type]} writes the image tokens through it; pass the checkpoint "
                          "with its tokenizer files") from err
    for attribute, token in CROPS_TOKENS.items():
        named = getattr(tokenizer, attribute, None) if model_type == "smolvlm" else None  # idefics3's are fixed
        if named not in (None, token):
            raise ExportError(f"{checkpoint_dir}'s tokenizer names {attribute} {named!r}, which transformers' "
                              f"SmolVLMProcessor writes, where transformers.js's Idefics3Processor writes {token!r}: "
                              "its prompts would hold other tokens than transformers'; export with layout farm")
    image_id = tokenizer.convert_tokens_to_ids(CROPS_TOKENS["image_token"])
    if image_id != cfg.image_token_id:
        raise ExportError(f"{checkpoint_dir}'s tokenizer gives {CROPS_TOKENS['image_token']!r} id {image_id} where "
                          f"config.json's image_token_id is {cfg.image_token_id}: is the tokenizer from this "
                          "checkpoint?")
    return image, {**own, "image_seq_len": seq_len, "processor_class": CROPS_PROCESSORS[model_type]}


def _crops_processor_files(checkpoint_dir: Path, model_type: str) -> dict[str, dict | str]:
    """preprocessor_config.json and processor_config.json of an idefics3 / smolvlm checkpoint for transformers.js's
    Idefics3Processor (SmolVLMProcessor is the same class there), from the checkpoint's image processor (its name
    without a backend suffix) and processor_config.json, flat; chat_template.jinja from chat_template.json where the
    checkpoint keeps its template there (SmolVLM's hub repositories), which transformers.js's tokenizer reads."""
    from exporter.packaging.source_files import checkpoint_file

    image, own = _crops_settings(checkpoint_dir, model_type)
    image.pop("processor_class", None)
    image["image_processor_type"] = image["image_processor_type"].removesuffix("Pil").removesuffix("Fast")
    image.setdefault("do_normalize", bool(image.get("image_mean") is not None))
    files: dict[str, dict | str] = {PREPROCESSOR_FILE: {**image, "processor_class": own["processor_class"]},
                                    PROCESSOR_FILE: own}
    template_json = checkpoint_file(checkpoint_dir, "chat_template.json", required=False)
    if template_json and not checkpoint_file(checkpoint_dir, CHAT_TEMPLATE_FILE, required=False):
        template = json.loads(template_json.read_text()).get("chat_template")
        if isinstance(template, str):
            files[CHAT_TEMPLATE_FILE] = template
    return files
