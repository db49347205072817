"""Stage 6: publish an export directory to object storage, data first and manifest.json last.

A prefix without manifest.json is not an export (DESIGN.md, Publishing): every file the manifest
lists is uploaded and verified (size and sha256 as the store reports them) before the manifest
is written, so a reader that finds a manifest can trust every object it names. A failed publish
leaves only objects without a manifest, which the next attempt reuses where they already match.

Every write is fenced by the attempt that makes it: it names the version of the key it saw
(``Precondition``: none, or that etag), and the store refuses it once the key changed. A lost
attempt's request that reaches the store late (S3 stopped, a partition) therefore cannot replace
what the attempt that took the job over wrote, and the manifest carries the attempt that
published it. Unpublishing leaves a withdrawn manifest (a tombstone), never an empty key, so a
late manifest write cannot bring a cancelled export back.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Callable
from pathlib import Path

from exporter.errors import ExportError
from exporter.contract import DATA_FILE, MANIFEST_FILE, MODEL_FILE
from exporter.pipeline import load_manifest
from exporter.request import build_tag
from services.storage import ArtifactStore, Guard, ObjectInfo, Precondition, PreconditionFailed, StorageError, check_key

STATUSES = ("ready", "quarantined", "unvalidated")
WITHDRAWN = "withdrawn"  # a tombstone manifest: the prefix held an export that was unpublished
# How many times a write re-reads a key that another writer changed under it before giving up.
CONFLICT_TRIES = 5
# The weights first (by far the biggest, the most likely to be interrupted), then the graph.
UPLOAD_FIRST = (DATA_FILE, MODEL_FILE)
_UNSAFE_SEGMENT_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class PublishResult:
    """Where an export was published, the manifest as published, and what this call uploaded."""

    prefix: str
    manifest: dict
    uploaded: list[str]
    skipped: list[str]  # already at the prefix with the right size and sha256
    already_published: bool = False


def _key_segment(value: object, field: str) -> str:
    """One safe key segment from a manifest value: S3-friendly characters, no '.' or '..'."""
    segment = _UNSAFE_SEGMENT_CHARS.sub("-", str(value))
    segment = re.sub(r"\.{2,}", ".", segment).strip(".-")
    if not segment:
        raise StorageError(f"manifest {field} {value!r} cannot be part of an object key")
    return segment


def _model_segments(manifest: dict) -> list[str]:
    """'org/name' for a hub model (its '@revision' is a key level of its own), the directory name
    for a local checkpoint. Every part is sanitized, and a '..' part is refused, not resolved."""
    source = manifest.get("source", {})
    if source.get("kind") == "local":
        return [_key_segment(Path(source["path"]).name, "source path")]
    repo_id = source.get("repo_id") or manifest["request"]["model"].partition("@")[0]
    parts = repo_id.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise StorageError(f"manifest model {repo_id!r} is not a hub id like 'org/name'")
    return [_key_segment(part, "model") for part in parts]


def export_prefix(manifest: dict) -> str:
    """The object key prefix of an export, per DESIGN.md:
    ``<model>/<revision>/<variant>-<dtype>-<ep>[-ms<max_seq_len>][-hf][-compat]/ort-<version>/<export id>/``.

    Built only from what the manifest records, so the same export always lands in the same place
    and an ORT upgrade or a new revision never overwrites an older export.
    """
    request = manifest["request"]
    build = f"{manifest['variant']}-{request['dtype']}-{request['ep']}"
    if request.get("max_seq_len") is not None:
        build += f"-ms{request['max_seq_len']}"
    build += build_tag((manifest.get("layout") or {}).get("kind"), request.get("compat"))
    segments = [
        *_model_segments(manifest),
        _key_segment(manifest["source"]["revision"], "revision"),
        _key_segment(build, "variant"),
        _key_segment(f"ort-{manifest['versions']['onnxruntime']}", "onnxruntime version"),
        _key_segment(manifest["export_id"], "export_id"),
    ]
    return check_key("/".join(segments) + "/", prefix=True)


def read_published_manifest(store: ArtifactStore, prefix: str) -> dict | None:
    """The manifest published at ``prefix``, or None: without one (or with a withdrawn one), the
    prefix holds no export."""
    data = store.get_bytes(_directory(prefix) + MANIFEST_FILE)
    manifest = json.loads(data) if data is not None else None
    return None if manifest is None or manifest.get("status") == WITHDRAWN else manifest


def files_match_store(store: ArtifactStore, prefix: str, manifest: dict) -> bool:
    """Whether every file ``manifest`` lists is in the store under ``prefix`` with its size and sha256."""
    return all(_matches(store.head(_directory(prefix) + name), entry) for name, entry in manifest["files"].items())


def _directory(prefix: str) -> str:
    prefix = prefix if prefix.endswith("/") else prefix + "/"
    return check_key(prefix, prefix=True)


def _upload_order(manifest: dict) -> list[str]:
    """Data file, graph (where the layout put them), then the rest by name; manifest.json is never in
    it (it goes last)."""
    files, layout = manifest["files"], manifest.get("layout") or {}
    first = (layout["data_file"], layout["model_file"]) if "data_file" in layout else UPLOAD_FIRST
    rest = sorted(name for name in files if name not in (*first, MANIFEST_FILE))
    return [name for name in first if name in files] + rest


def _matches(info: ObjectInfo | None, entry: dict) -> bool:
    return info is not None and info.size == entry["size"] and info.sha256 == entry["sha256"]


def _conflicts(key: str):
    """Tries of a conditional write of ``key``: each re-reads the key that another writer changed."""
    for _ in range(CONFLICT_TRIES):
        yield
    raise StorageError(f"{key} kept changing under this publish ({CONFLICT_TRIES} conditional writes refused): "
                       "another writer is publishing the same export; not publishing")


def _publish_file(store: ArtifactStore, export_dir: Path, key: str, name: str, entry: dict, guard: Guard | None) -> bool:
    """Upload one file unless an identical object is there, replacing only the version it saw;
    verify it. True if it was uploaded."""
    path = export_dir / name
    for _ in _conflicts(key):
        seen = store.head(key)
        if _matches(seen, entry):
            return False
        if not path.is_file():
            raise ExportError(f"{export_dir} has no {name}, which its manifest lists: export it again")
        try:
            store.put_file(key, path, entry["sha256"], guard, expect=Precondition.of(seen))
            break
        except PreconditionFailed:
            continue
    info = store.head(key)
    if not _matches(info, entry):
        found = f"size {info.size}, sha256 {info.sha256}" if info else "no object"
        raise StorageError(
            f"{key} does not match the manifest after upload (expected size {entry['size']}, "
            f"sha256 {entry['sha256']}; the store has {found}): not publishing the manifest"
        )
    return True


def publish_export(
    store: ArtifactStore, export_dir: Path, prefix: str, status: str, guard: Guard | None = None,
    on_uploaded: Callable[[str], None] | None = None, attempt: int | None = None,
) -> PublishResult:
    """Publish the export in ``export_dir`` under ``prefix`` with ``status`` (e.g. "ready").

    Uploads every file in the manifest's "files" map (model.onnx.data, model.onnx, then the rest),
    verifies each against its manifest entry, and only then writes manifest.json with "status" and
    a "published" block naming ``attempt``. Idempotent: if this attempt's manifest is already at
    the prefix it is returned untouched, and objects that already match are not uploaded again; a
    manifest another attempt of the same export left (one lost before it recorded it, or whose
    write landed late) is replaced once this attempt's files are in place. A different export, or
    a withdrawn one, at the same prefix is refused. ``guard()`` runs before and during every write
    and aborts the publish by raising (a worker whose lease ended); ``on_uploaded(name)`` follows
    each file.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    prefix = _directory(prefix)
    manifest_key = prefix + MANIFEST_FILE
    existing, _ = _manifest_object(store, manifest_key)
    if existing is not None:
        _check_same_export(existing, manifest, prefix)
        if existing.get("status") != WITHDRAWN and existing.get("published", {}).get("attempt") == attempt:
            return PublishResult(prefix, existing, uploaded=[], skipped=[], already_published=True)

    uploaded, skipped = [], []
    files = manifest["files"]
    for name in _upload_order(manifest):
        if _publish_file(store, export_dir, check_key(prefix + name), name, files[name], guard):
            uploaded.append(name)
        else:
            skipped.append(name)
        if on_uploaded is not None:
            on_uploaded(name)

    published = {
        **manifest,
        "status": status,
        "published": {
            "prefix": prefix,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "attempt": attempt,
        },
    }

    def same_export(current: dict | None) -> bool:
        if current is not None:
            _check_same_export(current, manifest, prefix)
        return True

    _replace_manifest(store, manifest_key, published, guard, same_export)
    return PublishResult(prefix, published, uploaded, skipped)


def _replace_manifest(store: ArtifactStore, key: str, manifest: dict, guard: Guard | None,
                      accept: Callable[[dict | None], bool]) -> bool:
    """Write ``manifest`` at ``key`` over the version read just before, if ``accept(what is there)``
    (which may also refuse by raising); a key another writer changed meanwhile is read again.
    Returns whether it was written."""
    body = (json.dumps(manifest, indent=2) + "\n").encode()
    for _ in _conflicts(key):
        if guard is not None:
            guard()
        current, seen = _manifest_object(store, key)
        if not accept(current):
            return False
        try:
            store.put_bytes(key, body, "application/json", guard, expect=Precondition.of(seen))
            return True
        except PreconditionFailed:
            continue


def _manifest_object(store: ArtifactStore, key: str) -> tuple[dict | None, ObjectInfo | None]:
    """The manifest object at ``key`` (withdrawn ones included) and the version read, or (None, None).
    The version is taken before the bytes: a write conditional on it fails if they changed since."""
    seen = store.head(key)
    data = store.get_bytes(key) if seen is not None else None
    if data is None:
        return None, None
    return json.loads(data), seen


def _check_same_export(existing: dict, manifest: dict, prefix: str) -> None:
    if existing.get("export_id") != manifest["export_id"]:
        raise StorageError(
            f"{prefix} already holds export {existing.get('export_id')}, not {manifest['export_id']}: "
            "publish each export under its own prefix (export_prefix)"
        )
    withdrawn = existing.get("withdrawn", {})
    if existing.get("status") == WITHDRAWN and withdrawn.get("final", True):
        raise StorageError(f"export {manifest['export_id']} was withdrawn from {prefix} "
                           f"({withdrawn.get('reason')}): it is not published again")


def unpublish(store: ArtifactStore, prefix: str, guard: Guard | None = None, export_id: str | None = None,
              reason: str = "unpublished", final: bool = True, attempt: int | None = None) -> int:
    """Withdraw what was published under ``prefix``: manifest.json is replaced by a withdrawn one
    first, so the prefix stops being an export before any file it names goes away, and a lost
    attempt's manifest write that lands later finds a key it did not expect and is refused. A
    ``final`` withdrawal (a cancel, a job given up) is never published over; a later attempt of the
    same export may replace one that is not (an attempt cleaning up after its own failure, whose
    end the catalog then refused because it had lost the job).

    Fenced like a publish: the withdrawal replaces only the manifest version it read, and an
    ``attempt`` withdraws nothing a later attempt published (its own cleanup, arriving late, must
    not take the takeover's export away); each file is deleted only in the version listed, and only
    once ``guard()`` let it: an attempt that stalled after its withdrawal may come back when a later
    attempt has published its files over it (identical ones unchanged), and its lease is then all
    that tells them apart. Returns how many other objects were deleted.
    """
    prefix = _directory(prefix)
    key = prefix + MANIFEST_FILE
    tombstone = {"export_id": export_id, "status": WITHDRAWN,
                 "withdrawn": {"reason": reason, "final": final, "attempt": attempt,
                               "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}}

    def ours_to_withdraw(current: dict | None) -> bool:  # not a later attempt's export
        by = (current or {}).get("published", {}).get("attempt")
        return attempt is None or by is None or by <= attempt or current.get("status") == WITHDRAWN

    if not _replace_manifest(store, key, tombstone, guard, ours_to_withdraw):
        return 0
    deleted = 0
    for name in store.list_keys(prefix):
        if name == key:
            continue
        info = store.head(name)
        if info is None:
            continue
        try:
            store.delete_key(name, expect=Precondition(info.etag) if info.etag else None, guard=guard)
            deleted += 1
        except PreconditionFailed:
            continue  # replaced since it was listed: whoever wrote it owns it
    return deleted


def read_published(store: ArtifactStore, prefix: str, name: str) -> dict | None:
    """A JSON file published under ``prefix`` (parity report, benchmark, diff), or None."""
    data = store.get_bytes(_directory(prefix) + name)
    return json.loads(data) if data else None


# Reference runs (transformers' greedy run of a checkpoint, exporter.validation.reference) shared by
# every worker. Their keys have two segments; an export's prefix has at least five
# (export_prefix), so no export's key or prefix deletion can ever reach one.
REFERENCES_PREFIX = "_references/"


class StoreReferences:
    """``exporter.validation.reference.SharedReferences`` over the farm's object store: a variant
    validated on one worker reads the reference run another worker computed for the same
    checkpoint instead of running transformers again. A cache: when the store is down, the run is
    computed (or kept) locally and the job goes on; ``guard`` (the job's lease) still stops an
    upload from a worker that lost its job."""

    def __init__(self, store: ArtifactStore, guard: Guard | None = None, on_error: Callable[[str], None] = print):
        self.store, self.guard, self.on_error = store, guard, on_error

    def fetch(self, name: str) -> bytes | None:
        try:
            return self.store.get_bytes(check_key(REFERENCES_PREFIX + name))
        except StorageError as err:
            self.on_error(f"reference run {name} not read from the store ({err}); computing it here")
            return None

    def publish(self, name: str, data: bytes) -> None:
        try:
            self.store.put_bytes(check_key(REFERENCES_PREFIX + name), data, guard=self.guard)
        except StorageError as err:
            self.on_error(f"reference run {name} not shared through the store ({err}); kept on this worker")
