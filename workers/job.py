"""One export job as a worker runs it: export + validate -> bench -> publish, resumable.

Each stage checkpoints into the job's work directory, so a redelivered job (its worker died)
skips what is already done: a finished export directory is not rebuilt, a written benchmark is not
re-run, and publishing is idempotent (same prefix, manifest last). The catalog row is the truth:
stage and percent go there, and a job whose row says cancelled stops at the next checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from exporter.bench import BENCH_FILE, run_bench
from exporter.bench_report import write_report
from exporter.errors import ExportError, ValidationFailed
from exporter.package import MANIFEST_FILE, add_files_to_manifest
from exporter.pipeline import Progress, export_model, load_manifest
from exporter.request import ExportRequest
from services.catalog import exports as catalog
from services.catalog.database import session_scope
from services.jobs import record_runtime
from services.catalog.models import Export, ExportStatus
from services.publish import export_prefix, publish_export
from services.regressions import diff_with_predecessor
from services.storage import StorageError
from services.settings import Settings
from services.sources import source_for_worker
from services.storage_factory import make_store

log = logging.getLogger(__name__)

# Stage -> (start %, end %) of the whole job, for the API's progress figure.
STAGE_SPAN = {
    "resolve": (0, 5), "build": (5, 20), "fold": (20, 25), "package": (25, 55), "validate": (55, 80),
    "bench": (80, 90), "publish": (90, 100),
}


class JobCancelled(Exception):
    pass


class LeaseHeld(Exception):
    """Another live worker is running this job; try again after its lease could expire."""


class CatalogProgress(Progress):
    """Writes stage + percent to the catalog and stops the job once it is cancelled."""

    def __init__(self, settings: Settings, export_id: str, worker: str, cancelled: threading.Event):
        self.settings, self.export_id, self.worker, self.cancelled = settings, export_id, worker, cancelled
        self.current = "resolve"

    def _report(self, stage: str, fraction: float) -> None:
        if self.cancelled.is_set():
            raise JobCancelled(self.export_id)
        lo, hi = STAGE_SPAN[stage]
        with session_scope(self.settings.catalog_url) as session:
            if not catalog.record_stage(session, self.export_id, stage, int(lo + (hi - lo) * fraction), self.worker):
                self.cancelled.set()
        if self.cancelled.is_set():
            raise JobCancelled(self.export_id)

    def stage(self, name: str) -> None:
        self.current = name
        self._report(name, 0.0)

    def layer(self, index: int, total: int) -> None:
        if index == total or index % 8 == 0:
            self._report("build", index / total)

    def bytes_written(self, count: int, total: int) -> None:
        if self.cancelled.is_set():
            raise JobCancelled(self.export_id)


class Heartbeat(threading.Thread):
    """Renews the job's lease; notices cancellation between progress callbacks."""

    def __init__(self, settings: Settings, export_id: str, worker: str, cancelled: threading.Event):
        super().__init__(daemon=True, name=f"heartbeat-{export_id}")
        self.settings, self.export_id, self.worker, self.cancelled = settings, export_id, worker, cancelled
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.settings.heartbeat_s):
            try:
                with session_scope(self.settings.catalog_url) as session:
                    if not catalog.heartbeat(session, self.export_id, self.worker):
                        self.cancelled.set()
            except Exception:  # a database blip must not kill the job; the next beat retries
                log.warning("heartbeat for %s failed", self.export_id, exc_info=True)


def claim(settings: Settings, export_id: str, worker: str) -> Export | None:
    """Mark the export running on this worker; None when there is nothing (left) to do."""
    with session_scope(settings.catalog_url) as session:
        export = session.get(Export, export_id, with_for_update=True)
        if export is None or export.status.terminal:
            return None
        if export.cancel_requested:
            catalog.transition(session, export, ExportStatus.CANCELLED, message="cancelled before start", worker=worker)
            return None
        if export.status is ExportStatus.RUNNING and export.worker != worker and not catalog.lease_expired(export, settings.lease_s):
            raise LeaseHeld(export_id)
        message = "started" if export.status is ExportStatus.QUEUED else f"taken over from {export.worker}"
        catalog.transition(session, export, ExportStatus.RUNNING, stage=export.stage or "resolve", message=message, worker=worker)
        export.worker, export.attempts = worker, export.attempts + 1
        export.heartbeat_at = export.updated_at
        return export


def _finish(settings: Settings, export_id: str, status: ExportStatus, worker: str, **fields) -> None:
    with session_scope(settings.catalog_url) as session:
        export = session.get(Export, export_id, with_for_update=True)
        if export.status.terminal:
            return
        runtime = fields.pop("runtime", None)
        if runtime:
            record_runtime(export, runtime)
        for key, value in fields.items():
            setattr(export, key, value)
        if status.terminal:
            export.percent = 100 if status in (ExportStatus.READY, ExportStatus.QUARANTINED) else export.percent
        catalog.transition(session, export, status, message=fields.get("error"), worker=worker)


def key_figures(manifest: dict, export_dir: Path) -> dict:
    """The few numbers the catalog shows per export (from the parity report and benchmark)."""
    import json

    figures = {"status": manifest.get("status"), "weight_bytes": manifest.get("weight_bytes"),
               "node_count": manifest.get("node_count"), "op_census": manifest.get("op_census")}
    report = export_dir / "parity_report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        checks = {g["check"]: g for g in data["gates"]}
        prefill = checks.get("prefill logits max abs error vs transformers")
        figures["prefill_max_abs_error"] = prefill["measured"] if prefill else None
        figures["failed_gates"] = data["failed_gates"]
        if data.get("parity"):
            figures["near_ties"] = len(data["parity"]["near_ties"])
            figures["token_mismatches"] = len(data["parity"]["mismatches"])
            figures["decode_steps"] = data["parity"]["steps"]
    bench = export_dir / BENCH_FILE
    if bench.is_file():
        figures["decode_ms"] = {str(c["ctx"]): c["decode_ms_median"] for c in json.loads(bench.read_text())["decode"]}
    return figures


def run_export_job(settings: Settings, export_id: str, worker: str) -> ExportStatus | None:
    """Run (or resume) one export job to a terminal state; returns it (None: nothing to do)."""
    export = claim(settings, export_id, worker)
    if export is None:
        return None
    work = settings.scratch_dir / export_id
    export_dir = work / "export"
    cancelled = threading.Event()
    progress = CatalogProgress(settings, export_id, worker, cancelled)
    heartbeat = Heartbeat(settings, export_id, worker, cancelled)
    heartbeat.start()
    try:
        request = ExportRequest(model=export.model, dtype=export.dtype, ep=export.ep, static_cache=export.static_cache,
                                max_seq_len=export.max_seq_len, variant=export.variant)
        if not (export_dir / MANIFEST_FILE).is_file():
            source = source_for_worker(settings, export.model, export.revision)
            work.mkdir(parents=True, exist_ok=True)
            try:
                export_model(dataclasses_replace(request, source), export_dir, progress, overwrite=True,
                         validate_ep=settings.validate_ep, export_id=export_id)
            except ValidationFailed:
                pass  # published quarantined below; the report says why
        manifest = load_manifest(export_dir)
        if not (export_dir / BENCH_FILE).is_file() and manifest.get("status") == "ready":
            progress.stage("bench")
            run_bench(export_dir, ep=settings.validate_ep or export.ep, contexts=settings.bench_contexts,
                      steps=settings.bench_steps, repeats=settings.bench_repeats, should_stop=cancelled.is_set)
            png, md = write_report(export_dir / BENCH_FILE)
            manifest = add_files_to_manifest(export_dir, [BENCH_FILE, png.name, md.name]).data
        progress.stage("publish")
        store = make_store(settings)
        diff = None
        if export.predecessor_id:
            with session_scope(settings.catalog_url) as session:
                predecessor = session.get(Export, export.predecessor_id)
            diff = diff_with_predecessor(settings, store, predecessor, export_dir)
            manifest = load_manifest(export_dir)
        status = ExportStatus.READY if manifest["status"] == "ready" else ExportStatus.QUARANTINED
        prefix = export_prefix(manifest)
        publish_export(store, export_dir, prefix, status.value)
        if cancelled.is_set():
            raise JobCancelled(export_id)
        _finish(settings, export_id, status, worker, storage_prefix=prefix, manifest=_slim(manifest),
                figures=key_figures(manifest, export_dir), timings=manifest.get("timings_s"), stage="publish",
                runtime=manifest["versions"]["onnxruntime"],  # the runtime that really built and validated it
                diff=diff.to_dict() if diff else None, regression=bool(diff and diff.regression))
        shutil.rmtree(work, ignore_errors=True)
        return status
    except (JobCancelled, InterruptedError):
        shutil.rmtree(work, ignore_errors=True)
        _finish(settings, export_id, ExportStatus.CANCELLED, worker, error="cancelled")
        return ExportStatus.CANCELLED
    except ExportError as err:
        shutil.rmtree(work, ignore_errors=True)
        _finish(settings, export_id, ExportStatus.FAILED, worker, error=str(err))
        return ExportStatus.FAILED
    except StorageError:
        raise  # the task retries publishing; the work directory is kept to resume from
    except Exception as err:  # a bug: fail the row loudly rather than leave it running forever
        log.exception("export %s failed", export_id)
        _finish(settings, export_id, ExportStatus.FAILED, worker, error=f"internal error: {type(err).__name__}: {err}")
        return ExportStatus.FAILED
    finally:
        heartbeat.done.set()


def fail_export(settings: Settings, export_id: str, worker: str, error: str) -> None:
    _finish(settings, export_id, ExportStatus.FAILED, worker, error=error)


def _slim(manifest: dict) -> dict:
    """The manifest without its per-initializer table (that stays in the published file)."""
    return {k: v for k, v in manifest.items() if k != "initializers"}


def dataclasses_replace(request: ExportRequest, model_path: str) -> ExportRequest:
    import dataclasses

    return dataclasses.replace(request, model=model_path)
