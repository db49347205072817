"""One export job as a worker runs it: resolve -> build -> validate -> bench -> diff -> publish.

The worker claims the job for one attempt (services.lifecycle) and keeps its lease alive
(``LeaseKeeper``). Each stage is a function over one in-memory ``JobRecord`` (request, source,
manifest, reports) and is checkpointed once, after it completes, in the worker's work directory,
so an attempt that dies resumes on the same worker from the last finished stage. The manifest is
written once, just before publishing.

Every catalog write is fenced by the attempt, and every store write is guarded by the lease: once
the sweeper has given the job to another attempt (this worker was stopped or cut off past its
lease), the next check raises ``Fenced`` and the job ends here without writing anything more.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from exporter import __version__, checkpoints
from exporter.cache import Trim, plan_hub_cache, plan_lru
from exporter.runtime.isolated import ProcessLost, run_isolated
from exporter.reports.bench_report import write_report
from exporter.contract import BENCH_FILE, DATA_FILE
from exporter.reports.diff import ExportArtifacts
from exporter.errors import ExportError
from exporter.packaging.hf_layout import write_hf_layout
from exporter.packaging.package import Manifest
from exporter.pipeline import Progress, build_export
from exporter.request import ExportRequest
from exporter.packaging.resolve import ResolvedSource, resolve_hub_source, resolve_source
from exporter.versions import ort_version
from services import lifecycle, placement
from services.catalog.database import session_scope
from services.catalog.exports import outcome_fields, request_of
from services.catalog.models import Export, ExportStatus
from services.lifecycle import CancelRequested, Fenced, Lease
from services.publish import StoreReferences, export_prefix, publish_export, unpublish
from services.regressions import diff_with_predecessor
from services.settings import Settings
from services.sources import UNRESOLVED_PREFIX, locate_model
from services.storage import ArtifactStore, StorageError
from services.storage_factory import make_store
from workers import failpoints, pod_deletion_cost
from workers.stages import bench_stage, validate_stage

log = logging.getLogger(__name__)
T = TypeVar("T")

# Stage -> (start %, end %) of the whole job, for the API's progress figure.
STAGE_SPAN = {
    "resolve": (0, 5), "build": (5, 20), "fold": (20, 25), "package": (25, 55), "validate": (55, 80),
    "bench": (80, 88), "diff": (88, 89), "layout": (89, 90), "publish": (90, 100),
}
RECORD_FILE = "record.json"


class JobCancelled(Exception):
    pass


class CatalogUnavailable(Exception):
    """The catalog could not be reached to claim the job; the message is retried later."""


@dataclasses.dataclass(frozen=True)
class WorkerIdentity:
    """A worker's name (as its queues and reports know it) and its main process, which owns leases."""

    name: str
    pid: int


def worker_identity() -> WorkerIdentity:
    name = os.environ.get("EXPORTFARM_WORKER_NAME") or socket.gethostname()
    return WorkerIdentity(name, int(os.environ.get("EXPORTFARM_WORKER_PID") or os.getpid()))


# --- the lease --------------------------------------------------------------------------------------


class LeaseKeeper:
    """Renews the job's lease in a thread and answers, for the job's thread, "do I still own it?".

    The sweeper takes a job away once its heartbeat is older than LEASE_S. The worker trusts its
    lease only for ``LEASE_S - margin`` after the last renewal it *started* (monotonic time, which
    keeps running while a process is stopped), so by the time another attempt can exist, this one
    has stopped writing. Past that window ``check`` renews synchronously, and waits while the
    catalog is unreachable rather than write on a lease it cannot confirm.
    """

    def __init__(self, settings: Settings, lease: Lease):
        self.settings, self.lease = settings, lease
        margin = max(settings.heartbeat_s, settings.lease_s / 4)
        self.window_s = settings.lease_s - margin
        self._renewed_at = time.monotonic()  # the claim itself set the heartbeat
        self._lost, self._cancel, self._done = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"lease-{lease.export_id}")

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._done.set()
        self._thread.join(timeout=self.settings.heartbeat_s + 5)

    def _renew(self) -> None:
        started = time.monotonic()
        try:
            with session_scope(self.settings.catalog_url) as session:
                cancel = lifecycle.renew(session, self.lease)
        except Fenced:
            if not self._lost.is_set():
                log.warning("%s: lost its lease; stopping without writing anything more", self.lease)
            self._lost.set()
            raise
        self._renewed_at = max(self._renewed_at, started)
        if cancel:
            self._cancel.set()

    def _run(self) -> None:
        while not self._done.wait(self.settings.heartbeat_s):
            try:
                self._renew()
            except Fenced:
                return
            except Exception:  # a database blip must not end the job; check() stops writes if it lasts
                log.warning("could not renew the lease of %s", self.lease, exc_info=True)

    def note_cancel(self, cancel: bool) -> None:
        if cancel:
            self._cancel.set()

    def owned_until(self) -> float:
        """The monotonic time until which this attempt trusts its lease without renewing it: how long
        a stage process may go on without hearing from the worker again."""
        return self._renewed_at + self.window_s

    def check_owned(self) -> None:
        """Raise Fenced unless this attempt still owns the job (renewing first if the window passed)."""
        while True:
            if self._lost.is_set():
                raise Fenced(f"{self.lease}: the lease was taken away")
            if time.monotonic() - self._renewed_at <= self.window_s:
                return
            try:
                self._renew()
                return
            except Fenced:
                raise
            except Exception as err:
                log.warning("%s: cannot confirm the lease (%s); waiting for the catalog", self.lease, err)
                time.sleep(min(1.0, self.settings.heartbeat_s))

    def check(self) -> None:
        """``check_owned``, and raise JobCancelled once a cancel was requested."""
        self.check_owned()
        if self._cancel.is_set():
            raise JobCancelled(self.lease.export_id)


# --- the record and its checkpoints -------------------------------------------------------------------


@dataclasses.dataclass
class JobRecord:
    """What one export is, as it goes through the stages; ``done`` lists the stages checkpointed."""

    export_id: str
    request: dict
    revision: str
    predecessor_id: str | None
    runtime: dict  # exporter + onnxruntime versions: only the same runtime resumes a checkpoint
    done: list[str] = dataclasses.field(default_factory=list)
    source: dict | None = None
    manifest: dict | None = None
    parity_report: dict | None = None
    benchmark: dict | None = None
    diff: dict | None = None
    earlier_prefix: str | None = None  # the catalog's storage_prefix when this attempt claimed the job

    def save(self, work: Path) -> None:
        tmp = work / f".{RECORD_FILE}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        tmp.replace(work / RECORD_FILE)  # a checkpoint is whole or absent

    @classmethod
    def load(cls, work: Path) -> JobRecord | None:
        try:
            return cls(**json.loads((work / RECORD_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def export_request(self) -> ExportRequest:
        return ExportRequest(**self.request)

    def resolved_source(self) -> ResolvedSource:
        s = self.source
        return ResolvedSource(Path(s["path"]), s["kind"], s["repo_id"], s["revision"])


def current_runtime() -> dict:
    return {"exporter": __version__, "onnxruntime": ort_version()}


def _work_root(settings: Settings, identity: WorkerIdentity) -> Path:
    return settings.scratch_dir / re.sub(r"[^A-Za-z0-9._-]+", "-", identity.name)


@dataclasses.dataclass
class Job:
    settings: Settings
    lease: Lease
    keeper: LeaseKeeper
    store: ArtifactStore
    work: Path
    progress: Progress = dataclasses.field(default_factory=Progress)
    publishing: str | None = None  # the prefix this attempt recorded before uploading

    @property
    def export_dir(self) -> Path:
        return self.work / "export"

    @property
    def laid_out_dir(self) -> Path:
        """The export laid out for another consumer (hf), when the request asks for it."""
        return self.work / "export-hf"

    def publish_dir(self, record: JobRecord) -> Path:
        return self.laid_out_dir if (record.manifest.get("layout") or {}).get("kind") else self.export_dir

    def catalog(self, write: Callable, *args, **kwargs):
        """A fenced catalog write, retried while the database is unreachable (the lease permitting)."""
        delay = 0.5
        while True:
            try:
                with session_scope(self.settings.catalog_url) as session:
                    return write(session, self.lease, *args, **kwargs)
            except (Fenced, CancelRequested):
                raise
            except SQLAlchemyError as err:
                log.warning("%s: catalog write failed (%s); retrying", self.lease, type(err).__name__)
                self.keeper.check_owned()
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


class CatalogProgress(Progress):
    """Stage and percent into the catalog (fenced); every callback is also a lease checkpoint."""

    def __init__(self, job: Job):
        self.job = job

    def _record(self, stage: str, fraction: float) -> None:
        lo, hi = STAGE_SPAN[stage]
        try:
            with session_scope(self.job.settings.catalog_url) as session:
                self.job.keeper.note_cancel(
                    lifecycle.record_stage(session, self.job.lease, stage, int(lo + (hi - lo) * fraction)))
        except SQLAlchemyError as err:  # progress is not worth stopping for; the lease keeper guards writes
            log.warning("%s: could not record stage %s (%s)", self.job.lease, stage, type(err).__name__)

    def stage(self, name: str) -> None:
        self.job.keeper.check()
        self._record(name, 0.0)
        failpoints.pause(name, self.job.lease.export_id, self.job.lease.attempt, self.job.keeper.check)

    def layer(self, index: int, total: int) -> None:
        self.job.keeper.check()
        if index == total or index % 8 == 0:
            self._record("build", index / total)

    def bytes_written(self, count: int, total: int) -> None:
        self.job.keeper.check()


# --- the stages -------------------------------------------------------------------------------------


def cache_trims(settings: Settings, keep: set[str] = frozenset(),
                keep_repos: set[str] = frozenset()) -> dict[str, Trim]:
    """What keeping this worker's caches within their sizes deletes now: rope tables and reference runs
    (least recently used first, within CACHE_MAX_GB each) and downloaded hub revisions (within
    HUB_CACHE_MAX_GB); never a file or revision used in the last hour, a commit in ``keep`` nor a
    revision of a repository in ``keep_repos``."""
    budget = int(settings.cache_max_gb * 2**30)
    trims = {name: plan_lru(settings.data_dir / name, budget) for name in ("rope", "references")}
    if settings.hub_cache_max_gb is not None:
        trims["hub"] = plan_hub_cache(int(settings.hub_cache_max_gb * 2**30), keep=keep, keep_repos=keep_repos)
    return trims


def revisions_in_use(settings: Settings, session=None) -> tuple[set[str], set[str]]:
    """The hub commits, and for a ref not resolved yet the repositories, that live jobs on this host
    need: those of every work directory under the scratch directory (each worker's, one per export
    it claimed) whose export is queued or running. A resumed attempt reads its checkpoint again
    without resolving it, whenever it last touched the files; with no ``session`` (the catalog
    unreachable) every work directory counts."""
    records = {}
    for path in settings.scratch_dir.glob(f"*/*/{RECORD_FILE}"):
        record = JobRecord.load(path.parent)
        if record is not None and record.export_id == path.parent.name:
            records[record.export_id] = record
    live = set(records) if session is None or not records else set(session.scalars(select(Export.id).where(
        Export.id.in_(list(records)), Export.status.in_((ExportStatus.QUEUED, ExportStatus.RUNNING)))))
    commits, repos = set(), set()
    for export_id in live:
        record = records[export_id]
        if record.source:
            commits.add(record.source["revision"])
        elif record.revision.startswith(UNRESOLVED_PREFIX):
            repos.add(record.request["model"].partition("@")[0])
        else:
            commits.add(record.revision)
    return commits, repos


def _keep(settings: Settings, revision: str, repo: str | None, session=None) -> tuple[set[str], set[str]]:
    """What no trim may delete for a job of ``revision`` (of hub repository ``repo``): its commit, or
    every revision of its repository while the ref is unresolved, and what live jobs on this host need
    (read in ``session``, else in a session of its own)."""
    try:
        if session is not None:
            commits, repos = revisions_in_use(settings, session)
        else:
            with session_scope(settings.catalog_url) as own:
                commits, repos = revisions_in_use(settings, own)
    except SQLAlchemyError:
        commits, repos = revisions_in_use(settings)
    if not revision.startswith(UNRESOLVED_PREFIX):
        commits.add(revision)
    elif repo:
        repos.add(repo)
    return commits, repos


def trim_caches(settings: Settings, revision: str, repo: str | None) -> None:
    """Keep this worker's caches within their sizes before a job adds to them (``cache_trims``),
    keeping what this job and the other live jobs on this host need (``_keep``)."""
    for name, trim in cache_trims(settings, *_keep(settings, revision, repo)).items():
        deleted, freed = trim.delete()
        if deleted and name == "hub":
            log.info("hub cache: deleted %s (%.1f GB) to stay within HUB_CACHE_MAX_GB", ", ".join(trim.names),
                     freed / 2**30)
        elif deleted:
            log.info("cache %s: deleted %d least recently used files (%.1f MB) to stay within CACHE_MAX_GB",
                     name, deleted, freed / 2**20)


def resolve(job: Job, record: JobRecord) -> None:
    """Find the checkpoint (only under MODELS_DIR, or on the hub when HUB_ACCESS allows), record its
    exact revision: a hub ref becomes the commit downloaded, so catalog and manifest keys agree."""
    source = locate_model(job.settings, record.request["model"])
    trim_caches(job.settings, record.revision, None if source.local else source.repo_id)
    resolved = resolve_source(str(source.directory)) if source.local else resolve_hub_source(
        f"{source.repo_id}@{_commit_or_ref(record.revision, source.ref)}")
    if resolved.revision != record.revision:
        job.catalog(lifecycle.record_revision, resolved.revision)
        record.revision = resolved.revision
    record.source = resolved.to_dict()


def _commit_or_ref(revision: str, ref: str) -> str:
    """What to download: the commit the request was pinned to (or resolved to on an earlier
    attempt), else the ref it asked for."""
    return ref if revision.startswith(UNRESOLVED_PREFIX) else revision


def build(job: Job, record: JobRecord) -> None:
    shutil.rmtree(job.export_dir, ignore_errors=True)  # a build that died half way is redone whole
    partial = job.work / f".export.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    manifest = build_export(record.export_request(), record.resolved_source(), partial, job.progress, record.export_id,
                            rope_cache=job.settings.data_dir / "rope", reference_cache=job.settings.data_dir / "references",
                            shared_references=StoreReferences(job.store, job.keeper.check, log.warning))
    partial.rename(job.export_dir)
    record.manifest = manifest.data


def _described(record: JobRecord, ep: str) -> str:
    """The export as crash messages name it: what it computes in, where."""
    quant = (record.manifest or {}).get("quantization") or {}
    activations = quant.get("activations")
    return (f"{record.request['dtype']} {(record.manifest or {}).get('variant', '')} export"
            + (f" ({activations} activations)" if activations else "") + f" on {ep}")


def _isolated(job: Job, target, *args, what: str, crash_advice: str, **kwargs):
    """``target`` in a stage process of its own (exporter.runtime.isolated): the worker stays up
    whatever the kernels do, and keeps the job's lease while the stage process works."""
    return run_isolated(target, *args, what=what, poll=job.keeper.check, owned_until=job.keeper.owned_until,
                        crash_advice=crash_advice, **kwargs)


def validate(job: Job, record: JobRecord) -> None:
    ep = job.settings.validate_ep or record.request["ep"]
    record.manifest, record.parity_report = _isolated(
        job, validate_stage, str(job.export_dir), record.manifest, str(record.resolved_source().path), ep,
        job.settings.quality_thresholds, str(job.settings.data_dir / "references"), job.settings,
        record.export_id, job.lease.attempt, progress=job.progress,
        what=f"validation of the {_described(record, ep)}",
        crash_advice="the export cannot be validated on this onnxruntime: request another variant or activation "
                     "dtype (quant.activations), or validate on another execution provider (VALIDATE_EP)")


def bench(job: Job, record: JobRecord) -> None:
    if record.manifest["status"] != "ready":
        return  # a quarantined export is published with its report, not benchmarked
    job.progress.stage("bench")
    started = time.perf_counter()
    settings = job.settings
    ep = settings.validate_ep or record.request["ep"]
    _isolated(job, bench_stage, str(job.export_dir), ep, settings.bench_contexts, settings.bench_batches,
              settings.bench_steps, settings.bench_repeats, record.export_id, job.lease.attempt,
              what=f"the benchmark of the validated {_described(record, ep)}",
              crash_advice="a serving runtime that drives the export as the benchmark does (IO binding, CUDA graphs) "
                           "may crash the same way; `exportfarm bench DIR --no-cuda-graph` runs it without graph "
                           "capture, and another activation dtype (quant.activations) or variant avoids the kernels "
                           "involved")
    png, md = write_report(job.export_dir / BENCH_FILE)
    manifest = Manifest(record.manifest)
    manifest.add_files(job.export_dir, [BENCH_FILE, png.name, md.name])
    manifest.data["timings_s"]["bench"] = round(time.perf_counter() - started, 3)
    record.benchmark = json.loads((job.export_dir / BENCH_FILE).read_text())


def diff(job: Job, record: JobRecord) -> None:
    if record.predecessor_id is None:
        return
    job.progress.stage("diff")
    with session_scope(job.settings.catalog_url) as session:
        predecessor = session.get(Export, record.predecessor_id)
        session.expunge(predecessor)
    new = ExportArtifacts(manifest=record.manifest, parity_report=record.parity_report, benchmark=record.benchmark)
    found = diff_with_predecessor(job.settings, job.store, predecessor, new, job.export_dir)
    if found is not None:
        result, names = found
        Manifest(record.manifest).add_files(job.export_dir, names)
        record.diff = result.to_dict()


def layout(job: Job, record: JobRecord) -> None:
    """The layout the request asked for besides the farm's: the validated, benchmarked export laid out
    as a Hugging Face repository (exporter/packaging/hf_layout.py) in its own folder, which is what
    publish uploads. Its weights are a hard link (no copy): nothing checks the farm folder again."""
    if record.request.get("layout", "farm") == "farm":
        return
    job.progress.stage("layout")
    Manifest(record.manifest).write(job.export_dir)  # what write_hf_layout reads
    for leftover in job.work.glob(f".{job.laid_out_dir.name}.hf-partial-*"):  # a killed attempt's
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(job.laid_out_dir, ignore_errors=True)  # laid out, but not recorded before a kill
    record.manifest = write_hf_layout(job.export_dir, job.laid_out_dir, record.resolved_source().path, weights="link")


def publish(job: Job, record: JobRecord) -> ExportStatus:
    """Write the manifest (once), record the prefix, upload data first and the manifest last, finish."""
    job.progress.stage("publish")
    status = ExportStatus(record.manifest["status"])
    export_dir = job.publish_dir(record)
    weights = (record.manifest.get("layout") or {}).get("data_file", DATA_FILE)
    Manifest(record.manifest).write(export_dir)
    prefix = export_prefix(record.manifest)
    job.keeper.check()
    earlier = job.catalog(lifecycle.begin_publish, prefix)
    job.publishing = prefix
    if earlier and earlier != prefix:
        unpublish(job.store, earlier, job.keeper.check, job.lease.export_id,  # what an earlier attempt left elsewhere
                  f"superseded by attempt {job.lease.attempt} at {prefix}", final=False, attempt=job.lease.attempt)
    retries = max(1, job.settings.publish_retries)
    for attempt in range(1, retries + 1):
        try:
            publish_export(job.store, export_dir, prefix, status.value, guard=job.keeper.check,
                           attempt=job.lease.attempt, on_uploaded=lambda name: failpoints.pause("upload", job.lease.export_id, job.lease.attempt,
                                                                     job.keeper.check)
                           if name == weights else None)
            break
        except StorageError as err:
            if attempt == retries:
                raise
            delay = min(60.0, 2.0 ** attempt)
            log.warning("%s: publishing failed (%s); retry %d of %d in %.0f s", job.lease, err, attempt, retries - 1, delay)
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:
                job.keeper.check()
                time.sleep(min(1.0, job.settings.heartbeat_s))
    failpoints.pause("published", job.lease.export_id, job.lease.attempt, job.keeper.check_owned)
    job.catalog(lifecycle.finish, status, runtime=record.manifest["versions"]["onnxruntime"],
                message=None if status is ExportStatus.READY else record.manifest["validation"]["summary"],
                **outcome_fields(prefix, record.manifest, record.parity_report, record.benchmark, record.diff))
    return status


STAGES: tuple[tuple[str, Callable[[Job, JobRecord], object]], ...] = (
    ("resolve", resolve), ("build", build), ("validate", validate), ("bench", bench), ("diff", diff),
    ("layout", layout),
)


# --- one job ----------------------------------------------------------------------------------------


def _catalog_read(settings: Settings, read: Callable[..., T], *args) -> T:
    try:
        with session_scope(settings.catalog_url) as session:
            return read(session, *args)
    except SQLAlchemyError as err:
        raise CatalogUnavailable(f"the catalog is unreachable ({type(err).__name__})") from err


def _claim(session, export_id: str, identity: WorkerIdentity, lease_s: float) -> tuple[lifecycle.Claim, JobRecord | None]:
    claim = lifecycle.claim(session, export_id, identity.name, identity.pid, ort_version(), lease_s)
    if claim.lease is None:
        return claim, None
    e = claim.export
    record = JobRecord(e.id, request_of(e).to_dict(), e.revision, e.predecessor_id, current_runtime())
    record.earlier_prefix = e.storage_prefix  # where a lost earlier attempt began publishing, if one did
    return claim, record


def _prune(settings: Settings, root: Path, keep: str) -> None:
    """Drop work directories of this worker's other exports once the catalog says they are over."""
    others = [p for p in root.iterdir() if p.is_dir() and p.name != keep] if root.is_dir() else []
    if not others:
        return
    with session_scope(settings.catalog_url) as session:
        live = set(session.scalars(select(Export.id).where(
            Export.id.in_([p.name for p in others]), Export.status.in_((ExportStatus.QUEUED, ExportStatus.RUNNING)))))
    for path in others:
        if path.name not in live:
            shutil.rmtree(path, ignore_errors=True)


def _end_unpublished(job: Job, status: ExportStatus, message: str) -> str:
    """Finish cancelled or failed, deleting first whatever this attempt uploaded (manifest first).

    If the store cannot be cleaned now, the lease is released instead and the sweeper settles the
    job once the store is back: a cancelled or failed export must never leave a manifest behind.
    Every delete asks the lease first: once it is lost, what is under the prefix may be the next
    attempt's, and this one stops there, writing nothing more.
    """
    if job.publishing:
        try:
            unpublish(job.store, job.publishing, job.keeper.check_owned, job.lease.export_id,
                      f"attempt {job.lease.attempt} ended {status.value}", final=status is ExportStatus.CANCELLED,
                      attempt=job.lease.attempt)
        except Fenced as err:
            log.warning("%s", err)
            return "fenced"
        except StorageError as err:
            with session_scope(job.settings.catalog_url) as session:
                lifecycle.release_lost(session, job.lease.export_id, job.lease.worker, job.lease.pid,
                                       f"could not remove its uploads to end {status.value} ({err})")
            return "released"
    try:
        job.catalog(lifecycle.finish, status, message=message)
    except Fenced as err:
        log.warning("%s", err)
        return "fenced"
    return status.value


def _fits(session, settings: Settings, export_id: str, identity: WorkerIdentity) -> str | None:
    """Before claiming: whether this worker holds the job's estimated needs (a hub model's config.json
    is fetched alone for it). A job it cannot hold goes to a larger worker class (``"rerouted"``);
    one its own class is sized to hold waits for a worker of the class that has room now
    (``"deferred"``: this one is busy with leftovers, or smaller than its class says); one no class
    can hold fails once with the figures (``"refused"``). None: claim it (or let the claim say why not)."""
    export = session.get(Export, export_id)
    if export is None or export.status is not ExportStatus.QUEUED or export.cancel_requested:
        return None
    mine = {q.strip() for q in settings.worker_queues.split(",")}
    if export.queue and export.queue not in mine:
        # A message from before the job was handed to another class: that class's workers run it.
        return f"skipped: it is placed on worker class {export.queue}"
    request = request_of(export)
    try:
        source = locate_model(settings, request.model)
        estimate = placement.job_estimate(settings, request, source,
                                          reference_on_gpu=_reference_on_gpu(settings, request),
                                          fetch_config=settings.hub_access)
    except Exception as err:  # the resolve stage names what is wrong with the model
        log.warning("export %s: not sized before its claim (%s)", export_id, err)
        return None
    if estimate is None:
        return None
    # The job's resolve stage trims the caches before anything is written: that space is the job's.
    trims = cache_trims(settings, *_keep(settings, export.revision, None if source.local else source.repo_id, session))
    have = placement.machine_capacity(settings, "this worker", own_work=_work_root(settings, identity),
                                      trims=trims.values())
    why = placement.worker_refusal(estimate, have, request)
    if why is None:
        return None
    # Never back to a class the job already came from: each hand-over leaves one fewer to try.
    tried = mine | set((export.estimate or {}).get("refused_on", []))
    tried |= {export.queue} if export.queue else set()
    try:
        queue = placement.place(settings, request, estimate, exclude=tuple(sorted(tried)))
    except ExportError:
        queue = None
    if queue is not None:
        if lifecycle.reroute(session, export, queue, identity.name, why, sorted(tried)):
            log.warning("export %s: %s; sent to worker class %s", export_id, why, queue)
            return "rerouted"
        return None
    own = [c for c in placement.queue_classes(settings) if c.name == (export.queue or next(iter(mine)))]
    if own and own[0].sized and not estimate.shortfalls(own[0].capacity):
        if lifecycle.defer(session, export, identity.name, why):
            log.warning("export %s: %s; left for a worker of class %s with room", export_id, why, own[0].name)
        return "deferred"
    why += f"; no other worker class can hold it: {placement.what_to_do(request)}"
    if lifecycle.refuse(session, export, identity.name, why):
        log.warning("export %s: refused: %s", export_id, why)
        return "refused"
    return None


def _reference_on_gpu(settings: Settings, request) -> bool:
    """Whether this worker's streamed reference runs on its GPU (a CUDA build of torch)."""
    if (settings.validate_ep or request.ep.value) != "cuda":
        return False
    import torch

    return torch.cuda.is_available()


def run_export_job(settings: Settings, export_id: str, identity: WorkerIdentity | None = None) -> str:
    """Claim and run one export to its end on this worker; returns what happened, in a word."""
    identity = identity or worker_identity()
    placed = _catalog_read(settings, _fits, settings, export_id, identity)
    if placed is not None:
        return placed
    claim, record = _catalog_read(settings, _claim, export_id, identity, settings.lease_s)
    if claim.lease is None:
        log.info("export %s: nothing to do (%s)", export_id, claim.why)
        return f"skipped: {claim.why}"
    lease = claim.lease
    earlier = record.earlier_prefix  # as the catalog says now, not as a saved checkpoint remembers
    root = _work_root(settings, identity)
    work = root / export_id
    saved = JobRecord.load(work)
    if saved is not None and saved.export_id == export_id and saved.runtime == record.runtime:
        record = saved  # resume after the last finished stage
        record.earlier_prefix = earlier
        log.info("%s: resuming after %s", lease, ", ".join(record.done) or "nothing")
    else:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    record.save(work)  # from its claim on, the job's revision is in use on this host (revisions_in_use)
    try:
        _prune(settings, root, keep=export_id)
    except SQLAlchemyError:
        pass
    # While the job runs, its pod is the last a scale-down stops (Kubernetes' pod deletion cost).
    with LeaseKeeper(settings, lease) as keeper, pod_deletion_cost.running_job(str(lease)):
        # An earlier attempt's uploads are this attempt's to remove if it ends failed or cancelled
        # before publishing its own (publish replaces them with its own prefix).
        job = Job(settings, lease, keeper, make_store(settings), work, publishing=earlier)
        job.progress = CatalogProgress(job)
        outcome = _run(job, record)
    if outcome in ("ready", "quarantined", "failed", "cancelled"):
        shutil.rmtree(work, ignore_errors=True)
    log.info("%s: %s", lease, outcome)
    return outcome


def _run(job: Job, record: JobRecord) -> str:
    from celery.exceptions import SoftTimeLimitExceeded

    stage = "resolve"
    try:
        job.progress.stage("resolve")
        # Long work inside a stage (a hub download, the reference, the gates) checks the lease and
        # a cancel at its own checkpoints, not only between stages.
        with checkpoints.installed(job.keeper.check):
            for stage, run in STAGES:
                if stage in record.done:
                    continue
                run(job, record)
                record.done.append(stage)
                record.save(job.work)
        stage = "publish"
        return publish(job, record).value
    except Fenced as err:
        log.warning("%s", err)
        return "fenced"
    except (JobCancelled, CancelRequested):
        return _end_unpublished(job, ExportStatus.CANCELLED, "cancelled")
    except SoftTimeLimitExceeded:
        return _end_unpublished(job, ExportStatus.FAILED, f"exceeded the time limit of "
                                f"{job.settings.task_soft_time_limit_s} s during {stage}")
    except ProcessLost as err:
        # The stage process was killed from outside (the kernel's OOM killer), as a pool process can be:
        # the attempt is lost, not the export; the sweeper gives it another until MAX_ATTEMPTS.
        log.warning("%s: %s", job.lease, err)
        with session_scope(job.settings.catalog_url) as session:
            lifecycle.release_lost(session, job.lease.export_id, job.lease.worker, job.lease.pid,
                                   f"during {stage}: {err}")
        return "released"
    except StorageError as err:
        # The store stayed down through every retry: this attempt is lost, not the export. Its
        # checkpoints stay, so the next attempt on this worker resumes at publish.
        with session_scope(job.settings.catalog_url) as session:
            lifecycle.release_lost(session, job.lease.export_id, job.lease.worker, job.lease.pid,
                                   f"the object store was unavailable during publish ({err})")
        return "released"
    except ExportError as err:
        return _end_unpublished(job, ExportStatus.FAILED, str(err))
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.exception("%s failed in %s", job.lease, stage)
            return _end_unpublished(job, ExportStatus.FAILED, f"internal error during {stage}: {type(err).__name__}: {err}")
        # This worker's disk, not the export: the attempt is given up as lost (counted against
        # MAX_ATTEMPTS), its scratch freed, and the sweeper queues it again for a worker with room.
        log.warning("%s: the disk filled during %s; releasing the job for another attempt", job.lease, stage)
        shutil.rmtree(job.work, ignore_errors=True)
        with session_scope(job.settings.catalog_url) as session:
            lifecycle.release_lost(session, job.lease.export_id, job.lease.worker, job.lease.pid,
                                   f"the worker's disk filled during {stage} ({err.strerror}): {job.settings.scratch_dir}")
        return "released"
    except Exception as err:  # a bug: fail the export loudly, naming the stage, rather than retry it forever
        log.exception("%s failed in %s", job.lease, stage)
        return _end_unpublished(job, ExportStatus.FAILED, f"internal error during {stage}: {type(err).__name__}: {err}")
