"""The worker's job function end to end on a GPU: build, validate on CUDA, bench, publish.

For each architecture x dtype x variant, a request is added to a catalog (SQLite, embedded
settings in a scratch directory) and ``workers.job.run_export_job`` runs it in this process, the
way a GPU worker's task does: build, fold, parity against transformers on the EP, bench at every
``--batches`` size, publish to a local object store. Writes one JSON with each job's end state,
its parity summary, its benchmark rows and what landed in the store::

    python benchmarks/gpu_worker_e2e.py --out $OUT/gpu_worker_e2e.json

``--ep cpu --dtypes fp16`` runs the same code without a GPU (CI smoke test). ``--crash-in bench`` (or
validate) plants a native crash (workers/failpoints.py: a read of address 0 in the stage process, at
every attempt) in each job's stage: each must end failed at its first attempt naming the crash, with
this process (the worker) alive; one more job, without the failpoint, must then end ready.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("attn_dynamic", "gqa", "attn_static")


def run(args) -> dict:
    import onnxruntime as ort

    from exporter.contract import BENCH_FILE, MANIFEST_FILE, REPORT_JSON
    from exporter.request import ExportRequest
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from services.catalog.database import session_scope, upgrade_schema
    from services.catalog.models import Export
    from services.jobs import submit_export
    from services.settings import Settings
    from services.storage_factory import make_store
    from workers.job import run_export_job

    root = Path(args.work or tempfile.mkdtemp(prefix="gpu-worker-e2e-"))
    models = root / "models"
    for arch in args.archs:
        make_tiny_checkpoint(arch, models / f"tiny-{arch}")
    settings = Settings(
        data_dir=root / "data", models_dir=models, validate_ep=args.ep, worker_queues="cpu,gpu", bench_contexts=args.contexts,
        bench_batches=args.batches, bench_steps=args.steps, signing_secret="gpu-worker-e2e-signing-secret-0123456789",
    )
    upgrade_schema(settings.catalog_url)
    store = make_store(settings)
    store.ensure_bucket()
    result = {
        "benchmark": "gpu_worker_e2e", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "onnxruntime": ort.__version__, "providers": ort.get_available_providers(), "python": platform.python_version(),
        "settings": {"ep": args.ep, "bench_contexts": args.contexts, "bench_batches": args.batches,
                     "bench_steps": args.steps, "max_seq_len": args.max_seq_len},
        "jobs": [],
    }
    if args.crash_in:
        failpoints = root / "failpoints.json"
        failpoints.write_text(json.dumps({"*": {"point": args.crash_in, "attempt": None, "crash": "SIGSEGV"}}))
        os.environ["EXPORTFARM_FAILPOINTS"] = str(failpoints)
        result["settings"]["crash_in"] = args.crash_in
    plan = [(a, d, v, bool(args.crash_in)) for a in args.archs for d in args.dtypes for v in args.variants]
    if args.crash_in:  # then the same worker (this process) without the failpoint, a request of its own
        plan.append((args.archs[0], args.dtypes[0], args.variants[0], False))
    for arch, dtype, variant, planted in plan:
        if not planted:
            os.environ.pop("EXPORTFARM_FAILPOINTS", None)
        request = ExportRequest(model=f"tiny-{arch}", dtype=dtype, ep=args.ep, variant=variant,
                                static_cache=variant == "attn_static",
                                max_seq_len=args.max_seq_len + (1 if args.crash_in and not planted else 0))
        with session_scope(settings.catalog_url) as session:
            export, _ = submit_export(session, settings, request, force=True)
            export_id = export.id
        started = time.perf_counter()
        outcome = run_export_job(settings, export_id)
        elapsed = time.perf_counter() - started
        with session_scope(settings.catalog_url) as session:
            row = session.get(Export, export_id)
            job = {"arch": arch, "dtype": dtype, "variant": variant, "export_id": export_id,
                   "outcome": outcome, "status": row.status.value, "error": row.error,
                   "attempts": row.attempts, "crash_planted": planted,
                   "seconds": round(elapsed, 1), "prefix": row.storage_prefix}
        keys = store.list_keys(job["prefix"]) if job["prefix"] else []
        job["published"] = sorted(k.rsplit("/", 1)[-1] for k in keys)
        for name, field in ((MANIFEST_FILE, "manifest"), (REPORT_JSON, "parity"), (BENCH_FILE, "benchmark")):
            key = next((k for k in keys if k.endswith("/" + name)), None)
            job[field] = json.loads(store.get_bytes(key)) if key else None
        manifest, parity, bench = job.pop("manifest"), job.pop("parity"), job.pop("benchmark")
        job["manifest_status"] = (manifest or {}).get("status")
        job["parity"] = {"status": (parity or {}).get("status"), "failed_gates": (parity or {}).get("failed_gates"),
                         "summary": (parity or {}).get("parity"),
                         "gates": [{k: g.get(k) for k in ("gate", "check", "status", "measured", "threshold")}
                                   for g in (parity or {}).get("gates", [])]}
        job["decode"] = [{k: c.get(k) for k in ("ctx", "batch", "decode_ms_median", "decode_ms_p90")}
                         for c in (bench or {}).get("decode", [])]
        job["bench_settings"] = (bench or {}).get("settings")
        print(f"{arch} {dtype} {variant}: {job['status']} in {job['seconds']} s "
              f"({len(job['decode'])} bench rows) {job['error'] or ''}", flush=True)
        result["jobs"].append(job)
        args.out.write_text(json.dumps(result, indent=2))
    ready = [j for j in result["jobs"] if j["status"] == "ready" and j["decode"] and "benchmark.json" in j["published"]]
    result["summary"] = {"jobs": len(result["jobs"]), "ready_with_benchmark": len(ready)}
    if args.crash_in:
        crashed = [j for j in result["jobs"] if j["crash_planted"]]
        contained = [j for j in crashed if j["status"] == "failed" and j["attempts"] == 1
                     and "died of SIGSEGV inside native code" in (j["error"] or "")]
        result["summary"].update(crash_planted=len(crashed), contained=len(contained),
                                 ready_after=sum(not j["crash_planted"] and j in ready for j in result["jobs"]))
    args.out.write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--archs", default="phi3,qwen3", type=lambda s: s.split(","))
    parser.add_argument("--dtypes", default="fp16,bf16", type=lambda s: s.split(","))
    parser.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","))
    parser.add_argument("--contexts", default="64,128", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--batches", default="1,8", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=200)
    parser.add_argument("--crash-in", default=None, choices=["validate", "bench"],
                        help="plant a native crash (SIGSEGV) in this stage of every job, then run one job without it")
    args = parser.parse_args()
    result = run(args)
    summary = result["summary"]
    if args.crash_in:
        print(f"{summary['contained']}/{summary['crash_planted']} planted crashes failed once with the reason; "
              f"{summary['ready_after']} job ready after them: {args.out}")
        return 0 if summary["contained"] == summary["crash_planted"] and summary["ready_after"] == 1 else 1
    print(f"{summary['ready_with_benchmark']}/{summary['jobs']} ready with benchmark.json: {args.out}")
    return 0 if summary["ready_with_benchmark"] == summary["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
