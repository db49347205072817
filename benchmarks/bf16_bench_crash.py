"""The bf16 bench crash (issue 45): the driver as it was, beside the driver as it is, and the probe that catches it.

``exportfarm bench`` of int4 cuda exports computing in bf16 died of SIGSEGV on onnxruntime-gpu 1.31.1 right
after its sessions were made. The suspect: ``Decoder.to_host`` read bf16 logits back through a one-node Cast
session made with the decoder's own providers, CUDA graph capture on: a graph captured on one call and
replayed on later ones, whose input is a new buffer every call and whose output is bound to the host. This
script, on a GPU, exports a tiny llama to int4 gqa for cuda twice (bf16 and fp16 activations) and runs
validation's decode rehearsal (exporter/validation/gates/rehearsal.py) on each in a child process, with two
drivers:

- ``before``: ``Decoder`` with ``to_host`` as it was (its Cast session made with the graph-enabled providers),
- ``after``: ``Decoder`` as it is now,

then ``exportfarm bench`` (the CLI, in its own process) on the bf16 export. Each outcome (a gate result, an exit
status) goes to the JSON::

    python benchmarks/bf16_bench_crash.py --out $OUT/bf16_bench_crash.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rehearse_before_fix(export_dir: str, ep: str) -> dict:
    """The rehearsal with the driver's logits read-back as it was before the fix."""
    from exporter.runtime import session
    from exporter.validation.gates import rehearsal

    class Before(session.Decoder):
        def to_host(self, value):
            if value.data_type() != session.DTYPES["bf16"].ort:
                return value.numpy()
            session.phase("reading bf16 logits back to the host (a one-node Cast session, graph-enabled as before)")
            if self._cast is None:
                import onnx_ir as ir

                x = ir.Value(name="x", type=ir.TensorType(ir.DataType.BFLOAT16), shape=ir.Shape(["d0", "d1", "d2"]))
                node = ir.node("Cast", [x], {"to": ir.DataType.FLOAT})
                y = node.outputs[0]
                y.name, y.type, y.shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape(["d0", "d1", "d2"])
                graph = ir.Graph([x], [y], nodes=[node], opset_imports={"": 21})
                proto = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
                self._cast = self.ort.InferenceSession(proto, providers=self.providers)  # as it was
            binding = self._cast.io_binding()
            binding.bind_ortvalue_input("x", value)
            binding.bind_output("y", "cpu")
            self._cast.run_with_iobinding(binding)
            return binding.copy_outputs_to_cpu()[0]

    original = session.Decoder
    session.Decoder = Before
    try:
        return rehearsal.rehearse(export_dir, ep)
    finally:
        session.Decoder = original


def main() -> int:
    import onnxruntime as ort

    from bf16_bench_crash import rehearse_before_fix as before  # importable by name in the child
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.session import read_metadata
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.gates import rehearsal

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bf16-crash-"))
    checkpoint = make_tiny_checkpoint("llama", work / "checkpoint")
    result = {"benchmark": "bf16_bench_crash", "command": " ".join(["python3", *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "onnxruntime": ort.__version__, "providers": ort.get_available_providers(), "runs": []}
    exports = {}
    for activations in ("bf16", "fp16"):
        out = work / f"int4-{activations}"
        export_model(ExportRequest(model=str(checkpoint), dtype="int4", ep="cuda", variant="gqa",
                                   quant={"activations": activations}), out, validate=False)
        exports[activations] = out
        manifest = json.loads((out / "manifest.json").read_text())
        config = read_metadata(out / "model.onnx")["config"]
        for label, runner in (("before", before), ("after", rehearsal.rehearse)):
            gate = rehearsal.rehearsal_gate(manifest, config, activations, "cuda", runner=runner)
            result["runs"].append({"activations": activations, "driver": label, "status": gate.status,
                                   "measured": gate.measured, "message": gate.message, "details": gate.details})
            print(f"{activations} {label}: {gate.status} {gate.measured} {gate.message[:200]}", flush=True)
            args.out.write_text(json.dumps(result, indent=2))
    cli = subprocess.run([sys.executable, "-m", "services.cli", "bench", str(exports["bf16"]), "--ctx", "128,512",
                          "--steps", "32", "--warmup", "4"], capture_output=True, text=True, cwd=ROOT)
    result["cli_bench_bf16"] = {"exit_status": cli.returncode, "stdout": cli.stdout[-1500:], "stderr": cli.stderr[-1500:]}
    print(f"exportfarm bench of the bf16 export: exit {cli.returncode}", flush=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
