"""The Celery application; ``make_celery`` builds it from settings (API and workers share it)."""

from __future__ import annotations

import functools

from celery import Celery

from services.settings import Settings, get_settings
from workers.config import celery_config


def make_celery(settings: Settings) -> Celery:
    app = Celery("exportfarm")
    app.conf.update(celery_config(settings))
    app.conf.exportfarm_settings = settings
    from workers import tasks

    tasks.register(app)
    return app


@functools.cache
def default_app() -> Celery:
    return make_celery(get_settings())
