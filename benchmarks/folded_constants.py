"""Which nodes over weights survive onnxruntime's session optimizations, per execution provider (issue 48).

benchmarks/vlm_decode_check.py found the genai builder's Gemma-3 decoder spending most of a decode step's GPU time in
a ``transposeNoOverlap`` kernel: its embedding table is Gather(Transpose(lm_head weight)), the head's tied weight
transposed. This script makes a session of a graph on each provider asked for, has onnxruntime write the graph it
will run (``optimized_model_filepath``, weights to a side file), and lists the nodes of the ops named whose inputs are
all weights: the nodes onnxruntime did not fold into constants at session creation, which run at every call (beside
those of the graph as given, before the session).

    python benchmarks/folded_constants.py MODEL.onnx --providers cpu cuda --ops Transpose --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def constant_nodes(model_file: Path, provider: str, ops: set[str]) -> dict:
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        start = time.perf_counter()
        session = ort.InferenceSession(str(model_file), options, providers=[PROVIDERS[provider]])
        made_s = time.perf_counter() - start
        del session
        graph = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False).graph
    weights = {i.name: list(i.dims) for i in graph.initializer}
    given = onnx.load(str(model_file), load_external_data=False).graph
    given_weights = {i.name for i in given.initializer}
    before = [n.name for n in given.node if n.op_type in ops and all(i in given_weights for i in n.input if i)]
    nodes = [{"op": n.op_type, "name": n.name, "inputs": {i: weights[i] for i in n.input if i}}
             for n in graph.node if n.op_type in ops and all(i in weights for i in n.input if i)]
    counts: dict[str, int] = {}
    for n in graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return {"session_s": round(made_s, 2), "given_nodes_over_weights": before, "nodes_over_weights": nodes,
            "node_count": len(graph.node),
            "ops_counted": {op: counts.get(op, 0) for op in sorted(ops)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--providers", nargs="+", default=["cpu", "cuda"], choices=sorted(PROVIDERS))
    parser.add_argument("--ops", nargs="+", default=["Transpose", "Cast"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    result = {"benchmark": "folded_constants", "command": "python benchmarks/folded_constants.py " + " ".join(sys.argv[1:]),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "onnxruntime": ort.__version__,
              "model": args.model.name, "providers": {}}
    for provider in args.providers:
        try:
            result["providers"][provider] = constant_nodes(args.model, provider, set(args.ops))
        except Exception as err:
            result["providers"][provider] = {"error": f"{type(err).__name__}: {str(err)[:600]}"}
        print(provider, json.dumps(result["providers"][provider])[:800], flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
