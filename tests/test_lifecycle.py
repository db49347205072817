"""The job lifecycle on both catalogs: claims, fenced writes, the sweeper, cancels, bounded attempts.

Real parts: SQLite and PostgreSQL, the filesystem queue (message files are counted on disk), a
local object store with a real export published into it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from pydantic import ValidationError

from exporter.request import ExportRequest
from services import lifecycle
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.models import Export, ExportEvent, ExportStatus, db_now
from services.jobs import request_cancel, submit_export
from services.lifecycle import CancelRequested, Fenced
from services.publish import export_prefix, files_match_store, publish_export, read_published_manifest
from services.queue import CeleryQueue
from services.settings import Settings
from services.storage_factory import make_store
from services.sweeper import SweepReport, Sweeper
from tests.services_fixtures import fresh_postgres_database
from workers.registry import report_worker
from workers.runtime_info import RuntimeInfo

# How long the sweeper lets a silent attempt run (settings.lease_s). A test whose worker must stay
# live while it writes claims with LIVE_LEASE_S: on a loaded two-core CI machine 0.6 s ran out between
# a claim and the next write (an attempt fenced that the test meant alive).
LEASE_S = 1.5
LIVE_LEASE_S = 60.0
ORT = "1.31.1"


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path, checkpoint):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    common = dict(data_dir=tmp_path / "data", models_dir=models, lease_s=LEASE_S, heartbeat_s=0.2,
                  redispatch_s=0.5, max_attempts=2, signing_secret="lifecycle-signing-secret-0123456789abcdef")
    if request.param == "sqlite":
        s = Settings(**common)
        upgrade_schema(s.catalog_url)
        yield s
    else:
        with fresh_postgres_database() as url:
            s = Settings(database_url=url, **common)
            upgrade_schema(s.catalog_url)
            yield s


@pytest.fixture
def sweeper(settings):
    store = make_store(settings)
    store.ensure_bucket()
    return Sweeper(settings, CeleryQueue(settings), store)


def submit(settings, target_ort=None, **kw) -> str:
    request = ExportRequest(model="tiny-llama", dtype=kw.pop("dtype", "fp32"), ep="cpu", **kw)
    with session_scope(settings.catalog_url) as session:
        export, created = submit_export(session, settings, request, force=True, target_ort=target_ort,
                                        reason="ort-upgrade" if target_ort else "request")
        assert created
        return export.id


def claim(settings, export_id, worker="w1", pid=100, ort=ORT, lease_s=LIVE_LEASE_S):
    """A claim as a worker makes it: its own writes are refused once ``lease_s`` passed without a
    renewal. The sweeper takes the attempt back after settings.lease_s (LEASE_S) of silence."""
    with session_scope(settings.catalog_url) as session:
        return lifecycle.claim(session, export_id, worker, pid, ort, lease_s)


def write(settings, operation, *args, **kwargs):
    with session_scope(settings.catalog_url) as session:
        return operation(session, *args, **kwargs)


def row(settings, export_id) -> Export:
    with session_scope(settings.catalog_url) as session:
        return session.get(Export, export_id)


def messages(settings, queue="cpu") -> list[str]:
    """Message files the filesystem queue holds for ``queue`` (named '<time>_<uuid>.<queue>.msg')."""
    return sorted(p.name for p in (settings.queue_dir / "in").glob(f"*.{queue}.msg"))


def events(settings, export_id) -> list[str]:
    with session_scope(settings.catalog_url) as session:
        return [e.message or "" for e in session.query(ExportEvent).filter_by(export_id=export_id).order_by(ExportEvent.id)]


def test_a_queued_export_is_claimed_once(settings):
    export_id = submit(settings)
    first, second = claim(settings, export_id, "w1"), claim(settings, export_id, "w2")
    assert first.lease is not None and first.lease.attempt == 1
    assert second.lease is None and "running" in second.why  # a duplicate message finds nothing to do
    assert row(settings, export_id).worker == "w1"


def test_after_the_lease_expires_every_write_of_the_old_attempt_is_refused(settings, sweeper):
    export_id = submit(settings)
    old = claim(settings, export_id, "w1").lease
    write(settings, lifecycle.record_stage, old, "validate", 60)
    time.sleep(LEASE_S + 0.1)  # w1 stops renewing (stopped, cut off, dead)
    report = sweeper.sweep()
    assert report.requeued == [export_id] and report.dispatched == [export_id]
    assert len(messages(settings)) == 1  # the sweeper rang for attempt 2
    new = claim(settings, export_id, "w2").lease
    assert new.attempt == 2
    for operation, args in [(lifecycle.renew, ()), (lifecycle.record_stage, ("bench", 85)),
                            (lifecycle.begin_publish, ("some/prefix/",)),
                            (lifecycle.finish, (ExportStatus.CANCELLED,)), (lifecycle.finish, (ExportStatus.READY,))]:
        with pytest.raises(Fenced):
            write(settings, operation, old, *args)
    write(settings, lifecycle.finish, new, ExportStatus.READY, runtime=ORT)
    done = row(settings, export_id)
    assert done.status is ExportStatus.READY and done.attempts == 2 and done.worker == "w2"
    assert any("attempt 1 lost" in m and "during validate" in m for m in events(settings, export_id))


def test_an_expired_lease_is_not_revived_before_the_sweeper_gets_to_it(settings):
    """Once LEASE_S passed without a renewal (the catalog's clock), the sweeper may be settling the
    attempt (withdrawing its uploads, then ending the row): the worker coming back in between must
    neither renew nor finish it, or the row ends ready over a withdrawn store."""
    export_id = submit(settings)
    lease = claim(settings, export_id, "w1", lease_s=LEASE_S).lease
    assert write(settings, lifecycle.renew, lease) is False  # live: renewed
    time.sleep(LEASE_S + 0.1)  # no sweep has run: the row is still this attempt's, running
    for operation, args in [(lifecycle.renew, ()), (lifecycle.record_stage, ("bench", 85)),
                            (lifecycle.begin_publish, ("some/prefix/",)), (lifecycle.finish, (ExportStatus.READY,))]:
        with pytest.raises(Fenced):
            write(settings, operation, lease, *args)
    assert row(settings, export_id).status is ExportStatus.RUNNING  # left for the sweeper


def test_a_job_whose_worker_keeps_dying_fails_after_max_attempts_naming_stage_and_cause(settings, sweeper):
    export_id = submit(settings)
    for attempt in (1, 2):
        lease = claim(settings, export_id, "w1", pid=42).lease
        assert lease.attempt == attempt
        write(settings, lifecycle.record_stage, lease, "validate", 60)
        # What the worker's main process does when the kernel kills its pool process:
        assert write(settings, lifecycle.release_lost, export_id, "w1", 42, "its pool process died (signal 9)")
        report = sweeper.sweep()
        assert (report.requeued if attempt == 1 else report.failed) == [export_id]
    failed = row(settings, export_id)
    assert failed.status is ExportStatus.FAILED and failed.lost_attempts == 2
    assert "gave up after 2 lost attempts" in failed.error
    assert "during validate" in failed.error and "signal 9" in failed.error


def test_release_only_touches_the_named_process(settings):
    export_id = submit(settings)
    claim(settings, export_id, "w1", pid=42)
    assert not write(settings, lifecycle.release_lost, export_id, "w1", 43, "another process of that name")
    assert not write(settings, lifecycle.release_lost, export_id, "w2", 42, "another worker")
    assert row(settings, export_id).heartbeat_at is not None


def test_the_outbox_sends_what_was_never_sent_users_first(settings, sweeper):
    user = submit(settings, dtype="fp16")
    reexport = submit(settings, target_ort=ORT, variant="gqa")
    time.sleep(0.6)  # past the grace the API has to send its own
    sent = SweepReport()
    sweeper.dispatch(sent)
    assert sent.dispatched == [user]  # the re-export waits while a user export of its EP does
    assert len(messages(settings, "cpu")) == 1 and messages(settings, f"cpu.ort-{ORT}") == []
    request_cancel_now(settings, sweeper, user)
    sweeper.dispatch(sent)
    assert sent.dispatched == [user, reexport]
    assert len(messages(settings, f"cpu.ort-{ORT}")) == 1  # only workers on the target runtime consume it
    assert row(settings, reexport).dispatched_at is not None


def request_cancel_now(settings, sweeper, export_id):
    with session_scope(settings.catalog_url) as session:
        _, settle = request_cancel(session, settings, export_id)
    if settle:
        assert sweeper.settle_cancel(export_id)
    assert row(settings, export_id).status is ExportStatus.CANCELLED


def test_a_lost_message_is_sent_again_once_a_worker_of_its_queue_idles(settings, sweeper):
    export_id = submit(settings)
    assert sweeper.ring(export_id, "cpu", first=True, placed_on=row(settings, export_id).queue, attempts=0)
    for name in messages(settings):  # a worker took the message and died before claiming
        (settings.queue_dir / "in" / name).unlink()
    time.sleep(0.6)
    assert sweeper.sweep().redispatched == []  # no live worker: ringing would not help
    report_worker(settings, "busy-node", f"cpu,cpu.ort-{ORT}", RuntimeInfo("busy-node", ORT, None, None, ()))
    busy_with = submit(settings, dtype="fp16")
    claim(settings, busy_with, "busy-node")
    assert sweeper.sweep().redispatched == []  # its one worker is busy: the message may simply wait
    report_worker(settings, "idle-node", f"cpu,cpu.ort-{ORT}", RuntimeInfo("idle-node", ORT, None, None, ()))
    assert sweeper.sweep().redispatched == [export_id]
    assert len(messages(settings)) == 1


class TakenAtOnce:
    """The sweeper's real queue, with a worker that reads each message the moment it is sent."""

    def __init__(self, queue, read):
        self.queue, self.read = queue, read

    def send(self, export_id: str, queue: str) -> None:
        self.queue.send(export_id, queue)
        self.read(export_id, queue)

    def check(self) -> None:
        self.queue.check()


@pytest.mark.parametrize("sent_by", ["ring again", "outbox, an older row without a class"])
def test_a_job_handed_to_another_class_while_the_sweeper_sends_it_is_sent_to_that_class(settings, sent_by):
    """The sweeper reads a queued job on class cpu and sends it there; the cpu worker reads the message
    at once, cannot hold the job and hands it to cpu-large (unsent again) before the sweeper notes its
    send. The note must not land on the handed-over row: it once did (a ring again noted whatever class
    the row named; an older row, without a class, too), and the job waited marked sent to cpu-large,
    whose queue never got a message (nor, autoscaled on its queue, a worker)."""
    from workers.job import WorkerIdentity, run_export_job

    classes = {"cpu": {"ep": "cpu", "memory_gb": 10, "disk_gb": 100},
               "cpu-large": {"ep": "cpu", "memory_gb": 24, "disk_gb": 100}}
    farm = settings.model_copy(update={"queue_classes": classes})
    small = farm.model_copy(update={"worker_memory_gb": 0.2, "worker_queues": "cpu"})  # cannot hold it
    export_id = submit(farm)
    assert row(farm, export_id).queue == "cpu"
    handed = []

    def cpu_worker(sent_id: str, queue: str) -> None:
        if queue == "cpu":
            handed.append(run_export_job(small, sent_id, WorkerIdentity("small", os.getpid())))

    sweeper = Sweeper(farm, TakenAtOnce(CeleryQueue(farm), cpu_worker), make_store(farm))
    if sent_by == "ring again":
        with session_scope(farm.catalog_url) as session:  # sent once; the message was lost since
            session.get(Export, export_id).dispatched_at = db_now(session)
        report_worker(farm, "small", f"cpu,cpu.ort-{ORT}", RuntimeInfo("small", ORT, None, None, ()))
        time.sleep(farm.redispatch_s + 0.1)
    else:
        with session_scope(farm.catalog_url) as session:  # placed before exports recorded a class
            session.get(Export, export_id).queue = None
        time.sleep(0.6)  # past the grace the API has to send its own
    first = sweeper.sweep()
    assert handed == ["rerouted"] and export_id in first.dispatched + first.redispatched
    assert row(farm, export_id).queue == "cpu-large" and messages(farm, "cpu-large") == []
    time.sleep(0.6)
    assert sweeper.sweep().dispatched == [export_id]  # the outbox sends the new class its own message
    assert len(messages(farm, "cpu-large")) == 1
    sent = row(farm, export_id)
    assert (sent.status, sent.queue, sent.attempts) == (ExportStatus.QUEUED, "cpu-large", 0)
    assert sent.dispatched_at is not None


def published_export(settings, exported, export_id, lease):
    """Publish a real export under this attempt's prefix, as a worker does before it finishes."""
    import json
    import shutil

    source = exported("llama", "attn_dynamic")
    export_dir = settings.data_dir / "work" / export_id
    shutil.copytree(source, export_dir)
    manifest = json.loads((export_dir / "manifest.json").read_text())
    manifest["export_id"] = export_id
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    prefix = export_prefix(manifest)
    write(settings, lifecycle.begin_publish, lease, prefix)
    publish_export(make_store(settings), export_dir, prefix, "ready")
    return prefix


def test_a_publish_whose_worker_died_before_recording_it_is_adopted(settings, sweeper, exported):
    export_id = submit(settings)
    lease = claim(settings, export_id, "w1", pid=7).lease
    prefix = published_export(settings, exported, export_id, lease)
    write(settings, lifecycle.release_lost, export_id, "w1", 7, "killed after writing the manifest")
    assert sweeper.sweep().adopted == [export_id]
    done = row(settings, export_id)
    assert done.status is ExportStatus.READY and done.storage_prefix == prefix and done.percent == 100
    assert done.manifest["export_id"] == export_id and done.figures["node_count"] > 0


def only_withdrawn(store, prefix: str) -> bool:
    """Nothing left under ``prefix`` but a withdrawn manifest (the tombstone unpublish leaves)."""
    return store.list_keys(prefix) == [prefix + "manifest.json"] and read_published_manifest(store, prefix) is None


def test_cancel_of_a_job_whose_worker_is_dead_completes_and_unpublishes(settings, sweeper, exported):
    export_id = submit(settings)
    lease = claim(settings, export_id, "w1", pid=7).lease
    prefix = published_export(settings, exported, export_id, lease)
    store = make_store(settings)
    assert store.list_keys(prefix)
    time.sleep(LEASE_S + 0.1)  # its worker is gone
    request_cancel_now(settings, sweeper, export_id)
    assert only_withdrawn(store, prefix)  # a cancelled export has nothing published


def test_cancel_during_publish_refuses_ready(settings, sweeper, exported):
    export_id = submit(settings)
    lease = claim(settings, export_id, "w1").lease
    published_export(settings, exported, export_id, lease)
    with session_scope(settings.catalog_url) as session:
        lifecycle.renew(session, lease)  # the worker's heartbeat: publishing may outlast a short lease
        _, settle = request_cancel(session, settings, export_id)
    assert not settle  # the live worker handles it
    with pytest.raises(CancelRequested):  # so it cannot end ready; it unpublishes and cancels
        write(settings, lifecycle.finish, lease, ExportStatus.READY)
    write(settings, lifecycle.finish, lease, ExportStatus.CANCELLED, message="cancelled")
    assert row(settings, export_id).status is ExportStatus.CANCELLED


def test_a_reexport_is_claimed_only_on_its_target_runtime(settings):
    export_id = submit(settings, target_ort=ORT)
    refused = claim(settings, export_id, "old", ort="1.30.0")
    assert refused.lease is None and "targets onnxruntime 1.31.1" in refused.why
    assert claim(settings, export_id, "new", ort=ORT).lease is not None


def test_settings_refuse_a_redelivery_shorter_than_the_hard_time_limit(tmp_path):
    with pytest.raises(ValidationError, match="VISIBILITY_TIMEOUT_S"):
        Settings(data_dir=tmp_path, visibility_timeout_s=3600, task_time_limit_s=22200)
    with pytest.raises(ValidationError, match="LEASE_S"):
        Settings(data_dir=tmp_path, lease_s=10, heartbeat_s=10)
    assert Settings(data_dir=tmp_path, task_time_limit_s=600, task_soft_time_limit_s=500).broker_visibility_timeout_s == 1200


def test_a_hub_export_is_rekeyed_by_the_commit_its_worker_downloads(settings):
    from exporter import __version__
    from exporter.request import cache_key
    from services.catalog.exports import request_of

    hub = settings.model_copy(update={"hub_access": True})
    request = ExportRequest(model="org/model", dtype="fp32", ep="cpu")
    with session_scope(hub.catalog_url) as session:
        export, _ = submit_export(session, hub, request)
        export_id, asked = export.id, export.request_key
    assert row(hub, export_id).revision == "ref-main"
    lease = claim(hub, export_id).lease
    commit = "0123456789abcdef0123456789abcdef01234567"
    write(hub, lifecycle.record_revision, lease, commit)
    rekeyed = row(hub, export_id)
    # What the manifest will say: cache_key(request, source.revision, exporter, onnxruntime).
    assert rekeyed.revision == commit
    assert rekeyed.cache_key == cache_key(request_of(rekeyed), commit, __version__, rekeyed.ort_version)
    assert rekeyed.request_key == asked
    with session_scope(hub.catalog_url) as session:  # the same request still finds it
        again, created = submit_export(session, hub, request)
        assert not created and again.id == export_id


def test_a_failed_export_stops_answering_identical_requests(settings):
    request = ExportRequest(model="tiny-llama", dtype="fp16", ep="cpu", variant="attn_dynamic")
    with session_scope(settings.catalog_url) as session:
        first, _ = submit_export(session, settings, request)
        first_id = first.id
    lease = claim(settings, first_id).lease
    write(settings, lifecycle.finish, lease, ExportStatus.FAILED, message="boom")
    with session_scope(settings.catalog_url) as session:
        retry, created = submit_export(session, settings, request)
        assert created and retry.id != first_id


@pytest.mark.parametrize("skew_s", [-90, 90, 3600])
def test_leases_are_stamped_and_judged_by_the_catalogs_clock(tmp_path, checkpoint, monkeypatch, skew_s):
    """A worker's host clock 90 s behind or ahead, or an hour ahead, changes nothing: its heartbeats
    carry PostgreSQL's time, and the sweeper (on a host whose clock is right) judges them by it. A
    host-clock lease had every healthy job of a worker 65 s behind requeued, and kept a dead one 1 h
    ahead `running` for an hour."""
    import datetime

    from services.catalog import models

    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "tiny-llama").symlink_to(checkpoint("llama"))
    with fresh_postgres_database() as url:
        settings = Settings(database_url=url, data_dir=tmp_path / "data", models_dir=models_dir, lease_s=LEASE_S,
                            heartbeat_s=0.2, redispatch_s=0.5, max_attempts=2,
                            signing_secret="lifecycle-signing-secret-0123456789abcdef")
        upgrade_schema(settings.catalog_url)
        store = make_store(settings)
        store.ensure_bucket()
        sweeper = Sweeper(settings, CeleryQueue(settings), store)
        export_id = submit(settings)
        real = models.utcnow
        monkeypatch.setattr(models, "utcnow", lambda: real() + datetime.timedelta(seconds=skew_s))  # the worker's host
        lease = claim(settings, export_id).lease
        assert write(settings, lifecycle.renew, lease) is False
        monkeypatch.setattr(models, "utcnow", real)  # the sweeper's host
        beat = row(settings, export_id).heartbeat_at
        assert abs((beat - real()).total_seconds()) < 5, beat  # the catalog's time, not the worker's

        assert sweeper.sweep().requeued == []  # a healthy job stays with its worker
        time.sleep(LEASE_S + 0.3)
        report = sweeper.sweep()  # and a silent one is taken back after LEASE_S of the catalog's time
        assert report.requeued == [export_id] and row(settings, export_id).status is ExportStatus.QUEUED


SKEWED_CLAIM = """
import sys, time
from services import lifecycle
from services.catalog.database import session_scope
url, export_id = sys.argv[1:3]
with session_scope(url) as session:
    claim = lifecycle.claim(session, export_id, "skewed", 7, "1.32.0")
with session_scope(url) as session:
    lifecycle.record_stage(session, claim.lease, "build", 10)
print(time.time())
"""


@pytest.mark.parametrize("skew", ["-90s", "+90s"])
def test_a_worker_whose_wall_clock_is_off_writes_the_catalogs_time(tmp_path, checkpoint, skew):
    """A real process whose clock libfaketime sets 90 s off claims a job: its lease, the export's
    times and its events carry PostgreSQL's time, so the history reads in order (they once carried
    the worker's: 'attempt 1 started' 90 s before 'queued')."""
    import datetime
    import subprocess
    import sys

    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "tiny-llama").symlink_to(checkpoint("llama"))
    with fresh_postgres_database() as url:
        settings = Settings(database_url=url, data_dir=tmp_path / "data", models_dir=models_dir,
                            signing_secret="lifecycle-signing-secret-0123456789abcdef")
        upgrade_schema(settings.catalog_url)
        export_id = submit(settings)
        env = {**os.environ, "LD_PRELOAD": str(library), "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        out = subprocess.run([sys.executable, "-c", SKEWED_CLAIM, settings.catalog_url, export_id], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert abs(float(out.split()[-1]) - time.time() - int(skew[:-1])) < 10  # the worker's clock was off
        export = row(settings, export_id)
        with session_scope(settings.catalog_url) as session:
            events = session.scalars(select(ExportEvent).where(ExportEvent.export_id == export_id)
                                     .order_by(ExportEvent.id)).all()
        now = datetime.datetime.now(datetime.timezone.utc)
        stamps = {"heartbeat": export.heartbeat_at, "started": export.started_at, "updated": export.updated_at,
                  **{f"event {e.to_status} {e.stage}": e.at for e in events}}
        assert len(events) == 3, stamps
        assert all(abs((at - now).total_seconds()) < 30 for at in stamps.values()), stamps
        assert [e.at for e in events] == sorted(e.at for e in events), stamps


def test_a_cancel_that_lands_while_the_sweeper_adopts_wins(settings, sweeper, exported, monkeypatch):
    """The sweeper reads what a lost attempt published, then ends the row ready; a cancel requested in
    between must not end ready with an empty store: the adopt is refused and the cancel unpublishes."""
    from services import sweeper as sweeper_module

    export_id = submit(settings)
    lease = claim(settings, export_id, "w1", pid=7).lease
    prefix = published_export(settings, exported, export_id, lease)
    write(settings, lifecycle.release_lost, export_id, "w1", 7, "killed after writing the manifest")
    read = sweeper_module.read_published_manifest

    def read_then_cancel(store, at):
        manifest = read(store, at)
        with session_scope(settings.catalog_url) as session:  # the user's cancel, between read and write
            request_cancel(session, settings, export_id)
        return manifest

    monkeypatch.setattr(sweeper_module, "read_published_manifest", read_then_cancel)
    assert sweeper.sweep().adopted == []
    assert row(settings, export_id).status is not ExportStatus.READY
    monkeypatch.setattr(sweeper_module, "read_published_manifest", read)
    sweeper.sweep()
    done = row(settings, export_id)
    assert done.status is ExportStatus.CANCELLED
    assert only_withdrawn(make_store(settings), prefix)  # no cancelled export keeps a manifest


def test_a_cancel_racing_a_claim_never_overwrites_the_claimed_row(settings, monkeypatch):
    """The cancel read the row queued; a worker claims it before the cancel writes: the row stays
    the worker's (running, its attempt), with the cancel requested for the worker to act on. On
    SQLite the read takes no row lock, and the cancel once wrote `cancelled` over the claim."""
    from services import jobs

    if settings.database_url:
        pytest.skip("PostgreSQL locks the row the cancel read (SELECT ... FOR UPDATE): the claim waits for it")
    export_id = submit(settings)
    real = jobs.db_now
    claimed = []

    def claim_first(session):
        if not claimed:  # the worker's claim lands between the cancel's read and its write
            claimed.append(claim(settings, export_id, "w1").lease)
        return real(session)

    monkeypatch.setattr(jobs, "db_now", claim_first)
    with session_scope(settings.catalog_url) as session:
        export, settle = request_cancel(session, settings, export_id)
        status = export.status
    [lease] = claimed
    assert lease is not None and status is ExportStatus.RUNNING and not settle  # its live worker settles it
    done = row(settings, export_id)
    assert done.status is ExportStatus.RUNNING and done.attempts == lease.attempt and done.cancel_requested
    assert write(settings, lifecycle.renew, lease) is True  # the worker hears the cancel


def test_a_sweep_with_s3_down_notes_it_and_still_sends_what_waits(settings):
    """The beat's store is the impatient one: an expired lease whose publish must be read from a down
    S3 is noted for the next sweep within seconds (the workers' patient store took ~90 s per lease),
    and a queued export behind it is still sent."""
    from services.beat import Beat

    down = settings.model_copy(update={"s3_endpoint_url": "http://127.0.0.1:9", "s3_access_key": "k",
                                       "s3_secret_key": "s"})
    lost = submit(settings)
    lease = claim(settings, lost).lease
    write(settings, lifecycle.begin_publish, lease, "exports/some/prefix/")
    waiting = submit(settings, dtype="fp16")
    time.sleep(LEASE_S + 0.1)
    beat = Beat(down, CeleryQueue(down))
    started = time.monotonic()
    report = beat.sweeper.sweep()
    assert time.monotonic() - started < 15
    assert any(lost in p and "object store unavailable" in p for p in report.problems), report.problems
    assert waiting in report.dispatched


def test_a_serve_starting_on_a_shared_catalog_leaves_another_serves_job_alone(tmp_path, checkpoint):
    """Two serves with their own DATA_DIR and one DATABASE_URL (no Redis): each settles only its own
    embedded worker's jobs when it starts."""
    from services.embedded import EmbeddedFarm

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    with fresh_postgres_database() as url:
        common = dict(database_url=url, models_dir=models, lease_s=60, heartbeat_s=5,
                      signing_secret="lifecycle-signing-secret-0123456789abcdef")
        first = Settings(data_dir=tmp_path / "a", **common)
        upgrade_schema(first.catalog_url)
        farm_a = EmbeddedFarm(first, worker=False)
        export_id = submit(first)
        lease = claim(first, export_id, farm_a.worker_name, pid=os.getpid()).lease  # a's worker at work
        farm_b = EmbeddedFarm(Settings(data_dir=tmp_path / "b", **common), worker=False)
        assert farm_b.worker_name != farm_a.worker_name
        farm_b.start()
        try:
            held = row(first, export_id)
            assert held.status is ExportStatus.RUNNING and held.attempts == lease.attempt, held.lost_reason
            assert write(first, lifecycle.renew, lease) is False  # still a's
        finally:
            farm_b.stop()


def test_a_full_disk_releases_the_job_for_another_attempt_instead_of_failing_it(settings, sweeper, monkeypatch):
    """No space left on this worker's disk is the worker's trouble, not the export's: the attempt is
    released as lost (its scratch freed) and the sweeper queues it again, instead of "internal error"."""
    import errno

    from workers import job as worker_job
    from workers.job import WorkerIdentity, run_export_job

    def full(job, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(worker_job, "STAGES", (("resolve", full),))
    export_id = submit(settings)
    assert run_export_job(settings, export_id, WorkerIdentity("w1", os.getpid())) == "released"
    held = row(settings, export_id)
    assert held.status is ExportStatus.RUNNING and held.heartbeat_at is None and "disk filled" in held.lost_reason
    assert sweeper.sweep().requeued == [export_id]
    assert row(settings, export_id).status is ExportStatus.QUEUED and row(settings, export_id).error is None


def test_a_later_attempt_that_fails_removes_what_an_earlier_one_uploaded(settings, sweeper, monkeypatch):
    """Attempt 1 began publishing and was lost; attempt 2 fails before publishing its own: the failed
    export keeps nothing in the store (attempt 1's objects stayed there before)."""
    from exporter.errors import ExportError
    from workers import job as worker_job
    from workers.job import WorkerIdentity, run_export_job

    export_id = submit(settings)
    lease = claim(settings, export_id, "w1", pid=7).lease
    prefix = "exports/tiny/attempt-one/"
    write(settings, lifecycle.begin_publish, lease, prefix)
    store = make_store(settings)
    store.put_bytes(prefix + "model.onnx.data", b"half an upload")
    write(settings, lifecycle.release_lost, export_id, "w1", 7, "killed while uploading")
    assert sweeper.sweep().requeued == [export_id]

    def broken(job, record):
        raise ExportError("the checkpoint is gone")

    monkeypatch.setattr(worker_job, "STAGES", (("resolve", broken),))
    assert run_export_job(settings, export_id, WorkerIdentity("w2", os.getpid())) == "failed"
    assert row(settings, export_id).status is ExportStatus.FAILED
    assert only_withdrawn(store, prefix)


def test_a_failed_attempt_that_stalls_in_its_cleanup_deletes_nothing_the_next_attempt_published(
        settings, sweeper, exported, tmp_path):
    """Attempt 1 fails and withdraws what it published; the process then stops (its lease thread with
    it) before deleting the files. The sweeper queues the job again, attempt 2 publishes over the
    withdrawal and ends ready. Attempt 1 resumes: the lease it asks before each delete is gone, so it
    deletes nothing and ends fenced. It once deleted the takeover's files (the catalog said ready)."""
    from workers.job import Job, LeaseKeeper, _end_unpublished

    export_id = submit(settings)
    first = claim(settings, export_id, "w1", pid=7, lease_s=LEASE_S).lease
    prefix = published_export(settings, exported, export_id, first)
    store = make_store(settings)
    export_dir = settings.data_dir / "work" / export_id

    def meanwhile() -> None:
        time.sleep(LEASE_S + 0.1)  # attempt 1 is stopped: nobody renews its lease
        assert sweeper.sweep().requeued == [export_id]
        second = claim(settings, export_id, "w2").lease
        write(settings, lifecycle.begin_publish, second, prefix)
        publish_export(store, export_dir, prefix, "ready", attempt=second.attempt)
        write(settings, lifecycle.finish, second, ExportStatus.READY, runtime=ORT)

    class StopsAfterWithdrawing:
        def __getattr__(self, name):
            return getattr(store, name)

        def put_bytes(self, key, data, *args, **kwargs):
            info = store.put_bytes(key, data, *args, **kwargs)
            if b'"withdrawn"' in data:
                meanwhile()
            return info

    # The keeper is not entered: its renewal thread is as stopped as the rest of the process.
    job = Job(settings, first, LeaseKeeper(settings, first), StopsAfterWithdrawing(), tmp_path / "w1",
              publishing=prefix)
    assert _end_unpublished(job, ExportStatus.FAILED, "attempt 1 failed") == "fenced"
    done = row(settings, export_id)
    assert done.status is ExportStatus.READY and done.attempts == 2
    manifest = read_published_manifest(store, prefix)
    assert manifest["published"]["attempt"] == 2 and files_match_store(store, prefix, manifest)
