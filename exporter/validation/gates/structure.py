"""Structure gate: what the graph must be, read from the written model.onnx (not from memory)."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

import onnx

from exporter.contract import input_for_output, is_state_input
from exporter.graph.target import COMPAT, COMPAT_MAX_OPSET, ORT_DEFAULT_DOMAIN_OPS
from exporter.validation.gates import GateResult

CONTROL_FLOW = {"If", "Loop", "Scan"}
# Initializers allowed to stay float32 in an fp16/bf16 build: gated DeltaNet's decay parameters,
# which GatedDeltaNet takes in fp32 only (rope tables and norms are stored in the model dtype). By
# name suffix; listed in the report so an exception is always visible.
# A half export's fp32 initializers: a recurrent layer's decay parameters (its log decay is computed in fp32, as
# transformers computes it), the sigmoid routers' selection biases (lfm2_moe's expert_bias, nemotron_h's
# e_score_correction_bias: fp32 into MoEGroupRouter) and DeltaNet's q / k L2 norm scales.
FP32_ALLOWED: tuple[str, ...] = (".A_log", ".dt_bias", ".expert_bias", ".e_score_correction_bias", "l2_norm_scale_")
# A recurrent layer's ops: exactly one recurrence per layer, never unrolled.
# The op that runs gated DeltaNet's recurrence is the export's own (its metadata's recurrent.op:
# GatedDeltaNet, or LinearAttention in an hf-layout export, components/gated_deltanet.py).


def _all_nodes(graph: onnx.GraphProto, path: str = ""):
    for node in graph.node:
        yield path, node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _all_nodes(sub, f"{path}{node.name or node.op_type}/")


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _node_label(path: str, node) -> str:
    return f"{path}{node.name or '<unnamed>'} ({node.op_type})"


def _ort_schema(name: str) -> onnx.defs.OpSchema:
    """onnxruntime's default-domain ``name`` as onnxruntime declares it (only SimplifiedLayerNormalization:
    its RMSNorm, X of T and scale of V -> Y of V, optional inv_std_var of U)."""
    schema, fp, attr = onnx.defs.OpSchema, onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    floats = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
    optional = schema.FormalParameterOption.Optional
    return schema(
        name, "", 1, doc="onnxruntime's own default-domain op",
        inputs=[fp("X", "T"), fp("scale", "V")], outputs=[fp("Y", "V"), fp("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], ""), ("V", floats, "")],
        attributes=[attr("axis", schema.AttrType.INT, ""), attr("epsilon", schema.AttrType.FLOAT, ""),
                    attr("stash_type", schema.AttrType.INT, "")])


@contextlib.contextmanager
def _ort_default_domain_ops(compat: bool):
    """onnx's checker knows only onnx's schemas and refuses a default-domain op it has none for; a compat
    graph's SimplifiedLayerNormalization is onnxruntime's own, so its schema is lent to the checker for
    the check (and taken back: any other model still has it refused)."""
    lent = [name for name in (ORT_DEFAULT_DOMAIN_OPS if compat else ()) if not onnx.defs.has(name, "")]
    for name in lent:
        onnx.defs.register_schema(_ort_schema(name))
    try:
        yield
    finally:
        for name in lent:
            onnx.defs.deregister_schema(name, 1, "")


def _compat_gate(model: onnx.ModelProto, nodes) -> GateResult:
    """A compat graph loads in older onnxruntime: IR <= 10, default opset <= 21, and every default-domain
    op exists at that opset (onnx's schema history; onnxruntime's own ops by name)."""
    opset = {o.domain or "": o.version for o in model.opset_import}.get("", 0)
    newer = sorted({n.op_type for _, n in nodes if n.domain in ("", "ai.onnx") and n.op_type not in ORT_DEFAULT_DOMAIN_OPS
                    and not onnx.defs.has(n.op_type, opset, "")})
    measured = {"ir_version": model.ir_version, "opset": opset}
    ok = model.ir_version <= COMPAT.ir_version and opset <= COMPAT_MAX_OPSET and not newer
    return GateResult(
        "structure", f"compat: IR <= {COMPAT.ir_version}, default opset <= {COMPAT_MAX_OPSET}, no newer op", ok, measured,
        {"ir_version": COMPAT.ir_version, "opset": COMPAT_MAX_OPSET},
        "" if ok else f"IR {model.ir_version}, opset {opset}" + (f"; newer than the opset: {', '.join(newer)}" if newer else ""))


def structure_gates(model_path: Path, variant: str, dtype: str, num_layers: int,
                    compat: bool = False, recurrent_layers: tuple[int, ...] = (), recurrent_ops: tuple[str, ...] = (),
                    attention_layers: list[int] | None = None, traced: bool = False,
                    kv_shared_layers: tuple[int, ...] = ()) -> list[GateResult]:
    """``traced``: the graph was traced by transformers.exporters (exporter/graph/traced.py), so it attends
    and keeps initializers as transformers' code does, not as exportfarm's components do: those two
    checks are reported as information, and parity (with the traced batch check) judges the graph;
    ``compat``: the export is the compat target's graph (graph/target.py is_compat on its metadata);
    ``recurrent_layers``: a hybrid's layers with a recurrent state and no attention, each holding one of
    each of ``recurrent_ops`` (com.microsoft op types); ``attention_layers``: a hybrid's layers that attend
    (its metadata's: nemotron_h's MLP / experts blocks do not, falcon_h1's layers attend beside Mamba2);
    ``kv_shared_layers``: gemma4's layers that attend over an earlier layer's keys and values, writing no cache."""
    results = []
    model = onnx.load(str(model_path), load_external_data=False)
    try:
        # transformers.exporters' CPU fusions emit onnxruntime's default-domain RMSNorm too
        with _ort_default_domain_ops(compat or traced):
            onnx.checker.check_model(str(model_path))
        results.append(GateResult("structure", "onnx checker (with external data)", True, "ok", "ok"))
    except Exception as err:
        results.append(GateResult("structure", "onnx checker (with external data)", False, "error", "ok", str(err)[:500]))
    graph = model.graph
    nodes = list(_all_nodes(graph))
    census = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for _, n in nodes)

    attending = len(attention_layers) if attention_layers is not None else num_layers - len(recurrent_layers)
    expected = {
        "attn_static": {"Attention": attending, "TensorScatter": 2 * (attending - len(kv_shared_layers))},
        "gqa": {"com.microsoft::GroupQueryAttention": attending},
        "attn_dynamic": {"Attention": attending},
    }[variant]
    found = {op: census.get(op, 0) for op in expected}
    if traced:  # whatever transformers' attention lowered to: MatMul / Softmax, or onnxruntime's fused ops
        attends = ("Softmax", "Attention", "com.microsoft::MultiHeadAttention", "com.microsoft::GroupQueryAttention",
                   "com.microsoft::Attention")
        found = {op: census[op] for op in attends if census.get(op)}
        results.append(GateResult(
            "structure", "attention op census", True, found, "exportfarm's attention ops (hand-built graphs only)",
            "a graph traced by transformers.exporters attends as transformers' code lowered; parity and the "
            "left-padded batch check judge it", details=dict(sorted(census.items())), informational=True))
    elif compat:  # a layer attends through MultiHeadAttention, or (soft-capped scores) through MatMul / Softmax
        label = "com.microsoft::MultiHeadAttention or Softmax"
        expected = {label: attending}
        found = {label: census.get("com.microsoft::MultiHeadAttention", 0) + census.get("Softmax", 0)}
    if not traced:
        results.append(GateResult(
            "structure", "attention op census", found == expected, found, expected,
            "" if found == expected else f"expected {expected}, found {found}", details=dict(sorted(census.items())),
        ))

    if recurrent_layers:
        want = {f"com.microsoft::{op}": len(recurrent_layers) for op in recurrent_ops}
        got = {op: census.get(op, 0) for op in want}
        results.append(GateResult(
            "structure", "one fused recurrence per recurrent layer", got == want, got, want,
            "" if got == want else f"expected {want}, found {got}",
        ))

    flow = [_node_label(p, n) for p, n in nodes if n.op_type in CONTROL_FLOW and n.domain in ("", "ai.onnx")]
    # Only attn_static promises a capturable graph; for the others the count is reported, not gated.
    results.append(GateResult(
        "structure", "no If/Loop/Scan (CUDA graph capture)", not flow, len(flow), 0,
        ("control flow: " + ", ".join(flow)) if flow else "", informational=variant != "attn_static",
    ))

    if dtype in ("fp16", "bf16"):
        fp32 = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                and not any(i.name.endswith(a) or i.name.startswith(a) for a in FP32_ALLOWED)]
        results.append(GateResult(
            "structure", f"no float32 initializer in a {dtype} build", not fp32, len(fp32), 0,
            ("float32: " + ", ".join(fp32[:10])) if fp32 else "", details={"allowed": list(FP32_ALLOWED)},
            # transformers keeps some buffers in fp32 on purpose (rotary frequencies): its graph, its choice
            informational=traced,
        ))

    inputs = {v.name: v for v in graph.input}
    bad_shapes = []
    for out in graph.output:
        past_name = input_for_output(out.name)
        if past_name is None:
            continue
        past, present = _dims(inputs[past_name]) if past_name in inputs else None, _dims(out)
        if past is None:
            bad_shapes.append(f"{out.name} has no input {past_name}")
        elif is_state_input(past_name):  # a recurrent state: the same fixed shape in and out
            if present != past or any(not isinstance(d, int) for d in past[1:]):
                bad_shapes.append(f"{out.name} {present} != {past_name} {past} (fixed but the batch)")
        elif variant == "attn_static" and present != past:
            bad_shapes.append(f"{out.name} {present} != {past_name} {past}")
        elif variant != "attn_static" and (len(present) != 4 or present[:2] + present[3:] != past[:2] + past[3:]):
            bad_shapes.append(f"{out.name} {present} vs {past_name} {past}")
    results.append(GateResult(
        "structure", "declared cache output shapes == cache input shapes", not bad_shapes, len(bad_shapes), 0,
        "; ".join(bad_shapes[:5]),
    ))

    used = {name for _, n in nodes for name in n.input} | {o.name for o in graph.output}
    unused = [i.name for i in graph.initializer if i.name not in used]
    results.append(GateResult(
        "structure", "unused initializers", not unused, len(unused), 0, ("unused: " + ", ".join(unused[:10])) if unused else "",
    ))

    if compat:
        results.append(_compat_gate(model, nodes))

    needs_24 = [
        _node_label(p, n) for p, n in nodes
        if n.domain in ("", "ai.onnx") and (n.op_type == "TensorScatter" or (n.op_type == "Attention" and len(n.input) > 6 and n.input[6]))
    ]
    opset = {o.domain or "": o.version for o in model.opset_import}.get("", 0)
    ok = not needs_24 or opset >= 24
    results.append(GateResult(
        "structure", "default opset 24 when TensorScatter / Attention input 6 is used", ok, opset,
        24 if needs_24 else "any", "" if ok else f"opset {opset} but {needs_24[0]} needs 24",
    ))
    return results
