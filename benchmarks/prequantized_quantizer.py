"""The quantizer's side of benchmarks/prequantized_import.py: run by the Python that has GPTQModel
(not a dependency of the farm), it makes GPTQ / AWQ checkpoints with GPTQModel itself and computes
their logits with transformers, which loads such a checkpoint through GPTQModel's own modules.

    python benchmarks/prequantized_quantizer.py make --method gptq --source CKPT --out DIR --calibration TEXT
    python benchmarks/prequantized_quantizer.py logits --checkpoint DIR --ids IDS.json --out LOGITS.npz

``logits`` writes two references per id list:
- ``kernel``: the model as transformers loads it (GPTQModel's CPU module; it dequantizes in fp16,
  so each weight is ``scale * (q - z)`` rounded to fp16);
- ``dequantized``: the same model with every quantized module replaced by a float linear holding
  that module's own ``dequantize_weight()`` computed with its scales widened to fp32 (exact: an fp16
  scale times a small integer), i.e. the checkpoint's own dequantization, forwarded by transformers
  in fp32.
Only this file imports gptqmodel; the farm reads the checkpoints with its own code.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def make(args) -> None:
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    ids = tokenizer("\n\n".join(Path(f).read_text() for f in args.calibration)).input_ids
    calibration = [tokenizer.decode(ids[i : i + args.window]) for i in range(0, len(ids) - args.window, args.window)]
    calibration = calibration[: args.samples]
    if args.method == "gptq":
        config = GPTQConfig(bits=args.bits, group_size=args.group_size, desc_act=args.desc_act, sym=not args.asymmetric)
    else:
        config = AWQConfig(bits=args.bits, group_size=args.group_size)
    t0 = time.perf_counter()
    model = GPTQModel.load(args.source, config, device="cpu")
    model.quantize(calibration, batch_size=args.batch_size)
    model.save(args.out)
    info = {"method": args.method, "bits": args.bits, "group_size": args.group_size, "desc_act": args.desc_act,
            "symmetric": not args.asymmetric, "calibration_windows": len(calibration), "window_tokens": args.window,
            "calibration_files": [Path(f).name for f in args.calibration], "quantize_s": round(time.perf_counter() - t0, 1),
            "gptqmodel": __import__("gptqmodel").__version__}
    Path(args.out, "made_by.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def _dequantized_linears(model) -> int:
    """Every GPTQModel module of ``model`` replaced by a float nn.Linear of its own dequantized weight
    (scales widened to fp32 first)."""
    import torch

    swapped = 0
    for name, module in list(model.named_modules()):
        if not hasattr(module, "dequantize_weight") or not hasattr(module, "qweight"):
            continue
        module.scales = module.scales.float()
        with torch.no_grad():
            weight = module.dequantize_weight().float()
        if weight.shape == (module.in_features, module.out_features):
            weight = weight.T
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=getattr(module, "bias", None) is not None)
        linear.weight.data = weight.contiguous()
        if linear.bias is not None:
            linear.bias.data = module.bias.float()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
        swapped += 1
    return swapped


def logits(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    id_lists = json.loads(Path(args.ids).read_text())
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, device_map="cpu", dtype=torch.float32)
    model.eval()
    kinds = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})
    out = {}
    with torch.no_grad():
        for i, ids in enumerate(id_lists):
            out[f"kernel_{i}"] = model(torch.tensor([ids])).logits[0].float().numpy()
        swapped = _dequantized_linears(model)
        for i, ids in enumerate(id_lists):
            out[f"dequantized_{i}"] = model(torch.tensor([ids])).logits[0].float().numpy()
    np.savez(args.out, **out)
    print(json.dumps({"modules": kinds, "swapped": swapped}))


def main() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--method", choices=("gptq", "awq"), required=True)
    m.add_argument("--source", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--calibration", action="append", required=True, help="text file(s) to calibrate on")
    m.add_argument("--bits", type=int, default=4)
    m.add_argument("--group-size", type=int, default=32)
    m.add_argument("--desc-act", action="store_true")
    m.add_argument("--asymmetric", action="store_true")
    m.add_argument("--samples", type=int, default=64)
    m.add_argument("--window", type=int, default=256)
    m.add_argument("--batch-size", type=int, default=4)
    lg = sub.add_parser("logits")
    lg.add_argument("--checkpoint", required=True)
    lg.add_argument("--ids", required=True)
    lg.add_argument("--out", required=True)
    args = parser.parse_args()
    make(args) if args.command == "make" else logits(args)


if __name__ == "__main__":
    main()
