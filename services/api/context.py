"""What the API's routes share: settings, store, queue, sweeper and metrics, built once per app."""

from __future__ import annotations

import dataclasses

from services.catalog.database import session_factory
from services.metrics import Metrics
from services.queue import JobQueue
from services.settings import Settings
from services.storage import ArtifactStore
from services.sweeper import Sweeper


@dataclasses.dataclass
class ApiContext:
    settings: Settings
    store: ArtifactStore
    queue: JobQueue
    sweeper: Sweeper
    metrics: Metrics
    auth_limiter: object = None  # the guard's FailureLimiter, shared with the pages' sign-in form

    @property
    def sessions(self):
        return session_factory(self.settings.catalog_url)
