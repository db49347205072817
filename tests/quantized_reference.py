"""The reference a quantized export is exact to: its checkpoint with every weight the export quantized
replaced by that weight's own quantize-dequantize (round to nearest, or HQQ: see dequantized_checkpoint)."""

from __future__ import annotations

import json
import shutil

import numpy as np

from exporter.graph.passes.quantize import QuantScheme, dequantize, quantize_hqq, quantize_rows


def dequantized_checkpoint(source, export_dir, out):
    """The checkpoint with every weight the export quantized replaced by its own quantize-dequantize
    (numpy, onnxruntime's blockwise algorithm): rows are quantized independently, so packing and
    interleaving do not change a row's values. HQQ's optimizer stops on the mean error of the rows it
    is given together, so an HQQ weight is quantized here as one call per checkpoint tensor, which is
    what the export does where a tensor fits one checkpoint block (every tiny checkpoint's does)."""
    from safetensors.numpy import load_file, save_file

    manifest = json.loads((export_dir / "manifest.json").read_text())
    schemes = {}
    for recipe in manifest["initializers"].values():
        quant = recipe.get("quantization")
        if quant and quant["role"] == "packed":
            for part in recipe["parts"]:
                schemes[part["tensor"]] = {**quant, "transposed": part.get("transposed", False)}
    assert schemes
    shutil.copytree(source, out)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, quant in schemes.items():
            if name in tensors:
                w = tensors[name].astype(np.float32)
                if quant["transposed"]:  # gpt-oss's [experts, in, out]: rows are its columns
                    w = np.ascontiguousarray(w.swapaxes(-1, -2))
                rows = w.reshape(-1, w.shape[-1])
                block = quant["block_size"]
                scheme = QuantScheme.of(quant)
                if scheme.method == "hqq":
                    packed, scales, zero = quantize_hqq(rows, scheme.bits, block)
                else:
                    packed, scales, zero = quantize_rows(rows, scheme.bits, block, scheme.symmetric)
                back = dequantize(packed, scales, None if scheme.symmetric else zero, scheme, rows.shape[1])
                back = back.reshape(w.shape)
                back = back.swapaxes(-1, -2) if quant["transposed"] else back
                tensors[name] = np.ascontiguousarray(back.astype(tensors[name].dtype))  # save_file writes the buffer
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    return out, schemes
