"""Graph size of a hybrid export beside transformers' own exporter (transformers.exporters, fused for
onnxruntime's CPU EP), same checkpoint: nodes in all, nodes per recurrent and per attention layer, and
which ops carry the recurrence (issue 46: one fused recurrence op per linear layer, nothing unrolled).

    python benchmarks/hybrid_graph.py [--arch qwen3_5_text lfm2 ...] [--out benchmarks/results/hybrid_graph.json]

Ours is counted on the written model.onnx (attn_dynamic, fp32); transformers' on the graph its
OnnxExporter(OnnxConfig(dynamic=True, ort_fusions="cpu")) returns for a two-row prompt. A layer's nodes
are those torch.onnx records under its module (name scopes "model.layers.i"); ours, the nodes added while
layer i was built. transformers' graph here is a prefill without cache inputs (what OnnxExporter gives
for these sample inputs): its recurrence is the chunked delta rule unrolled into ops.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import tempfile
import time
from pathlib import Path

import onnx

RECURRENCE_OPS = ("GatedDeltaNet", "LinearAttention", "CausalConvWithState", "Loop", "Scan")


def ours(checkpoint: Path, work: Path) -> dict:
    from exporter.graph.build import build_model
    from exporter.packaging.resolve import resolve_source
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    request = ExportRequest(model=str(checkpoint), dtype="fp32", ep="cpu", variant="attn_dynamic")
    marks = []
    built = build_model(request, resolve_source(str(checkpoint)), on_layer=lambda i, n: marks.append(None))
    del built, marks
    # Per layer: build again, recording how many nodes the tape holds after each layer.
    from exporter.graph import task

    counts = []
    original = task.decoder_layer

    def counting(b, *args, **kwargs):
        before = len(b.tape.nodes)
        out = original(b, *args, **kwargs)
        counts.append(len(b.tape.nodes) - before)
        return out

    task.decoder_layer = counting
    try:
        result = build_model(request, resolve_source(str(checkpoint)))
    finally:
        task.decoder_layer = original
    cfg = result.config
    out = export_model(request, work / "ours", validate=False).out_dir
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    return {"nodes": len(graph.node), "nodes_per_layer_as_built": counts,
            "recurrent_layers": [i for i in range(cfg.num_layers) if cfg.is_recurrent(i)],
            "recurrence_ops": {op: ops[op] for op in RECURRENCE_OPS if ops[op]}, "ops": dict(sorted(ops.items()))}


def transformers_exporters(checkpoint: Path) -> dict:
    import torch
    import transformers
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (2, 16))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    start = time.perf_counter()
    exported = OnnxExporter().export(model, inputs, config=OnnxConfig(dynamic=True, ort_fusions="cpu"))
    seconds = time.perf_counter() - start
    program = exported.program
    nodes = list(program.graph.all_nodes()) if hasattr(program.graph, "all_nodes") else list(program.graph)
    ops = collections.Counter(n.op_type for n in nodes)
    per_layer = collections.Counter()
    for node in nodes:  # torch.onnx records each node's module path (its name scopes)
        match = re.search(r"'model\.layers\.(\d+)'", node.metadata_props.get("pkg.torch.onnx.name_scopes", ""))
        if match:
            per_layer[int(match.group(1))] += 1
    return {"nodes": len(nodes), "nodes_per_layer_by_name": [per_layer[i] for i in range(model.config.num_hidden_layers)],
            "unattributed_nodes": len(nodes) - sum(per_layer.values()), "export_seconds": round(seconds, 1),
            "recurrence_ops": {op: ops[op] for op in RECURRENCE_OPS if ops[op]}, "ops": dict(sorted(ops.items()))}


def main() -> None:
    from exporter.tiny_checkpoint import TEXT_HYBRID_ARCHITECTURES, make_tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="*", default=list(TEXT_HYBRID_ARCHITECTURES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hybrid_graph.json"))
    parser.add_argument("--reuse-transformers", type=Path,
                        help="an earlier result whose transformers.exporters figures are kept (they do not depend on "
                             "this exporter's code; its export takes minutes a model)")
    args = parser.parse_args()
    earlier = json.loads(args.reuse_transformers.read_text())["models"] if args.reuse_transformers else {}
    import transformers

    results = {"benchmark": "hybrid_graph", "command": "python benchmarks/hybrid_graph.py " + " ".join(
        f"--arch {a}" for a in args.arch), "versions": {"transformers": transformers.__version__,
                                                          "onnx": onnx.__version__, "python": platform.python_version()},
               "checkpoints": "exporter/tiny_checkpoint.py (random weights; layers per family there: most 4, recurrent on 0 and 2)", "models": {}}
    for arch in args.arch:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = make_tiny_checkpoint(arch, Path(tmp) / "ckpt")
            entry = {"ours": ours(checkpoint, Path(tmp))}
            try:
                if "transformers_exporters" in earlier.get(arch, {}):
                    entry["transformers_exporters"] = {**earlier[arch]["transformers_exporters"],
                                                       "reused_from": str(args.reuse_transformers)}
                else:
                    entry["transformers_exporters"] = transformers_exporters(checkpoint)
            except Exception as err:  # reported, not hidden: the comparison says where it could not run
                entry["transformers_exporters"] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        results["models"][arch] = entry
        print(arch, json.dumps({k: {kk: v.get(kk) for kk in ("nodes", "nodes_per_layer_as_built", "nodes_per_layer_by_name",
                                                               "recurrence_ops", "error")} for k, v in entry.items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
