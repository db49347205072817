"""Celery tasks: small, idempotent, passing ids only. The job logic is in workers/job.py."""

from __future__ import annotations

import logging
import socket
import threading

from celery import Celery, signals

from workers.config import CHECK_UPGRADES, RUN_EXPORT

log = logging.getLogger(__name__)


def worker_name() -> str:
    import os

    return os.environ.get("EXPORTFARM_WORKER_NAME") or socket.gethostname()


def register(app: Celery) -> None:
    settings = app.conf.exportfarm_settings

    @app.task(bind=True, name=RUN_EXPORT, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def run_export(self, export_id: str) -> str | None:
        from services.storage import StorageError
        from workers.job import LeaseHeld, fail_export, run_export_job

        try:
            status = run_export_job(settings, export_id, worker_name())
        except LeaseHeld:
            # Another live worker holds it; come back when its lease could have expired.
            raise self.retry(countdown=settings.lease_s) from None
        except StorageError as err:
            if self.request.retries >= settings.publish_retries:
                fail_export(settings, export_id, worker_name(), f"publishing failed: {err}")
                return "failed"
            raise self.retry(exc=err, countdown=min(60, 2 ** self.request.retries)) from None
        return status.value if status else None

    @app.task(name=CHECK_UPGRADES)
    def check_runtime_upgrades() -> dict:
        """The beat's periodic check: queue re-exports of exports built on an older ORT."""
        from services.catalog.database import session_scope
        from services.scheduler import plan_and_queue_reexports, send_queued

        with session_scope(settings.catalog_url) as session:
            plan = plan_and_queue_reexports(session, settings)
        send_queued(app, plan)
        log.info("runtime check: %d queued, %d skipped, %d deferred", len(plan.queued), len(plan.skipped), len(plan.deferred))
        return plan.to_dict()


@signals.worker_process_init.connect
def _fresh_connections(**_kwargs) -> None:
    """Each pool child opens its own database connections instead of sharing the parent's."""
    from services.catalog.database import forget_inherited_connections

    forget_inherited_connections()


@signals.worker_ready.connect
def _report_runtime(sender=None, **_kwargs) -> None:
    """Record this worker's runtime now and then every minute (the scheduler reads it)."""
    from workers.registry import report_worker

    app = sender.app
    settings = app.conf.exportfarm_settings
    queues = ",".join(sorted(q.name for q in sender.task_consumer.queues)) if sender.task_consumer else "cpu"

    def loop() -> None:
        stop = threading.Event()
        while True:
            try:
                report_worker(settings, worker_name(), queues)
            except Exception:
                log.warning("could not report worker runtime", exc_info=True)
            if stop.wait(settings.worker_report_s):
                return

    threading.Thread(target=loop, daemon=True, name="runtime-report").start()
