"""Export rows and their lifecycle: every change of status or stage leaves an audit event."""

from __future__ import annotations

import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from exporter.request import ExportRequest, cache_key
from services.catalog.models import Export, ExportEvent, ExportStatus, db_now, utcnow

# Which status may follow which. Anything else is a bug in the caller, not a user error.
TRANSITIONS = {
    ExportStatus.QUEUED: {ExportStatus.RUNNING, ExportStatus.CANCELLED, ExportStatus.FAILED},
    ExportStatus.RUNNING: {
        ExportStatus.RUNNING, ExportStatus.READY, ExportStatus.QUARANTINED, ExportStatus.FAILED,
        ExportStatus.CANCELLED, ExportStatus.QUEUED,
    },
    ExportStatus.READY: set(),
    ExportStatus.QUARANTINED: set(),
    ExportStatus.FAILED: set(),
    ExportStatus.CANCELLED: set(),
}
PUBLISHED_STATUSES = (ExportStatus.READY, ExportStatus.QUARANTINED)


class TransitionError(RuntimeError):
    pass


def transition(
    session: Session, export: Export, to: ExportStatus, *, stage: str | None = None,
    message: str | None = None, worker: str | None = None,
) -> None:
    """Move ``export`` (a row this session has locked or just read) to status ``to`` and record the event."""
    if to not in TRANSITIONS[export.status]:
        raise TransitionError(f"export {export.id}: {export.status.value} -> {to.value} is not allowed")
    now = db_now(session)
    session.add(ExportEvent(
        export_id=export.id, at=now, from_status=export.status.value, to_status=to.value, stage=stage,
        message=message, worker=worker,
    ))
    export.status = to
    if stage is not None:
        export.stage = stage
    if to is ExportStatus.RUNNING and export.started_at is None:
        export.started_at = now
    if to.terminal:
        export.finished_at = now
    export.updated_at = now


def request_of(export: Export) -> ExportRequest:
    return ExportRequest(model=export.model, dtype=export.dtype, ep=export.ep, static_cache=export.static_cache,
                         max_seq_len=export.max_seq_len, variant=export.variant, quant=export.quant,
                         layout=export.layout or "farm", compat=bool(export.compat), builder=export.builder or "auto")


def runtime_fields(export: Export, ort_version: str) -> dict:
    """The onnxruntime that really built and validated ``export``, and so its cache key. Built on
    another runtime than the one its request targeted, it stops answering that request."""
    fields = {"ort_version": ort_version,
              "cache_key": cache_key(request_of(export), export.revision, export.exporter_version, ort_version)}
    if ort_version != export.ort_version:
        fields["live_key"] = None
    return fields


def find_live_duplicate(session: Session, request_key: str) -> Export | None:
    """The queued / running / ready export that answers requests with this key, if any."""
    return session.scalars(select(Export).where(Export.live_key == request_key)).first()


def ended_fields(status: ExportStatus) -> dict:
    """What a terminal status changes beyond itself: only a ready export keeps answering identical
    requests; a failed, cancelled or quarantined one lets the next identical request try again."""
    return {} if status is ExportStatus.READY else {"live_key": None}


def lease_expired(export: Export, lease_s: float, now: datetime.datetime | None = None) -> bool:
    """Whether a running export's lease ran out (or was released: no heartbeat at all)."""
    now = now or utcnow()
    beat = export.heartbeat_at
    if beat is None:
        return True
    if beat.tzinfo is None:  # SQLite hands back naive datetimes
        beat = beat.replace(tzinfo=datetime.timezone.utc)
    return (now - beat).total_seconds() > lease_s


def key_figures(manifest: dict, parity_report: dict | None, benchmark: dict | None) -> dict:
    """The few numbers the catalog shows per export (from its manifest, parity report and benchmark)."""
    figures = {"status": manifest.get("status"), "weight_bytes": manifest.get("weight_bytes"),
               "node_count": manifest.get("node_count"), "op_census": manifest.get("op_census")}
    if parity_report:
        checks = {g["check"]: g for g in parity_report["gates"]}
        prefill = checks.get("prefill logits max abs error vs transformers")
        figures["prefill_max_abs_error"] = prefill["measured"] if prefill else None
        figures["failed_gates"] = parity_report["failed_gates"]
        if parity_report.get("parity"):
            figures["near_ties"] = len(parity_report["parity"]["near_ties"])
            figures["token_mismatches"] = len(parity_report["parity"]["mismatches"])
            figures["decode_steps"] = parity_report["parity"]["steps"]
    if benchmark:
        figures["decode_ms"] = {str(c["ctx"]): c["decode_ms_median"] for c in benchmark["decode"]}
    return figures


def outcome_fields(prefix: str, manifest: dict, parity_report: dict | None, benchmark: dict | None,
                   diff: dict | None) -> dict:
    """What a published export's row records: where it is, its manifest (without the per-weight
    table, which stays in the published file), key figures, timings and its diff."""
    return {
        # what was built: a hub model the worker found no hand-built architecture for was traced as attn_dynamic,
        # whatever variant its request resolved to when it was queued
        **({"variant": manifest["variant"]} if manifest.get("variant") else {}),
        "storage_prefix": prefix, "stage": "publish",
        "manifest": {k: v for k, v in manifest.items() if k != "initializers"},
        "figures": key_figures(manifest, parity_report, benchmark), "timings": manifest.get("timings_s"),
        "diff": diff, "regression": bool(diff and diff.get("regression")),
    }
