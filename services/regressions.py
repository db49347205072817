"""After a re-export: diff it against its predecessor (from object storage) and flag regressions."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from exporter.diff import ExportArtifacts, Thresholds, diff_exports, write_diff
from exporter.package import add_files_to_manifest
from services.catalog.models import Export
from services.publish import read_published_manifest
from services.settings import Settings
from services.storage import ArtifactStore


def _published_json(store: ArtifactStore, prefix: str, name: str) -> dict | None:
    data = store.get_bytes(prefix + name)
    return json.loads(data) if data else None


def predecessor_artifacts(store: ArtifactStore, predecessor: Export) -> ExportArtifacts | None:
    """The predecessor as it was published (manifest, parity report, benchmark), or None."""
    if not predecessor.storage_prefix:
        return None
    manifest = read_published_manifest(store, predecessor.storage_prefix)
    if manifest is None:
        return None
    return ExportArtifacts(
        manifest=manifest,
        parity_report=_published_json(store, predecessor.storage_prefix, "parity_report.json"),
        benchmark=_published_json(store, predecessor.storage_prefix, "benchmark.json"),
        label=f"{predecessor.id} (onnxruntime {predecessor.ort_version})",
    )


def diff_with_predecessor(settings: Settings, store: ArtifactStore, predecessor: Export, export_dir: Path):
    """Write diff.json / diff.md into the new export (listed in its manifest); returns the diff."""
    old = predecessor_artifacts(store, predecessor)
    if old is None:
        return None
    new = ExportArtifacts.from_dir(export_dir)
    thresholds = Thresholds(latency_pct=settings.regression_latency_pct, node_count_pct=settings.regression_node_count_pct)
    diff = diff_exports(old, new, thresholds)
    names = [p.name for p in write_diff(diff, export_dir)]
    add_files_to_manifest(export_dir, names)
    return diff


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
