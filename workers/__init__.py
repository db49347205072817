"""Celery workers that run the export pipeline (the farm)."""
