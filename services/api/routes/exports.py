"""/exports: submit, read, list, cancel, artifacts, diff."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response

from exporter.contract import MANIFEST_FILE
from services import jobs
from services.api.deps import AdminDep, ContextDep, ReaderDep, SessionDep
from services.api.schemas import Artifact, Artifacts, ExportCreate, ExportList, ExportOut
from services.catalog.exports import PUBLISHED_STATUSES
from services.catalog.models import ExportStatus
from services.queue import queue_for

router = APIRouter(prefix="/exports", tags=["exports"])
ExportId = Annotated[str, Path(min_length=1, max_length=64)]
StatusName = Literal[tuple(s.value for s in ExportStatus)]  # type: ignore[valid-type]

# OpenAPI links: what a client (or schemathesis's stateful phase) can do with a new export's id.
_BY_ID = {"export_id": "$response.body#/id"}
EXPORT_LINKS = {name: {"operationId": op, "parameters": _BY_ID} for name, op in
                (("ReadExport", "read_export"), ("CancelExport", "cancel_export"),
                 ("ExportArtifacts", "export_artifacts"), ("ExportDiff", "export_diff"))}


@router.post("", status_code=202, response_model=ExportOut, operation_id="create_export",
             responses={200: {"description": "an identical export exists; it is returned", "links": EXPORT_LINKS},
                        202: {"description": "queued", "links": EXPORT_LINKS}})
def create_export(body: ExportCreate, response: Response, session: SessionDep, context: ContextDep, _: AdminDep):
    export, created = jobs.submit_export(session, context.settings, body.to_request(), force=body.force)
    # Commit here, in this thread: the row is the outbox entry, and must exist before its message.
    session.commit()
    if not created:
        context.metrics.submissions.labels("duplicate").inc()
        response.status_code = 200
        return ExportOut.of(export)
    # If the broker does not take the message now, the sweeper sends it once the broker is back:
    # the request is accepted either way.
    sent = context.sweeper.ring(export.id, queue_for(export.ep, export.target_ort, export.queue), first=True,
                                placed_on=export.queue, attempts=export.attempts)
    context.metrics.submissions.labels("queued" if sent else "queued-unsent").inc()
    session.refresh(export)
    response.headers["Location"] = f"/exports/{export.id}"
    return ExportOut.of(export)


@router.get("/{export_id}", response_model=ExportOut, operation_id="read_export")
def read_export(export_id: ExportId, session: SessionDep, _: ReaderDep):
    return ExportOut.of(jobs.get_export(session, export_id), with_events=True)


@router.get("", response_model=ExportList, operation_id="list_exports")
def list_exports(
    session: SessionDep, _: ReaderDep,
    model: Annotated[str | None, Query(max_length=300)] = None,
    status: StatusName | None = None,
    variant: Literal["attn_static", "gqa", "attn_dynamic"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
):
    rows, total = jobs.list_exports(session, model=model, status=status, variant=variant, limit=limit, offset=offset)
    return ExportList(items=[ExportOut.of(r) for r in rows], total=total, limit=limit, offset=offset)


@router.delete("/{export_id}", response_model=ExportOut, status_code=202, operation_id="cancel_export")
def cancel_export(export_id: ExportId, session: SessionDep, context: ContextDep, _: AdminDep):
    """Cancel: at once when queued or when its worker is gone; a live worker stops within HEARTBEAT_S.
    Whatever was uploaded is deleted first (manifest first)."""
    export, settle = jobs.request_cancel(session, context.settings, export_id)
    session.commit()
    if settle:
        context.sweeper.settle_cancel(export_id)
        session.refresh(export)
    return ExportOut.of(export)


@router.get("/{export_id}/artifacts", response_model=Artifacts, operation_id="export_artifacts")
def export_artifacts(export_id: ExportId, session: SessionDep, context: ContextDep, _: ReaderDep):
    """Presigned links to every published file, with its size and sha256."""
    export = jobs.get_export(session, export_id)
    if export.status not in PUBLISHED_STATUSES or not export.manifest:
        raise jobs.Conflict(f"export {export_id} is {export.status.value}: nothing is published yet")
    store, expires = context.store, context.settings.presign_expires_s
    files = {name: Artifact(url=store.presigned_url(export.storage_prefix + name, expires), size=entry["size"],
                            sha256=entry["sha256"]) for name, entry in export.manifest["files"].items()}
    manifest = store.head(export.storage_prefix + MANIFEST_FILE)  # its own sha256 is only in the store
    if manifest is None:
        raise jobs.Conflict(f"export {export_id} has no manifest in the store (it was removed): export it again")
    files[MANIFEST_FILE] = Artifact(url=store.presigned_url(export.storage_prefix + MANIFEST_FILE, expires),
                                      size=manifest.size, sha256=manifest.sha256 or "")
    return Artifacts(export_id=export.id, prefix=export.storage_prefix, expires_in_s=expires, files=files)


@router.get("/{export_id}/diff", operation_id="export_diff")
def export_diff(export_id: ExportId, session: SessionDep, _: ReaderDep) -> dict:
    export = jobs.get_export(session, export_id)
    if export.diff is None:
        raise jobs.NotFound(f"export {export_id} has no diff (it is not a re-export, or is not finished)")
    return export.diff
