"""The runtime-upgrade check: which exports are stale, policy, rate cap, idempotence."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from exporter.request import ExportRequest
from services.catalog import exports as catalog
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.models import Export, ExportStatus
from services.jobs import record_runtime, submit_export
from services.scheduler import newest_runtimes, plan_and_queue_reexports
from services.settings import Settings
from tests.services_fixtures import fresh_postgres_database
from workers.registry import report_worker
from workers.runtime_info import RuntimeInfo


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path, checkpoint):
    models = tmp_path / "models"
    models.mkdir()
    for arch in ("llama", "qwen2", "qwen3"):
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


def ready_export(settings, model, ort="1.30.0", **kw) -> str:
    with session_scope(settings.catalog_url) as session:
        export, _ = submit_export(session, settings, ExportRequest(model=model, dtype="fp32", ep="cpu", **kw))
        catalog.transition(session, export, ExportStatus.RUNNING)
        catalog.transition(session, export, ExportStatus.READY)
        record_runtime(export, ort)  # what the worker does when it finishes
        return export.id


def worker(settings, name, ort, queues="cpu"):
    report_worker(settings, name, queues, RuntimeInfo(name, ort, None, None, ("CPUExecutionProvider",)))


def plan(settings, **kw):
    with session_scope(settings.catalog_url) as session:
        return plan_and_queue_reexports(session, settings, **kw)


def test_upgrade_queues_one_reexport_per_stale_export_once(settings):
    worker(settings, "old-node", "1.30.0")
    first, second = ready_export(settings, "tiny-llama"), ready_export(settings, "tiny-qwen2")
    assert plan(settings).queued == []  # nothing newer than what they were built with
    worker(settings, "new-node", "1.31.1")
    with session_scope(settings.catalog_url) as session:
        assert newest_runtimes(session, settings) == {"cpu": "1.31.1"}
    result = plan(settings)
    assert sorted(q["predecessor_id"] for q in result.queued) == sorted([first, second])
    with session_scope(settings.catalog_url) as session:
        news = session.scalars(select(Export).where(Export.reason == "ort-upgrade")).all()
        assert {(n.predecessor_id, n.ort_version, n.status) for n in news} == {
            (first, "1.31.1", ExportStatus.QUEUED), (second, "1.31.1", ExportStatus.QUEUED)}
    again = plan(settings)
    assert again.queued == [] and len(again.skipped) == 2  # idempotent: successors exist


def test_policy_and_rate_cap(settings):
    worker(settings, "new-node", "1.31.1")
    ids = [ready_export(settings, m) for m in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")]
    dry = plan(settings, policy="dry-run")
    assert dry.queued == [] and {s["why"] for s in dry.skipped} == {"dry run"}
    listed = plan(settings, policy="listed", models=["tiny-qwen3"])
    assert [q["model"] for q in listed.queued] == ["tiny-qwen3"]
    capped = plan(settings, limit=1)
    assert len(capped.queued) == 1 and len(capped.deferred) == 1
    rest = plan(settings, limit=5)
    assert len(rest.queued) == 1  # the deferred one, next run
    assert {q["predecessor_id"] for q in listed.queued + capped.queued + rest.queued} == set(ids)


def test_only_the_newest_export_of_a_slot_is_reexported(settings):
    worker(settings, "new-node", "1.31.1")
    ready_export(settings, "tiny-llama", ort="1.29.0")
    newest = ready_export(settings, "tiny-llama", ort="1.30.0", variant="attn_dynamic")
    result = plan(settings)
    assert [q["predecessor_id"] for q in result.queued] == [newest]


def test_unknown_policy_is_refused(settings):
    with pytest.raises(ValueError, match="dry-run"):
        plan(settings, policy="everything")


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
