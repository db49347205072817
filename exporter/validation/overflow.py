"""Where an export's numbers stop being finite: the decoder layer, the op and the headroom left.

A half-precision export that overflows shows it as inf or NaN in its outputs, far from where it
happened. ``locate`` finds the place: the export's graph is read without its weights, every
floating value an op computes gets a probe beside it (its largest magnitude, and whether all of it
is finite: a sum of the value times zero is NaN exactly where the value is not finite), the probed
model is saved next to the export (it reads the same weights file) and run once on the tokens
that overflowed, in the export's own session. The first non-finite value in graph order is where
the overflow starts (NaN and inf only spread forward from there); each op is attributed to the
decoder layer whose weights it (or what feeds it) reads, so the report can say "fp16 overflows in
decoder layer 3". Only run when an export's outputs were not finite: it costs one more session.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from pathlib import Path

import numpy as np

from exporter.graph.passes.quantize import LAYER_NAME

# Ops whose outputs are integers (or booleans) whatever their inputs are.
_INTEGER_OPS = {"Shape", "Size", "ArgMax", "ArgMin", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
                "Not", "And", "Or", "Xor", "NonZero", "IsNaN", "IsInf", "TopK"}
_FLOAT_TYPES = {1, 10, 16, 11}  # FLOAT, FLOAT16, BFLOAT16, DOUBLE
_PROBE = "overflow_probe_"


@dataclasses.dataclass
class Finding:
    """Where an export stops being finite, and how close each part comes to the dtype's largest value."""

    overflow_at: str | None  # "decoder layer 3", "the embedding", "the final norm and LM head"; None: all finite
    layer: int | None  # the decoder layer, where it is one
    op: str | None  # the op whose output is the first non-finite value, and the node's name
    node: str | None
    peaks: dict[str, float]  # part -> the largest finite magnitude of a value computed there
    probed: int  # how many values were probed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def part_name(layer: int, num_layers: int) -> str:
    if layer < 0:
        return "the embedding"
    if layer >= num_layers:
        return "the final norm and LM head"
    return f"decoder layer {layer}"


def _attribute(graph, num_layers: int) -> list[tuple[str, int, str, str]]:
    """(value, layer, op type, node name) of every floating value an op computes, in graph order.
    A node's layer is the highest layer of a weight it reads or of a value it takes (-1 before the
    first layer); a node reading a weight of no layer (the final norm, the LM head) past the first
    layer belongs to the head (``num_layers``)."""
    floating = {i.name for i in graph.input if i.type.tensor_type.elem_type in _FLOAT_TYPES}
    floating |= {t.name for t in graph.initializer if t.data_type in _FLOAT_TYPES}
    weights = {t.name for t in graph.initializer}
    # Only values something reads (or the graph returns): an optional output nobody reads (a norm's
    # mean, say) may never be computed by the kernel that runs it (CUDA's), and probing it fails.
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    layer_of: dict[str, int] = {}
    probes = []
    for node in graph.node:
        layers = [layer_of.get(name, -1) for name in node.input if name]
        reads = [name for name in node.input if name in weights]
        for name in reads:
            found = LAYER_NAME.search(name)
            if found:
                layers.append(int(found.group(1)))
        layer = max(layers, default=-1)
        if layer >= 0 and node.op_type != "Gather" and any(
                LAYER_NAME.search(n) is None and ("norm" in n or "lm_head" in n or "embed" in n) for n in reads):
            layer = num_layers
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            is_float = to in _FLOAT_TYPES
        else:
            is_float = node.op_type not in _INTEGER_OPS and any(n in floating for n in node.input if n)
        for out in node.output:
            if not out or out not in read:
                continue
            layer_of[out] = layer
            if is_float:
                floating.add(out)
                probes.append((out, layer, node.op_type, node.name))
    return probes


def probed_model(model_path: Path, num_layers: int):
    """The export's graph (weights left in their file) with a probe on every floating value; the
    probes' output names, in graph order, with each value's layer, op and node."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    probes = _attribute(graph, num_layers)
    zero = helper.make_tensor(f"{_PROBE}zero", TensorProto.FLOAT, [1], [0.0])
    flat = helper.make_tensor(f"{_PROBE}flat", TensorProto.INT64, [1], [-1])
    graph.initializer.extend([zero, flat])
    names = []
    for i, (value, _, _, _) in enumerate(probes):
        p = f"{_PROBE}{i}"
        graph.node.extend([
            helper.make_node("Cast", [value], [f"{p}_f"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", [f"{p}_f", flat.name], [f"{p}_flat"]),
            helper.make_node("Abs", [f"{p}_flat"], [f"{p}_abs"]),
            # a zero beside it: an empty value has a peak of 0, not an error
            helper.make_node("Concat", [f"{p}_abs", zero.name], [f"{p}_padded"], axis=0),
            helper.make_node("ReduceMax", [f"{p}_padded"], [f"{p}_peak"], keepdims=0),
            helper.make_node("Mul", [f"{p}_flat", zero.name], [f"{p}_zeroed"]),
            helper.make_node("ReduceSum", [f"{p}_zeroed"], [f"{p}_finite"], keepdims=0),
        ])
        graph.output.extend([helper.make_tensor_value_info(f"{p}_peak", TensorProto.FLOAT, []),
                             helper.make_tensor_value_info(f"{p}_finite", TensorProto.FLOAT, [])])
        names.append(p)
    return model, probes, names


def locate(model_path: Path, ep: str, tokens: list[int], num_layers: int, session_factory=None) -> Finding:
    """Run the probed export once on ``tokens`` (one prefill from an empty cache) and read where it
    first stops being finite. ``session_factory(path, ep)`` makes the runtime driver (default:
    ``Decoder``)."""
    import onnx

    from exporter.runtime.session import Decoder, run_bound

    model_path = Path(model_path)
    model, probes, names = probed_model(model_path, num_layers)
    probe_path = model_path.parent / f".overflow-probe-{uuid.uuid4().hex[:8]}.onnx"
    try:
        onnx.save(model, str(probe_path))
        del model
        lm = (session_factory or (lambda path, e: Decoder(path, e, prepack=False, spin=False)))(probe_path, ep)
        state = lm.new_state()
        ids = np.array([tokens], np.int64)
        feeds = lm.step_feeds(ids, state.lengths, np.array([len(tokens)], np.int64), state.width, state.pads)
        for (name_in, _), cache in zip(lm.pairs, state.caches):
            feeds[name_in] = cache
        wanted = [f"{p}_{kind}" for p in names for kind in ("peak", "finite")]
        # bound, not fed: onnxruntime's numpy bridge takes no bf16 cache arrays
        values = run_bound(lm.session, feeds, {name: np.empty((), np.float32) for name in wanted})
        del lm
    finally:
        probe_path.unlink(missing_ok=True)
    first, peaks = None, {}
    for (value, layer, op, node), p in zip(probes, names):
        peak, finite = float(values[f"{p}_peak"]), float(values[f"{p}_finite"])
        part = part_name(layer, num_layers)
        if not math.isfinite(finite) or not math.isfinite(peak):
            if first is None:
                first = (layer, op, node)
        else:
            peaks[part] = max(peaks.get(part, 0.0), peak)
    if first is None:
        return Finding(None, None, None, None, peaks, len(names))
    layer, op, node = first
    return Finding(part_name(layer, num_layers), layer if 0 <= layer < num_layers else None, op, node, peaks,
                   len(names))
