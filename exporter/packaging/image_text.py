"""An image-text export's vision and embedding graphs beside its decoder: written into the export folder
(vision.onnx, embedding.onnx, each with its .data), and the manifest's description of the three
components (file, inputs, outputs), so a runtime knows what to run in which order."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from exporter import contract
from exporter.packaging.external_data import write_model_files
from exporter.packaging.package import _value_io, initializer_sources, op_census


def _component(model: ir.Model, file: str) -> dict:
    return {"file": file, "data": contract.data_file(file) if file != contract.MODEL_FILE else contract.DATA_FILE,
            "inputs": [_value_io(v) for v in model.graph.inputs], "outputs": [_value_io(v) for v in model.graph.outputs]}


def write_image_text_graphs(out_dir: Path, checkpoint_dir: Path, decoder: ir.Model, dtype: ir.DataType,
                            on_bytes=None) -> tuple[dict[str, dict], dict]:
    """Build and write the vision and embedding graphs of ``checkpoint_dir`` in ``dtype`` (the decoder's
    activation dtype: they are not quantized) into ``out_dir``; returns (the files written, hashed as they
    were written, the manifest's ``image_text`` entry). ``decoder``: the built decoder, described beside them."""
    from exporter.vision import build_embedding_graph, build_vision_graph, load_vision_config

    cfg = load_vision_config(checkpoint_dir)
    written, components = {}, {}
    for name, file, build in ((contract.VISION, contract.VISION_FILE, build_vision_graph),
                              (contract.EMBEDDING, contract.EMBEDDING_FILE, build_embedding_graph)):
        model = build(checkpoint_dir, dtype)
        data = write_model_files(model, out_dir, on_bytes, model_file=file)
        written[file] = {"sha256": _sha256(out_dir / file), "size": (out_dir / file).stat().st_size}
        written[contract.data_file(file)] = data.to_dict()
        components[name] = {**_component(model, file), "dtype": ir.DataType(dtype).name, "op_census": op_census(model),
                            "weight_bytes": sum(v.const_value.nbytes for v in model.graph.initializers.values()),
                            "initializers": initializer_sources(model)}  # what the weight gate reads back
    components[contract.DECODER] = _component(decoder, contract.MODEL_FILE)
    unread = _unread_tower_tensors(checkpoint_dir, cfg)
    entry = {
        "model_type": cfg.model_type, "tokens_per_image": cfg.tokens_per_image, "image_token_id": cfg.image_token_id,
        "image_size": cfg.image_size, "num_channels": cfg.num_channels,
        # the order a runtime runs them in: images once per prompt, then the embedding before every decoder call
        "run": [contract.VISION, contract.EMBEDDING, contract.DECODER],
        "components": components,
        **({"unread": {"tensors": unread, "why": "transformers' forward does not read them either: tower layers past "
                       "the deepest vision_feature_layer, the post-layernorm where the features are hidden states"}}
           if unread else {}),
        **({"deepstack": deepstack_entry(cfg)} if cfg.deepstack_layers else {}),
    }
    return written, entry


def deepstack_entry(cfg) -> dict:
    """The manifest's account of Qwen3-VL's deepstack maps: where they come from, where the decoder adds them, and
    why image_features and the decoder's inputs_embeds are wider than the text hidden size."""
    maps = len(cfg.deepstack_layers)
    return {
        "maps": maps, "vision_blocks": list(cfg.deepstack_layers), "decoder_layers": list(range(maps)),
        "text_hidden_size": cfg.text_hidden_size, "inputs_embeds_width": cfg.feature_width,
        "layout": "image_features / inputs_embeds rows are [hidden states | map 0 | ... | map D-1], each text hidden "
                  "wide; a text token's maps are zeros; the decoder adds map k after its layer k",
        "why": "transformers adds each deepstack map to the hidden states at the image positions after the decoder's "
               "first layers (Qwen3VLTextModel._deepstack_process), and neither onnxruntime-genai 0.18 nor "
               "transformers.js 4.3.2 feeds a decoder any input but inputs_embeds; both pass the vision graph's rows "
               "into inputs_embeds unchanged (genai sizes both by genai_config's decoder.hidden_size, written as this "
               "width; transformers.js copies each feature row into its token's row), so the maps ride there",
    }


def _unread_tower_tensors(checkpoint_dir: Path, cfg) -> list[str]:
    """The tower's tensors no image feature depends on (llava's and mistral3's vision_feature_layer short of the last
    layer)."""
    import re

    from exporter.packaging.checkpoint import Checkpoint
    from exporter.vision import FAMILIES

    checkpoint = Checkpoint(checkpoint_dir)
    family = FAMILIES[cfg.model_type]
    tower = family.module_names(checkpoint).tower
    layer = re.compile(re.escape(f"{tower}{family.tower_layers}") + r"(\d+)\.")
    unread = []
    for name in checkpoint.names():
        if not name.startswith(tower):
            continue
        match = layer.match(name)
        if (match and int(match.group(1)) >= cfg.num_layers) or (
                cfg.feature_layers is not None and name.startswith(f"{tower}post_layernorm.")):
            unread.append(name)
    return sorted(unread)


def _sha256(path: Path) -> str:
    from exporter.packaging.package import sha256_file

    return sha256_file(path)


def component_sources(entry: dict) -> frozenset[str]:
    """The checkpoint tensors the vision and embedding graphs of a manifest's ``image_text`` entry read, and
    the tower's tensors it records as read by no forward (``unread``)."""
    read = {part["tensor"] for name in (contract.VISION, contract.EMBEDDING)
            for recipe in entry["components"][name]["initializers"].values() for part in recipe.get("parts", ())}
    return frozenset(read | set(entry.get("unread", {}).get("tensors", ())))
