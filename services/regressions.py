"""After a re-export: diff it against its predecessor (from object storage) and flag regressions."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from exporter.contract import BENCH_FILE, REPORT_JSON
from exporter.reports.diff import ExportArtifacts, ExportDiff, Thresholds, diff_exports, write_diff
from services.catalog.models import Export
from services.publish import read_published, read_published_manifest
from services.settings import Settings
from services.storage import ArtifactStore


def predecessor_artifacts(store: ArtifactStore, predecessor: Export) -> ExportArtifacts | None:
    """The predecessor as it was published (manifest, parity report, benchmark), or None."""
    if not predecessor.storage_prefix:
        return None
    manifest = read_published_manifest(store, predecessor.storage_prefix)
    if manifest is None:
        return None
    return ExportArtifacts(
        manifest=manifest,
        parity_report=read_published(store, predecessor.storage_prefix, REPORT_JSON),
        benchmark=read_published(store, predecessor.storage_prefix, BENCH_FILE),
        label=f"{predecessor.id} (onnxruntime {predecessor.ort_version})",
    )


def diff_with_predecessor(settings: Settings, store: ArtifactStore, predecessor: Export, new: ExportArtifacts,
                          export_dir: Path) -> tuple[ExportDiff, list[str]] | None:
    """Diff a re-export (its manifest and reports, in memory) against its published predecessor.

    Writes diff.json / diff.md into ``export_dir`` and returns the diff with those file names (for
    the caller's manifest), or None when the predecessor has nothing published to compare with.
    """
    old = predecessor_artifacts(store, predecessor)
    if old is None:
        return None
    thresholds = Thresholds(latency_pct=settings.regression_latency_pct, node_count_pct=settings.regression_node_count_pct)
    diff = diff_exports(old, new, thresholds)
    return diff, [p.name for p in write_diff(diff, export_dir)]


def regressions_view(session: Session, limit: int = 200) -> list[dict]:
    """Exports whose diff against their predecessor flagged a regression, newest first."""
    rows = session.scalars(
        select(Export).where(Export.regression.is_(True)).order_by(Export.finished_at.desc()).limit(limit)
    ).all()
    return [
        {"export_id": e.id, "predecessor_id": e.predecessor_id, "model": e.model, "variant": e.variant,
         "dtype": e.dtype, "ep": e.ep, "status": e.status.value, "reason": e.reason,
         "ort": {"old": (e.diff or {}).get("old", {}).get("onnxruntime"), "new": e.ort_version},
         "regressions": (e.diff or {}).get("regressions", []), "finished_at": e.finished_at}
        for e in rows
    ]
