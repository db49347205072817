"""Workers report what they run on; the catalog keeps the latest state and the history."""

from __future__ import annotations

from exporter import __version__
from services.catalog.database import session_scope
from services.catalog.models import RuntimeReport, Worker, db_now
from services.settings import Settings
from services.placement import machine_capacity
from workers.runtime_info import RuntimeInfo, runtime_info


def report_worker(settings: Settings, hostname: str, queues: str, info: RuntimeInfo | None = None) -> None:
    """Upsert the worker row; add a history row when its runtime changed (or is new)."""
    info = info or runtime_info(hostname)
    with session_scope(settings.catalog_url) as session:
        worker = session.get(Worker, hostname)
        changed = worker is None or (worker.onnxruntime, worker.cuda, worker.gpu, worker.queues) != (
            info.onnxruntime, info.cuda, info.gpu, queues)
        if worker is None:
            worker = Worker(hostname=hostname, started_at=db_now(session))
            session.add(worker)
        worker.queues, worker.onnxruntime, worker.cuda, worker.gpu = queues, info.onnxruntime, info.cuda, info.gpu
        worker.gpu_device = settings.gpu_device
        worker.capacity = machine_capacity(settings, hostname).to_dict()
        worker.exporter_version, worker.last_seen = __version__, db_now(session)
        if changed:
            session.add(RuntimeReport(hostname=hostname, queues=queues, onnxruntime=info.onnxruntime,
                                      cuda=info.cuda, gpu=info.gpu))
