"""Celery configuration in one place: routing, acknowledgement, retries and time limits."""

from __future__ import annotations

from services.queue import RUN_EXPORT, broker_options
from services.settings import Settings


def celery_config(settings: Settings) -> dict:
    return {
        **broker_options(settings),
        "task_ignore_result": True,  # state lives in the catalog, not in a result backend
        # A job's message is acknowledged when the task returns, whatever happened: the catalog row,
        # not the broker, says whether the job is done. A worker that dies mid-job leaves its lease
        # to expire (or its main process releases it at once), and the sweeper queues it again.
        "task_acks_late": True,
        "task_acks_on_failure_or_timeout": True,
        "task_reject_on_worker_lost": False,
        "worker_prefetch_multiplier": 1,  # one job at a time per worker (one GPU)
        "worker_concurrency": 1,
        "task_soft_time_limit": settings.task_soft_time_limit_s,
        "task_time_limit": settings.task_time_limit_s,
        "task_default_queue": "cpu",
        "task_routes": {RUN_EXPORT: {"queue": "cpu"}},  # overridden per export at send time
        "broker_connection_retry_on_startup": True,
        # A lost broker connection must not kill running exports: their leases are in the catalog.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
    }
