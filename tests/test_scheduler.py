"""The runtime-upgrade check: which exports are stale, policy, the in-flight cap, at most one per target."""

from __future__ import annotations

import random
import threading

import pytest
from sqlalchemy import func, select

from exporter.request import ExportRequest
from services import lifecycle
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.models import Export, ExportStatus
from services.jobs import submit_export
from services.scheduler import newest_runtimes, plan_and_queue_reexports
from services.settings import Settings
from tests.services_fixtures import fresh_postgres_database
from workers.registry import report_worker
from workers.runtime_info import RuntimeInfo


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path, checkpoint):
    models = tmp_path / "models"
    models.mkdir()
    for arch in ("llama", "qwen2", "qwen3", "mistral", "phi3"):
        (models / f"tiny-{arch}").symlink_to(checkpoint(arch))
    if request.param == "sqlite":
        s = Settings(data_dir=tmp_path / "data", models_dir=models)
        upgrade_schema(s.catalog_url)
        yield s
    else:
        with fresh_postgres_database() as url:
            s = Settings(data_dir=tmp_path / "data", database_url=url, models_dir=models)
            upgrade_schema(s.catalog_url)
            yield s


def finish(settings, export_id, status, ort, worker="w", message=None):
    """What a worker on onnxruntime ``ort`` does: claim the export, then end it with ``status``."""
    with session_scope(settings.catalog_url) as session:
        claim = lifecycle.claim(session, export_id, worker, 1, ort)
    if claim.lease is None:
        return claim.why
    with session_scope(settings.catalog_url) as session:
        lifecycle.finish(session, claim.lease, status, runtime=ort, message=message)
    return None


def ready_export(settings, model, ort="1.30.0", **kw) -> str:
    with session_scope(settings.catalog_url) as session:
        export, _ = submit_export(session, settings, ExportRequest(model=model, dtype="fp32", ep="cpu", **kw))
        export_id = export.id
    assert finish(settings, export_id, ExportStatus.READY, ort) is None
    return export_id


def worker(settings, name, ort, queues="cpu"):
    report_worker(settings, name, f"{queues},{queues}.ort-{ort}", RuntimeInfo(name, ort, None, None, ("CPUExecutionProvider",)))


def plan(settings, **kw):
    with session_scope(settings.catalog_url) as session:
        return plan_and_queue_reexports(session, settings, **kw)


def reexports(settings) -> list[Export]:
    with session_scope(settings.catalog_url) as session:
        return session.scalars(select(Export).where(Export.reason == "ort-upgrade")).all()


def test_upgrade_queues_one_reexport_per_stale_export_once(settings):
    worker(settings, "old-node", "1.30.0")
    first, second = ready_export(settings, "tiny-llama"), ready_export(settings, "tiny-qwen2")
    assert plan(settings).queued == []  # nothing newer than what they were built with
    worker(settings, "new-node", "1.31.1")
    with session_scope(settings.catalog_url) as session:
        assert newest_runtimes(session, settings) == {"cpu": "1.31.1"}  # runtime queues are not queues of their own
    result = plan(settings)
    assert sorted(q["predecessor_id"] for q in result.queued) == sorted([first, second])
    assert {(n.predecessor_id, n.ort_version, n.target_ort, n.status) for n in reexports(settings)} == {
        (first, "1.31.1", "1.31.1", ExportStatus.QUEUED), (second, "1.31.1", "1.31.1", ExportStatus.QUEUED)}
    again = plan(settings)
    assert again.queued == [] and len(again.skipped) == 2 and all("already" in s["why"] for s in again.skipped)


def test_policy_and_in_flight_cap(settings):
    settings = settings.model_copy(update={"reexport_max_in_flight": 1})
    worker(settings, "new-node", "1.31.1")
    ids = [ready_export(settings, m) for m in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")]
    dry = plan(settings, policy="dry-run")
    assert dry.queued == [] and {s["why"] for s in dry.skipped} == {"dry run"}
    listed = plan(settings, policy="listed", models=["tiny-qwen3"])
    assert [q["model"] for q in listed.queued] == ["tiny-qwen3"]
    full = plan(settings)
    assert full.queued == [] and len(full.deferred) == 2 and full.in_flight == 1  # the cap counts what runs
    assert finish(settings, listed.queued[0]["export_id"], ExportStatus.READY, "1.31.1") is None
    nxt = plan(settings)
    assert len(nxt.queued) == 1 and len(nxt.deferred) == 1
    assert finish(settings, nxt.queued[0]["export_id"], ExportStatus.FAILED, "1.31.1") is None
    last = plan(settings)
    assert len(last.queued) == 1 and last.deferred == []
    assert {q["predecessor_id"] for q in listed.queued + nxt.queued + last.queued} == set(ids)


def test_only_the_newest_export_of_a_slot_is_reexported(settings):
    worker(settings, "new-node", "1.31.1")
    ready_export(settings, "tiny-llama", ort="1.29.0")
    newest = ready_export(settings, "tiny-llama", ort="1.30.0", variant="attn_dynamic")
    result = plan(settings)
    assert [q["predecessor_id"] for q in result.queued] == [newest]


def test_the_hf_layout_and_compat_builds_are_slots_of_their_own_and_their_reexports_stay_so(settings):
    worker(settings, "new-node", "1.31.1")
    farm = ready_export(settings, "tiny-llama", variant="attn_dynamic")
    hf = ready_export(settings, "tiny-llama", variant="attn_dynamic", layout="hf")
    compat = ready_export(settings, "tiny-llama", variant="attn_dynamic", compat=True)
    result = plan(settings)
    assert sorted(q["predecessor_id"] for q in result.queued) == sorted([farm, hf, compat])
    kinds = {(n.predecessor_id, n.layout, n.compat) for n in reexports(settings)}
    assert kinds == {(farm, "farm", False), (hf, "hf", False), (compat, "farm", True)}


def test_unknown_policy_is_refused(settings):
    with pytest.raises(ValueError, match="dry-run"):
        plan(settings, policy="everything")


def test_twenty_runs_whatever_the_successors_do(settings):
    """Successors quarantine, fail, or are offered to a worker still on the old runtime: over 20
    runs each stale export gets exactly one re-export to the new runtime, and the in-flight cap holds."""
    cap = 2
    settings = settings.model_copy(update={"reexport_max_in_flight": cap})
    rng = random.Random(11)
    worker(settings, "old-node", "1.30.0")
    stale = [ready_export(settings, m, variant=v) for m in ("tiny-llama", "tiny-qwen2", "tiny-mistral")
             for v in ("attn_dynamic", "gqa")]
    worker(settings, "new-node", "1.31.1")
    refused_by_old = 0
    for _ in range(20):
        plan(settings)
        in_flight = [e for e in reexports(settings) if e.status in (ExportStatus.QUEUED, ExportStatus.RUNNING)]
        assert len(in_flight) <= cap
        for export in in_flight:
            # The old node takes the message first: it must not run a re-export meant to replace its runtime.
            why = finish(settings, export.id, ExportStatus.READY, "1.30.0", worker="old-node")
            assert why and "targets onnxruntime 1.31.1" in why
            refused_by_old += 1
            outcome = rng.choice(["quarantined", "failed", "ready", "still queued"])
            if outcome != "still queued":
                status = ExportStatus(outcome)
                assert finish(settings, export.id, status, "1.31.1", worker="new-node") is None
    done = reexports(settings)
    assert sorted(e.predecessor_id for e in done) == sorted(stale)  # exactly one each
    assert all(e.target_ort == "1.31.1" and e.ort_version == "1.31.1" for e in done)
    assert refused_by_old > 0
    assert plan(settings).queued == []


def test_concurrent_checks_add_one_successor(settings):
    if not settings.catalog_url.startswith("postgresql"):
        pytest.skip("SQLite serializes writers; the unique constraint is what holds on PostgreSQL")
    worker(settings, "new-node", "1.31.1")
    predecessor = ready_export(settings, "tiny-phi3", ort="1.30.0")
    barrier, errors = threading.Barrier(4), []

    def check():
        barrier.wait()
        try:
            plan(settings)
        except Exception as err:  # a lost race must be a skip, not an error
            errors.append(err)

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with session_scope(settings.catalog_url) as session:
        assert session.scalar(select(func.count()).select_from(Export).where(Export.predecessor_id == predecessor)) == 1


def test_migrations_match_the_models(tmp_path):
    from alembic import command
    from alembic.config import Config

    from services.catalog.database import MIGRATIONS

    url = f"sqlite:///{tmp_path / 'check.db'}"
    upgrade_schema(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url)
    command.check(config)  # raises if a model change has no migration


def test_a_reexport_is_built_from_its_predecessors_weights(settings, tmp_path):
    """A hub export's successor downloads the predecessor's commit, not wherever its branch is now;
    a local checkpoint whose weights changed since is skipped with the reason, not re-exported on
    other weights (an upgrade diff would blame onnxruntime for them)."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    hub = settings.model_copy(update={"hub_access": True})
    with session_scope(settings.catalog_url) as session:
        pinned, _ = submit_export(session, hub, ExportRequest(model="org/model", dtype="fp32", ep="cpu"),
                                  revision=commit, reason="ort-upgrade")
        assert pinned.revision == commit
        moving, _ = submit_export(session, hub, ExportRequest(model="org/model", dtype="fp16", ep="cpu"))
        assert moving.revision == "ref-main"  # a user's request follows the branch
    local = settings.models_dir / "tiny-copy"
    shutil.copytree(settings.models_dir / "tiny-llama", local)
    worker(settings, "old-node", "1.30.0")
    before = ready_export(settings, "tiny-copy")
    [shard] = local.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one weight's last byte: other weights
    shard.write_bytes(bytes(data))
    worker(settings, "new-node", "1.31.1")
    result = plan(settings)
    [skipped] = [s for s in result.skipped if s["predecessor_id"] == before]
    assert "changed since it was exported" in skipped["why"]
    assert before not in [q["predecessor_id"] for q in result.queued]


def test_a_reexport_waiting_behind_users_on_live_workers_is_not_expired(settings):
    """REEXPORT_TIMEOUT_S fails a re-export no worker of its runtime can take, not one held back by
    users' exports while such workers are alive."""
    import time

    from services.queue import CeleryQueue
    from services.storage_factory import make_store
    from services.sweeper import SweepReport, Sweeper

    worker(settings, "old-node", "1.30.0")
    predecessor = ready_export(settings, "tiny-llama")
    worker(settings, "new-node", "1.31.1")
    [queued] = plan(settings).queued
    fast = settings.model_copy(update={"reexport_timeout_s": 0.2, "signing_secret": "s" * 40})
    sweeper = Sweeper(fast, CeleryQueue(fast), make_store(fast))
    time.sleep(0.3)
    report = SweepReport()
    sweeper.expire_reexports(report)
    assert report.failed == []  # new-node (1.31.1) is alive: the re-export waits for it
    with session_scope(settings.catalog_url) as session:
        from services.catalog.models import Worker

        session.get(Worker, "new-node").last_seen = session.get(Worker, "new-node").last_seen.replace(year=2000)
    sweeper.expire_reexports(report)
    assert report.failed == [queued["export_id"]] and predecessor
