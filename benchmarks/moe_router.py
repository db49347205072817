"""What a mixture of experts' router costs in decode, and what quantizing it would change: the same
export with its router in four forms, driven by onnxruntime-genai's generator, rounds alternating.

The exporter keeps every router in float (the checkpoint's expert choice); the genai builder's int4
gpt-oss quantizes it to 4 bits. On the H200 our 1-layer gpt-oss int4 decoded ~25% slower than the
builder's at batch 1, and the profile put the router's MatMul at ~50 us a step against ~13 us for
the builder's MatMulNBits. This measures, on one export (the other weights and nodes untouched):

- ``float``: the export as written (the router a MatMul in the activations' dtype, bias added);
- ``fp32``: the router computed in float32 (Cast in, fp32 MatMul and bias, Cast out): exact routing;
- ``nbits8`` / ``nbits4``: the router a symmetric MatMulNBits of 8 / 4 bits, blocks of 32 (the
  builder's form at 4).

For each: decode ms/token at each batch / context, a profile of one generation (onnxruntime's, via
moe_matrix.profile_decode), and how often the quantized router's top-k expert set differs from the
float router's on random inputs of unit variance (the router's input is an RMS-normed hidden state):
on random weights this is a property of the quantization grid, not of a trained router.

Run on the GPU machine (benchmarks/gpu_env.sh)::

    python3 benchmarks/moe_router.py --model gpt-oss-20b --depth 1 --out $OUT/moe_router.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_matrix  # noqa: E402

FORMS = ("float", "fp32", "nbits8", "nbits4")
BLOCK = 32


def _router_nodes(model) -> list:
    return [n for n in model.graph.node if n.op_type == "MatMul" and "router.weight" in n.input[1]]


def _array(model, name: str, base: Path) -> np.ndarray:
    """An initializer's values as float32, its external bytes read directly (onnx's own loader refuses
    a data file with several hard links, which the variants' copies are)."""
    from onnx import TensorProto, external_data_helper, helper, numpy_helper

    tensor = next(t for t in model.graph.initializer if t.name == name)
    if not external_data_helper.uses_external_data(tensor):
        return numpy_helper.to_array(tensor).astype(np.float32)
    info = {e.key: e.value for e in tensor.external_data}
    with open(base / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        raw = f.read(int(info["length"]))
    if tensor.data_type == TensorProto.BFLOAT16:
        bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(tuple(tensor.dims))
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(raw, dtype).astype(np.float32).reshape(tuple(tensor.dims))


def rewrite(source: Path, out: Path, form: str) -> dict:
    """A copy of the package ``source`` (weights hard-linked) whose routers take ``form``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from exporter.graph.passes.quantize import quantize_rows

    moe_matrix.linked_copy(source, out, "model.onnx")
    model = onnx.load(str(source / "model.onnx"), load_external_data=False)
    routers = _router_nodes(model)
    if form == "float":
        onnx.save(model, str(out / "model.onnx"))
        return {"routers": len(routers)}
    graph = model.graph
    new_nodes, added = [], []
    by_output = {n.output[0]: n for n in routers}
    for node in list(graph.node):
        if node.output[0] not in by_output:
            new_nodes.append(node)
            continue
        weight = _array(model, node.input[1], source).astype(np.float32)  # [K, experts]
        stem = node.input[1] + f".{form}"
        if form == "fp32":
            graph.initializer.append(numpy_helper.from_array(weight, stem))
            act = next(t for t in graph.initializer if t.name == node.input[1]).data_type
            new_nodes += [helper.make_node("Cast", [node.input[0]], [stem + ".x"], to=TensorProto.FLOAT),
                          helper.make_node("MatMul", [stem + ".x", stem], [stem + ".y"]),
                          helper.make_node("Cast", [stem + ".y"], [node.output[0]], to=act)]
        else:
            bits = 8 if form == "nbits8" else 4
            act_dtype = next(t for t in graph.initializer if t.name == node.input[1]).data_type
            rows = weight.T.copy()
            packed, scales, _ = quantize_rows(rows, bits, BLOCK, True)
            scales_t = numpy_helper.from_array(scales.astype(np.float32), stem + ".scales")
            if act_dtype != TensorProto.FLOAT:
                scales_t = helper.make_tensor(stem + ".scales", act_dtype, scales.shape,
                                              scales.astype(np.float32).ravel().tolist())
            graph.initializer.extend([numpy_helper.from_array(packed, stem + ".packed"), scales_t])
            new_nodes.append(helper.make_node(
                "MatMulNBits", [node.input[0], stem + ".packed", stem + ".scales"], [node.output[0]],
                domain="com.microsoft", K=weight.shape[0], N=weight.shape[1], bits=bits, block_size=BLOCK,
                accuracy_level=0, name=node.name + f"_{form}"))
        added.append(stem)
    del graph.node[:]
    graph.node.extend(new_nodes)
    onnx.save(model, str(out / "model.onnx"))
    return {"routers": len(routers), "added": added}


def routing_flips(source: Path, k: int, tokens: int = 4096) -> dict:
    """Per quantized form: the share of random unit-variance inputs whose top-k expert set differs
    from the fp32 router's (each layer's router, bias included), and the largest logit change."""
    import onnx

    from exporter.graph.passes.quantize import QuantScheme, dequantize, quantize_rows

    model = onnx.load(str(source / "model.onnx"), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(0)
    out = {}
    for node in _router_nodes(model):
        weight = _array(model, node.input[1], source).astype(np.float32)
        bias_name = node.input[1].replace("router.weight.T", "router.bias")
        bias = _array(model, bias_name, source).astype(np.float32) if bias_name in inits else 0.0
        x = rng.standard_normal((tokens, weight.shape[0]), dtype=np.float32)
        exact = x @ weight + bias
        top = np.sort(np.argsort(-exact, axis=1)[:, :k], axis=1)
        for bits in (8, 4):
            scheme = QuantScheme(bits, BLOCK, True)
            packed, scales, _ = quantize_rows(weight.T.copy(), bits, BLOCK, True)
            approx = x @ dequantize(packed, scales, None, scheme, weight.shape[0]).T + bias
            flipped = np.any(np.sort(np.argsort(-approx, axis=1)[:, :k], axis=1) != top, axis=1)
            row = out.setdefault(f"nbits{bits}", {"flipped": [], "max_logit_change": []})
            row["flipped"].append(round(float(flipped.mean()), 4))
            row["max_logit_change"].append(round(float(np.abs(approx - exact).max()), 4))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--ctx", default="128,2048")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-router"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import onnxruntime as ort
    import onnxruntime_genai as og
    import torch

    from exporter.geometries import geometry_config

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    full = geometry_config(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.ctx.split(",")]
    rec = moe_matrix.Recorder(args.out, {
        "benchmark": "moe_router", "model": args.model, "depth": args.depth, "dtype": args.dtype,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "device": torch.cuda.get_device_name(0), "how": __doc__.split("\n\n")[1].replace("\n", " "),
        "forms": {}, "runs": {}})
    shutil.rmtree(args.work, ignore_errors=True)
    checkpoint = args.work / "checkpoint"
    moe_matrix.log(f"checkpoint {args.model} at {args.depth} layers")
    rec.data["checkpoint"] = moe_matrix.build_checkpoint(args.model, args.depth, checkpoint)
    max_seq_len = max(contexts) + args.warmup + args.steps + 64
    source, command = moe_matrix.export_ours(checkpoint, args.work / "ours", args.dtype, max_seq_len)
    rec.data["export_command"] = command
    shutil.rmtree(checkpoint)
    rec.data["routing_flips"] = routing_flips(source, full["num_experts_per_tok"])
    moe_matrix.log(f"routing flips {rec.data['routing_flips']}")
    models = {}
    for form in FORMS:
        directory = args.work / form
        rec.data["forms"][form] = rewrite(source, directory, form)
        models[form] = og.Model(str(directory))
    rec.save()
    for _ in range(args.rounds):
        for batch in batches:
            for ctx in contexts:
                for form, model in models.items():
                    if time.perf_counter() - moe_matrix.T0 > args.budget_s:
                        break
                    got = moe_matrix.generate(model, batch, ctx, args.steps, args.warmup, full["vocab_size"])
                    row = rec.data["runs"].setdefault(form, {}).setdefault(f"b{batch} ctx{ctx}", {"decode_ms": []})
                    row["decode_ms"].append(round(got["decode_ms"], 3))
                    row["tokens_row0"] = got["tokens"]
                    moe_matrix.log(f"{form} b{batch} ctx{ctx}: {got['decode_ms']:.3f} ms")
                rec.save()
    del models
    gc.collect()
    for form in FORMS:
        if time.perf_counter() - moe_matrix.T0 > args.budget_s:
            break
        profile = moe_matrix.profile_decode(args.work / form, batches[0], contexts[0], args.steps, full["vocab_size"])
        rec.data.setdefault("profile", {})[form] = {k: profile[k] for k in (
            "model_run_us_median", "kernel_us_per_step", "op_us_per_step", "top_nodes_us_per_step")}
        rec.save()
    rec.data["summary"] = {form: {key: float(np.median(row["decode_ms"][1:] or row["decode_ms"]))
                                  for key, row in rows.items()} for form, rows in rec.data["runs"].items()}
    rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
