"""How far the traced fallback reaches: causal-LM model types without a hand-built architecture, each
exported through transformers.exporters (exporter/graph/traced.py) and validated like any export.

For every model type of transformers' causal-LM mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) that
``exporter.graph.architectures.ARCHITECTURES`` has no hand-built graph for (or the ``--types`` given):

1. a tiny random checkpoint from the config class alone (``exporter.traced_tiny``: the class's
   defaults, every size it names brought down, weights large enough for decisive logits);
2. ``export_model`` with the default request but builder traced (fp32, cpu; ``auto`` would trace these
   types too, but a type that gains a hand-built architecture stays measured here), validation on: structure, weights by value, parity against transformers
   (16-token prompt, 24 greedy steps), the left-padded batch check, the genai package.

Each type runs in a process of its own (a crash, a hang or a patched torch stays there) with a time
limit. The result records per type the stage reached (``checkpoint``: transformers could not build the
tiny model; ``export``: the exporter refused or the trace failed, with its message; ``validate``: the
export was built and a gate failed; ``passed``: every gate passed), the failed gates and the messages,
shortened. Counts and the most common refusals are summarized at the top.

Usage::

    python benchmarks/traced_fallback.py --out benchmarks/results/traced_fallback_cpu.json
    python benchmarks/traced_fallback.py --types gpt2,opt --work /tmp/tf --out /tmp/tf.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REASON_CHARS = 400  # messages are kept this long: enough to name what failed and what to do
# Address space a model type's process may take: a config whose defaults keep a full-size part (a vision tower)
# fails with MemoryError there instead of drawing the machine's memory (24 GiB, shared) into the OOM killer.
MEMORY_LIMIT = 12 << 30
# A "tiny" checkpoint above this kept a full-size part of its defaults: a finding about the config, not the exporter.
TINY_BYTES = 1 << 30


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def candidate_types() -> list[str]:
    """Causal-LM model types transformers knows and exportfarm builds no graph for by hand."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from exporter.graph.architectures import ARCHITECTURES

    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in ARCHITECTURES]


def shorten(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def run_one(model_type: str, work: Path) -> dict:
    """One model type, in this process: checkpoint, export, validation. Returns its record."""
    from exporter.errors import ExportError, ValidationFailed
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.traced_tiny import make_traced_checkpoint

    record: dict = {"model_type": model_type, "exported": False, "validated": False}
    t0 = time.perf_counter()
    try:
        checkpoint = make_traced_checkpoint(model_type, work / "checkpoint")
    except Exception as err:  # transformers' own errors building the tiny model
        return {**record, "stage": "checkpoint", "reason": shorten(f"{type(err).__name__}: {err}"),
                "seconds": round(time.perf_counter() - t0, 1)}
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    if size > TINY_BYTES:
        return {**record, "stage": "checkpoint", "seconds": round(time.perf_counter() - t0, 1),
                "reason": f"the tiny checkpoint holds {size / 2**30:.1f} GiB: the config's defaults keep a full-size part "
                          "(a vision or audio tower) that exporter.traced_tiny's sizes do not reach"}
    t1 = time.perf_counter()
    try:
        # builder traced, not auto: a type that gains a hand-built architecture is still measured through the fallback
        result = export_model(ExportRequest(model=str(checkpoint), builder="traced"), work / "export", overwrite=True,
                              reference_cache=work / "cache")
        report, manifest = result.report, result.manifest.data
        record.update(stage="passed", exported=True, validated=True)
    except ValidationFailed as failed:
        report = failed.report
        manifest = json.loads((work / "export" / "manifest.json").read_text())
        record.update(stage="validate", exported=True, reason=shorten(failed),
                      failed_gates=[{"gate": g.gate, "check": g.check, "message": shorten(g.message)}
                                    for g in report.failed])
    except ExportError as err:
        return {**record, "stage": "export", "reason": shorten(err), "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as err:  # not an ExportError: a bug of the exporter, named as one
        import traceback

        where = traceback.extract_tb(err.__traceback__)[-1]
        return {**record, "stage": "crash", "reason": shorten(f"{type(err).__name__}: {err} (at {where.filename}:"
                                                              f"{where.lineno})"),
                "seconds": round(time.perf_counter() - t0, 1)}
    record.update(builder=manifest.get("builder"), checks={s: sum(g.status == s for g in report.gates)
                                                           for s in ("pass", "fail", "info")},
                  genai_package=bool((manifest.get("genai") or {}).get("package")),
                  # checkpoint tensors found nowhere in the graph as stored (unread by the forward, or folded)
                  checkpoint_tensors_not_in_graph=next((g.measured for g in report.gates
                                                        if g.check == "every checkpoint tensor is exported"), None),
                  export_seconds=round(sum(v for k, v in manifest["timings_s"].items() if k != "validate"), 1),
                  validate_seconds=manifest["timings_s"].get("validate"),
                  parity=(report.parity or {}) and {k: report.parity[k] for k in
                                                    ("prefill_max_abs_error", "logit_range", "mismatches")},
                  seconds=round(time.perf_counter() - t1, 1))
    return record


def summarize(records: list[dict]) -> dict:
    stages = collections.Counter(r["stage"] for r in records)
    reasons = collections.Counter(_reason_kind(r) for r in records if r["stage"] != "passed")
    return {"model_types": len(records), "exported": sum(r["exported"] for r in records),
            "every_gate_passed": sum(r["validated"] for r in records), "by_stage": dict(stages),
            "failed_gates": dict(collections.Counter(g["check"] for r in records for g in r.get("failed_gates", []))),
            "main_reasons": [{"reason": k, "model_types": v} for k, v in reasons.most_common(12)]}


def _reason_kind(record: dict) -> str:
    """A refusal's message without its model-specific names and numbers, to group alike ones."""
    if record.get("failed_gates"):
        return "validation: " + ", ".join(sorted({g["check"] for g in record["failed_gates"]}))
    text = re.sub(r"\b" + re.escape(record["model_type"]) + r"\b", "<type>", record.get("reason", ""))
    text = re.sub(r"\d+", "N", text)
    return f"{record['stage']}: " + text[:160]


def machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def versions() -> dict:
    from exporter.versions import package_version, runtime_versions

    return {**runtime_versions(), "onnxscript": package_version("onnxscript")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one type, record to --record
    parser.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--types", default=None, help="comma-separated model types (default: every candidate)")
    parser.add_argument("--limit", type=int, default=None, help="the first N candidates only")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a model type may take (default 600)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/traced_fallback"), help="scratch directory")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/traced_fallback_cpu.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.one:
        args.record.write_text(json.dumps(run_one(args.one, args.work), indent=2))
        return 0
    types = args.types.split(",") if args.types else candidate_types()[: args.limit]
    records, started = [], time.time()
    for n, model_type in enumerate(types, 1):
        work = args.work / model_type
        subprocess.run(["rm", "-rf", str(work)], check=False)
        work.mkdir(parents=True)
        record_path = work / "record.json"
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type, "--work", str(work), "--record",
                                   str(record_path)], capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                                  preexec_fn=_limit_memory)
            record = json.loads(record_path.read_text()) if record_path.is_file() else {
                "model_type": model_type, "exported": False, "validated": False, "stage": "crash",
                "reason": shorten(f"the process exited {done.returncode}"
                                  + (" (killed: out of memory?)" if done.returncode == -9 else "")
                                  + f": {done.stderr.strip()[-REASON_CHARS:]}")}
        except subprocess.TimeoutExpired:
            record = {"model_type": model_type, "exported": False, "validated": False, "stage": "timeout",
                      "reason": f"no result within {args.timeout} s"}
        record["wall_seconds"] = round(time.perf_counter() - t0, 1)
        records.append(record)
        print(f"[{n}/{len(types)}] {model_type}: {record['stage']} ({record['wall_seconds']} s)"
              + (f" -- {record.get('reason', '')[:200]}" if record["stage"] != "passed" else ""), flush=True)
        subprocess.run(["rm", "-rf", str(work / "checkpoint"), str(work / "export")], check=False)
        result = {
            "what": "tiny random checkpoints of causal-LM model types without a hand-built architecture, exported "
                    "through transformers.exporters (builder traced), fp32 on cpu, validated",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_minutes": round((time.time() - started) / 60, 1), "machine": machine(), "versions": versions(),
            "summary": summarize(records), "model_types": records,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after every type: a long run is readable midway
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
