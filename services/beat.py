"""The farm's periodic work, in one loop: sweep every SWEEP_INTERVAL_S, check runtimes every BEAT_INTERVAL_S.

``exportfarm beat`` runs it in a deployment, ``exportfarm serve`` beside its API in embedded mode.
It runs in its own process, not as Celery tasks, so busy or absent workers can never delay it and
no scheduled check piles up in a queue to run late. Two loops at once are safe (every change is a
conditional UPDATE, and re-exports are unique per predecessor and target runtime).
"""

from __future__ import annotations

import logging
import threading
import time

from services.catalog.database import session_scope
from services.queue import JobQueue
from services.scheduler import plan_and_queue_reexports
from services.settings import Settings
from services.storage import ArtifactStore
from services.storage_factory import make_store
from services.sweeper import SweepReport, Sweeper

log = logging.getLogger(__name__)


class Beat:
    def __init__(self, settings: Settings, queue: JobQueue, store: ArtifactStore | None = None):
        """``store``: default the impatient one (seconds, not the workers' minutes, per request): a
        sweep that meets a down S3 notes it and goes on to the dispatch, instead of waiting ~90 s for
        every expired lease while nothing else is sent."""
        self.settings = settings
        self.sweeper = Sweeper(settings, queue, store or make_store(settings, patient=False))
        self._next_check = 0.0

    def check_runtimes(self) -> None:
        with session_scope(self.settings.catalog_url) as session:
            plan = plan_and_queue_reexports(session, self.settings)
        if plan.queued or plan.deferred:
            log.info("runtime check: %d re-exports queued, %d deferred (%d in flight, cap %d)",
                     len(plan.queued), len(plan.deferred), plan.in_flight, plan.cap)
        self.sweeper.dispatch(SweepReport(), grace_s=0)

    def tick(self) -> None:
        """One round; an error is logged and the next round tries again (a database restart, say)."""
        try:
            self.sweeper.sweep()
        except Exception:
            log.warning("sweep failed; retrying in %.0f s", self.settings.sweep_interval_s, exc_info=True)
        if time.monotonic() >= self._next_check:
            try:
                self.check_runtimes()
                self._next_check = time.monotonic() + self.settings.beat_interval_s
            except Exception:
                log.warning("runtime check failed; retrying next round", exc_info=True)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            stop.wait(self.settings.sweep_interval_s)
