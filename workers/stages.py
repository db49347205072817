"""The worker's stages that run native kernels (validate, bench), as their stage process runs them.

``workers.job`` runs these through ``exporter.runtime.isolated.run_isolated``: in a child process, so
a crash inside onnxruntime (or onnxruntime-genai, or torch) ends the stage with a clear failure and
leaves the worker, and its lease on the job, standing. They take and return plain data, reach the
object store on their own, and stop at the child's checkpoints when the worker says the job is no
longer its to run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from exporter import checkpoints
from workers import failpoints

log = logging.getLogger(__name__)


def validate_stage(export_dir: str, manifest: dict, reference: str, ep: str, quality_thresholds: dict | None,
                   reference_cache: str, settings, export_id: str, attempt: int, progress=None) -> tuple[dict, dict]:
    """``exporter.pipeline.validate_built`` on the export in ``export_dir``; returns the manifest it
    completed and the parity report."""
    from exporter.packaging.package import Manifest
    from exporter.pipeline import validate_built
    from services.publish import StoreReferences
    from services.storage_factory import make_store

    failpoints.crash("validate", export_id, attempt)
    shared = StoreReferences(make_store(settings), checkpoints.checkpoint, log.warning)
    completed = Manifest(manifest)
    report = validate_built(Path(export_dir), completed, reference, ep, progress, quality_thresholds,
                            Path(reference_cache), shared)
    return completed.data, report.to_json()


def bench_stage(export_dir: str, ep: str, contexts: list[int], batches: list[int], steps: int, repeats: int,
                export_id: str, attempt: int) -> None:
    """``exporter.runtime.bench.run_bench`` on the export in ``export_dir`` (writes benchmark.json)."""
    from exporter.runtime.bench import run_bench

    failpoints.crash("bench", export_id, attempt)

    def should_stop() -> bool:
        checkpoints.checkpoint()  # raises when the job must stop
        return False

    run_bench(Path(export_dir), ep=ep, contexts=contexts, batches=batches, steps=steps, repeats=repeats,
              should_stop=should_stop)
