"""Celery tasks: small, idempotent, passing ids only. The job logic is in workers/job.py."""

from __future__ import annotations

import logging
import threading

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, signals
from celery.worker.request import Request

from services.queue import RUN_EXPORT
from workers import pod_deletion_cost

log = logging.getLogger(__name__)


class LostJobRequest(Request):
    """In the worker's main process: when the pool process running a job dies (killed by the
    kernel for memory, or by the hard time limit), release the job's lease at once with the cause,
    instead of leaving the sweeper to wait LEASE_S for a heartbeat that will never come."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded)) and self.args:
            if isinstance(exc, TimeLimitExceeded):
                cause = f"its pool process was killed by the hard time limit ({exc} s)"
            else:
                cause = f"its pool process died ({exc}; killed for memory?)"
            _release(self.task.app.conf.exportfarm_settings, self.args[0], cause)
            # Its pool process could not mark the pod idle again: the job is over on this worker.
            pod_deletion_cost.mark(pod_deletion_cost.IDLE, f"export {self.args[0]} lost ({cause})")
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _release(settings, export_id: str, cause: str) -> None:
    from services import lifecycle
    from services.catalog.database import session_scope
    from workers.job import worker_identity

    identity = worker_identity()
    try:
        with session_scope(settings.catalog_url) as session:
            if lifecycle.release_lost(session, export_id, identity.name, identity.pid, cause):
                log.warning("export %s: %s; released its lease", export_id, cause)
    except Exception:  # the lease then expires on its own
        log.warning("could not release the lease of export %s", export_id, exc_info=True)


def register(app: Celery) -> None:
    settings = app.conf.exportfarm_settings

    @app.task(bind=True, name=RUN_EXPORT, Request=LostJobRequest, max_retries=20)
    def run_export(self, export_id: str) -> str:
        from workers.job import CatalogUnavailable, run_export_job

        try:
            return run_export_job(settings, export_id)
        except CatalogUnavailable as err:
            # Not claimed: the row is still queued. Ask again soon; if every retry fails, the
            # sweeper sends the job again once the catalog is back.
            log.warning("export %s: %s; retrying", export_id, err)
            raise self.retry(exc=err, countdown=min(60, 2 ** self.request.retries)) from None


@signals.worker_process_init.connect
def _fresh_connections(**_kwargs) -> None:
    """Each pool child opens its own database connections instead of sharing the parent's."""
    from exporter.runtime import isolated
    from services.catalog.database import forget_inherited_connections

    forget_inherited_connections()
    # The validate and bench stages run in stage processes forked from one server per pool process:
    # torch and transformers imported there once, not in every stage process.
    isolated.preload(["torch", "transformers"])


@signals.worker_ready.connect
def _idle_pod(**_kwargs) -> None:
    """A worker that (re)starts runs no job, whatever its pod's deletion cost says: a container the
    kubelet restarted mid-job keeps its pod's annotations."""
    pod_deletion_cost.mark(pod_deletion_cost.IDLE, "worker started")


@signals.worker_ready.connect
def _report_runtime(sender=None, **_kwargs) -> None:
    """Record this worker's runtime now and then every WORKER_REPORT_S (the scheduler and the
    sweeper read it: which runtimes exist, which queues have an idle worker)."""
    from workers.job import worker_identity
    from workers.registry import report_worker

    settings = sender.app.conf.exportfarm_settings
    queues = ",".join(sorted(q.name for q in sender.task_consumer.queues)) if sender.task_consumer else "cpu"
    name = worker_identity().name

    def loop() -> None:
        stop = threading.Event()
        while True:
            try:
                report_worker(settings, name, queues)
            except Exception:
                log.warning("could not report worker runtime", exc_info=True)
            if stop.wait(settings.worker_report_s):
                return

    threading.Thread(target=loop, daemon=True, name="runtime-report").start()
