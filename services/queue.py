"""The job queue as the API and the sweeper see it: a doorbell that names an export id.

The catalog row is the truth about a job; a message only tells a worker to look at it, so a lost
or duplicated message never matters (services.sweeper rings again, a duplicate finds nothing to
claim). This module owns the names both sides agree on (task, queues) and the broker settings;
workers/ builds its Celery worker from the same ``broker_options``, and services/ never imports
workers/.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.settings import Settings

log = logging.getLogger(__name__)

RUN_EXPORT = "exportfarm.run_export"
QUEUE_FOR_EP = {"cuda": "gpu", "cpu": "cpu"}
RUNTIME_QUEUE_SEPARATOR = ".ort-"


class BrokerUnavailable(Exception):
    """The broker did not take the message; the job stays committed and the sweeper sends it later."""


def runtime_queue(queue: str, ort_version: str) -> str:
    """The queue only workers running exactly ``ort_version`` consume (re-exports target one runtime)."""
    return f"{queue}{RUNTIME_QUEUE_SEPARATOR}{ort_version}"


def queue_for(ep: str, target_ort: str | None = None, queue: str | None = None) -> str:
    """Where an export's message goes: the worker class it was placed on (services.placement; an
    older row: its EP's queue), or that queue's runtime queue for a re-export."""
    queue = queue or QUEUE_FOR_EP[ep]
    return runtime_queue(queue, target_ort) if target_ort else queue


def worker_queues(queues: str, ort_version: str, known: list[str] | None = None) -> list[str]:
    """What a worker serving ``queues`` (e.g. "cpu,gpu") consumes: each queue and its runtime queue.
    ``known``: the worker classes there are (services.placement.queue_names)."""
    known = known or list(QUEUE_FOR_EP.values())
    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise ValueError(f"worker queues must be among {sorted(known)} (QUEUE_CLASSES), got {queues!r}")
    return [*names, *(runtime_queue(q, ort_version) for q in names)]


def broker_options(settings: Settings) -> dict:
    """Broker URL and transport options, the same for the API's sender and the workers."""
    if settings.redis_url:
        # An unacknowledged job comes back after this long; never shorter than the hard time limit
        # (Settings refuses that), so a job that still runs is never handed to a second worker.
        return {"broker_url": settings.redis_url,
                "broker_transport_options": {"visibility_timeout": settings.broker_visibility_timeout_s}}
    queue = settings.queue_dir
    for sub in ("in", "processed", "control"):
        (queue / sub).mkdir(parents=True, exist_ok=True)
    return {"broker_url": "filesystem://", "broker_transport_options": {
        "data_folder_in": str(queue / "in"), "data_folder_out": str(queue / "in"),
        "processed_folder": str(queue / "processed"), "store_processed": False,
        "control_folder": str(queue / "control"),  # exchange tables; kombu's default is ./control
    }}


class JobQueue(Protocol):
    def send(self, export_id: str, queue: str) -> None:
        """Ring the doorbell of ``export_id`` on ``queue``; raise BrokerUnavailable if it cannot."""

    def check(self) -> None:
        """Readiness: return if the broker takes connections now, else raise BrokerUnavailable."""


class CeleryQueue:
    """Sends RUN_EXPORT messages through Celery's protocol without importing the workers' tasks."""

    # One quick retry: a request thread must not hang on a dead broker; the sweeper sends later.
    PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}

    def __init__(self, settings: Settings):
        from celery import Celery

        self.app = Celery("exportfarm-sender")
        self.app.conf.update(broker_options(settings), broker_connection_timeout=2,
                             broker_connection_retry_on_startup=False, task_ignore_result=True)

    def send(self, export_id: str, queue: str) -> None:
        try:
            self.app.send_task(RUN_EXPORT, args=[export_id], queue=queue, retry=True, retry_policy=self.PUBLISH_RETRY)
        except Exception as err:  # kombu raises many connection error types
            raise BrokerUnavailable(f"the job queue is unreachable ({type(err).__name__}: {err})") from err

    def check(self) -> None:
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
        except Exception as err:
            raise BrokerUnavailable(f"the job queue is unreachable ({type(err).__name__})") from err
