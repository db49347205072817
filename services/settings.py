"""All farm settings in one pydantic-settings object (environment variables or a .env file).

With nothing set, everything is embedded under ``DATA_DIR``: SQLite catalog, a local-directory
artifact store, a file-based Celery queue. ``DATABASE_URL``, ``REDIS_URL`` and the ``S3_*``
settings switch each part to the real service.
"""

from __future__ import annotations

import functools
import secrets
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    data_dir: Path = Field(Path(".exportfarm"), description="embedded catalog, queue, store and work dirs")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite under data_dir")
    redis_url: str | None = Field(None, description="Celery broker; default a file-based queue under data_dir")

    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint; default a local directory store")
    s3_public_endpoint_url: str | None = Field(None, description="endpoint presigned links name (default: S3_ENDPOINT_URL)")
    s3_bucket: str = "exportfarm"
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    s3_multipart_threshold_bytes: int = 64 * 1024 * 1024
    s3_multipart_chunk_bytes: int = 64 * 1024 * 1024
    upload_attempts: int = 8
    upload_backoff_s: float = 1.0

    public_base_url: str = Field("http://127.0.0.1:8000", description="base of links the API hands out")
    signing_secret: str = Field(default_factory=lambda: secrets.token_hex(32), description="local link signing")
    presign_expires_s: int = 3600
    admin_token: str | None = Field(None, description="bootstrap admin bearer token (stored hashed)")
    max_body_bytes: int = 16 * 1024

    models_dir: Path | None = Field(None, description="local checkpoints the API may export, by directory name")
    work_dir: Path | None = Field(None, description="worker scratch; default data_dir/work")
    worker_queues: str = "cpu"
    task_soft_time_limit_s: int = 6 * 3600
    task_time_limit_s: int = 6 * 3600 + 600
    visibility_timeout_s: int = 3600
    validate_ep: str | None = Field(None, description="EP to validate and bench on; default the request's")
    bench_contexts: list[int] = [128, 512]
    bench_steps: int = 32
    bench_repeats: int = 1
    publish_retries: int = 5
    reexport_policy: str = Field("all", description="all | listed | dry-run: what an ORT upgrade re-exports")
    reexport_models: list[str] = Field(default_factory=list, description="models re-exported under 'listed'")
    reexport_max_per_run: int = Field(8, description="rate cap: re-exports one beat may queue")
    beat_interval_s: float = 300.0
    beat_queue: str = Field("cpu", description="queue whose workers run the beat's runtime check")
    regression_latency_pct: float = 10.0
    regression_node_count_pct: float = 10.0
    heartbeat_s: float = 10.0
    worker_report_s: float = 60.0
    lease_s: float = 60.0  # a running job whose heartbeat is older than this may be taken over

    @field_validator("data_dir", mode="after")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @property
    def catalog_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'catalog.db'}"

    @property
    def broker_url(self) -> str:
        return self.redis_url or "filesystem://"

    @property
    def queue_dir(self) -> Path:
        return self.data_dir / "queue"

    @property
    def scratch_dir(self) -> Path:
        return (self.work_dir or self.data_dir / "work").expanduser().absolute()

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "store"


@functools.cache
def get_settings() -> Settings:
    return Settings()
