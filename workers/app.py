"""The workers' Celery application, built from settings."""

from __future__ import annotations

from celery import Celery

from services.settings import Settings
from workers.config import celery_config


def make_celery(settings: Settings) -> Celery:
    app = Celery("exportfarm")
    app.conf.update(celery_config(settings))
    app.conf.exportfarm_settings = settings
    from workers import tasks

    tasks.register(app)
    return app
