"""Celery configuration in one place: routing, acknowledgement, retries and time limits."""

from __future__ import annotations

from services.settings import Settings

QUEUE_FOR_EP = {"cuda": "gpu", "cpu": "cpu"}
RUN_EXPORT = "exportfarm.run_export"
CHECK_UPGRADES = "exportfarm.check_runtime_upgrades"


def celery_config(settings: Settings) -> dict:
    config = {
        "broker_url": settings.broker_url,
        "task_ignore_result": True,  # state lives in the catalog, not in a result backend
        # A job is acknowledged only when it finished; a worker that dies mid-job hands it back.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,  # one job at a time per worker (one GPU)
        "worker_concurrency": 1,
        "task_soft_time_limit": settings.task_soft_time_limit_s,
        "task_time_limit": settings.task_time_limit_s,
        "task_default_queue": "cpu",
        "task_routes": {RUN_EXPORT: {"queue": "cpu"}},  # overridden per request by EP at send time
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        # The beat's periodic runtime check; a light task, run by workers of BEAT_QUEUE.
        "beat_schedule": {
            "check-runtime-upgrades": {
                "task": CHECK_UPGRADES, "schedule": settings.beat_interval_s, "options": {"queue": settings.beat_queue},
            }
        },
        "beat_schedule_filename": str(settings.data_dir / "celerybeat-schedule"),
    }
    if settings.redis_url:
        # Unacknowledged jobs of a worker that vanished come back after this long.
        config["broker_transport_options"] = {"visibility_timeout": settings.visibility_timeout_s}
    else:
        queue = settings.queue_dir
        for sub in ("in", "processed"):
            (queue / sub).mkdir(parents=True, exist_ok=True)
        config["broker_transport_options"] = {
            "data_folder_in": str(queue / "in"),
            "data_folder_out": str(queue / "in"),
            "processed_folder": str(queue / "processed"),
            "store_processed": False,
        }
    return config
