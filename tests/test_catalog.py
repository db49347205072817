"""The catalog on SQLite (embedded default) and PostgreSQL (deployment): same tests, both engines."""

from __future__ import annotations

import datetime

import pytest
from sqlalchemy import select

from exporter.request import ExportRequest
from services.catalog import exports as catalog
from services.catalog.database import session_scope, upgrade_schema
from services.catalog.models import Export, ExportEvent, ExportStatus, RuntimeReport, Worker
from services.catalog.views import latest_ready
from services import lifecycle
from services.catalog.workers import live_workers
from services.jobs import Conflict, list_exports, request_cancel, submit_export
from services.settings import Settings
from tests.services_fixtures import fresh_postgres_database
from workers.registry import report_worker
from workers.runtime_info import RuntimeInfo


@pytest.fixture(params=["sqlite", "postgresql"], scope="module")
def database_url(request, tmp_path_factory):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
    else:
        with fresh_postgres_database() as url:
            yield url


@pytest.fixture(scope="module")
def settings(database_url, tmp_path_factory, checkpoint):
    models = tmp_path_factory.mktemp("models")
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    s = Settings(data_dir=tmp_path_factory.mktemp("data"), database_url=database_url, models_dir=models)
    upgrade_schema(s.catalog_url)
    upgrade_schema(s.catalog_url)  # idempotent
    return s


def _submit(settings, **kw):
    request = ExportRequest(model=kw.pop("model", "tiny-llama"), dtype=kw.pop("dtype", "fp32"), ep="cpu", **kw)
    with session_scope(settings.catalog_url) as session:
        export, created = submit_export(session, settings, request)
        return export.id, created, export.cache_key


def test_identical_requests_share_one_export(settings):
    first, created, key = _submit(settings, dtype="fp16")
    again, created_again, key_again = _submit(settings, dtype="fp16")
    assert created and not created_again and again == first and key == key_again
    other, created_other, other_key = _submit(settings, dtype="fp32", variant="gqa")
    assert created_other and other != first and other_key != key


def test_transitions_leave_an_audit_trail(settings):
    export_id, _, _ = _submit(settings, variant="attn_dynamic", max_seq_len=64)
    with session_scope(settings.catalog_url) as session:
        lease = lifecycle.claim(session, export_id, "w1", 100, "1.31.1").lease
    with session_scope(settings.catalog_url) as session:
        assert lifecycle.record_stage(session, lease, "build", 10) is False  # no cancel requested
        assert lifecycle.record_stage(session, lease, "validate", 60) is False
        lifecycle.finish(session, lease, ExportStatus.READY, message="published", stage="publish")
    with session_scope(settings.catalog_url) as session:
        export = session.get(Export, export_id)
        with pytest.raises(catalog.TransitionError):
            catalog.transition(session, export, ExportStatus.RUNNING)
        events = session.scalars(select(ExportEvent).where(ExportEvent.export_id == export_id).order_by(ExportEvent.id)).all()
        assert [(e.to_status, e.stage) for e in events] == [
            ("queued", None), ("running", "resolve"), ("running", "build"), ("running", "validate"), ("ready", "publish")]
        assert all(e.at is not None for e in events)
        export = session.get(Export, export_id)
        assert export.started_at <= export.finished_at


def test_cancel_queued_and_running(settings):
    queued, _, _ = _submit(settings, variant="attn_static", max_seq_len=56)
    with session_scope(settings.catalog_url) as session:
        export, settle = request_cancel(session, settings, queued)
        assert export.status is ExportStatus.CANCELLED and not settle
    with session_scope(settings.catalog_url) as session, pytest.raises(Conflict):
        request_cancel(session, settings, queued)
    running, _, _ = _submit(settings, variant="attn_static", max_seq_len=48)
    with session_scope(settings.catalog_url) as session:
        lease = lifecycle.claim(session, running, "w2", 200, "1.31.1").lease
    with session_scope(settings.catalog_url) as session:
        export, settle = request_cancel(session, settings, running)
        assert export.status is ExportStatus.RUNNING and not settle  # its live worker stops it
    with session_scope(settings.catalog_url) as session:
        assert lifecycle.renew(session, lease) is True  # so the worker learns of it at its next heartbeat
        assert lifecycle.record_stage(session, lease, "fold", 20) is True


def test_lease_expiry(settings):
    export = Export(heartbeat_at=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=30))
    assert catalog.lease_expired(export, lease_s=10)
    assert not catalog.lease_expired(export, lease_s=60)
    assert catalog.lease_expired(Export(heartbeat_at=None), lease_s=60)  # released: its worker is known dead


def test_list_filters_and_paging(settings):
    for n in (72, 80, 88):
        _submit(settings, variant="attn_static", max_seq_len=n, dtype="fp16")
    with session_scope(settings.catalog_url) as session:
        rows, total = list_exports(session, variant="attn_static", status="queued", limit=2)
        assert len(rows) == 2 and total >= 3
        rest, _ = list_exports(session, variant="attn_static", status="queued", limit=2, offset=2)
        assert not {r.id for r in rows} & {r.id for r in rest}
        assert all(r.variant == "attn_static" for r in rows + rest)


def test_latest_ready_per_variant(settings):
    ids = []
    for dtype in ("fp32", "fp32"):
        export_id, _, _ = _submit(settings, variant="gqa", dtype=dtype, max_seq_len=100 + len(ids))
        ids.append(export_id)
        with session_scope(settings.catalog_url) as session:
            lease = lifecycle.claim(session, export_id, "w1", 1, "1.31.1").lease
            lifecycle.finish(session, lease, ExportStatus.READY, figures={"prefill_max_abs_error": 1e-6 * len(ids)})
    with session_scope(settings.catalog_url) as session:
        view = latest_ready(session, "tiny-llama")["tiny-llama"]
    assert view["gqa-fp32-cpu-ms101"]["id"] == ids[1]
    assert view["gqa-fp32-cpu-ms100"]["figures"]["prefill_max_abs_error"] == pytest.approx(1e-6)


def test_worker_runtime_history(settings):
    old = RuntimeInfo("gpu-node-1", "1.30.0", "13.0", "NVIDIA H200", ("CUDAExecutionProvider",))
    new = RuntimeInfo("gpu-node-1", "1.31.1", "13.0", "NVIDIA H200", ("CUDAExecutionProvider",))
    report_worker(settings, "gpu-node-1", "gpu", old)
    report_worker(settings, "gpu-node-1", "gpu", old)  # unchanged: no new history row
    report_worker(settings, "gpu-node-1", "gpu", new)
    with session_scope(settings.catalog_url) as session:
        history = session.scalars(select(RuntimeReport).where(RuntimeReport.hostname == "gpu-node-1").order_by(RuntimeReport.id)).all()
        assert [h.onnxruntime for h in history] == ["1.30.0", "1.31.1"]
        assert session.get(Worker, "gpu-node-1").onnxruntime == "1.31.1"
        assert "gpu-node-1" in {w.hostname for w in live_workers(settings, session)}


def test_concurrent_identical_requests_create_one_export(settings):
    """Many API threads POSTing the same body at once: one export, the rest get it back (a unique
    constraint on the live key, so SQLite and PostgreSQL alike)."""
    import threading

    request = ExportRequest(model="tiny-llama", dtype="fp16", ep="cpu", variant="attn_static", max_seq_len=96)
    results, barrier = [], threading.Barrier(16)

    def post():
        barrier.wait()
        with session_scope(settings.catalog_url) as session:
            export, created = submit_export(session, settings, request)
            results.append((export.id, created))

    threads = [threading.Thread(target=post) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16  # every request answered (a thread that raised would be missing)
    assert sum(created for _, created in results) == 1
    assert len({export_id for export_id, _ in results}) == 1
