"""All farm settings in one pydantic-settings object (environment variables or a .env file).

With nothing set, everything is embedded under ``DATA_DIR``: SQLite catalog, a local-directory
artifact store, a file-based Celery queue. ``DATABASE_URL``, ``REDIS_URL`` and the ``S3_*``
settings switch each part to the real service.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exporter.errors import ExportError


MIN_TOKEN_LENGTH = 24
MIN_SECRET_LENGTH = 32


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
    signing_secret: str | None = Field(
        None, description="signs local-store download links; embedded mode keeps one in DATA_DIR/signing.key")
    presign_expires_s: int = Field(3600, gt=0, description="how long a download link works")
    admin_token: str | None = Field(
        None, description=f"bootstrap admin bearer token, at least {MIN_TOKEN_LENGTH} characters (stored hashed); "
        "changing it revokes the previous one")
    max_body_bytes: int = Field(16 * 1024, gt=0, description="largest request body the API reads")
    hub_access: bool = Field(False, description="allow hub model ids (workers download them); off: MODELS_DIR only")
    auth_failures_per_minute: int = Field(10, ge=1, description="failed authentications per client before 429")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="addresses of proxies whose X-Forwarded-For names the client "
        '(JSON list, e.g. ["10.0.0.5"]); failed logins are counted per client')
    token_cache_s: float = Field(5.0, ge=0, description="how long an API process trusts a token it checked")
    ui_sessions_per_token: int = Field(
        10, ge=1, description="signed-in browsers (/ui sessions) one token keeps; a new sign-in ends its oldest")

    models_dir: Path | None = Field(None, description="local checkpoints the API may export, by directory name")
    work_dir: Path | None = Field(None, description="worker scratch; default data_dir/work")
    worker_queues: str = Field("cpu", description="queues a worker serves: cpu, gpu or both, or names from "
                               "QUEUE_CLASSES (comma-separated)")
    queue_classes: dict[str, dict[str, str | float]] = Field(
        default_factory=dict, description='worker classes jobs are placed on by their resource estimate, e.g. '
        '{"gpu": {"ep": "cuda", "memory_gb": 64, "gpu_memory_gb": 80, "disk_gb": 200}, "gpu-large": {...}}; '
        'default: cpu and gpu, unsized (embedded: sized as this machine)')
    worker_memory_gb: float | None = Field(
        None, gt=0, description="host memory this worker may use; default its cgroup's limit, else the machine's")
    worker_gpu_memory_gb: float | None = Field(
        None, gt=0, description="GPU memory this worker may use; default the free memory of its GPU (NVML)")
    worker_disk_gb: float | None = Field(
        None, gt=0, description="disk this worker may use; default the free space of its work directory")
    gpu_device: int | None = Field(
        None, ge=0, description="the GPU (index among those the process sees) this worker is bound to: one "
        "worker per GPU; default 0")
    task_soft_time_limit_s: int = Field(6 * 3600, description="a job still running after this fails, naming its stage")
    task_time_limit_s: int = Field(6 * 3600 + 600, description="hard limit: the worker's pool process is killed")
    visibility_timeout_s: int | None = Field(
        None, description="Redis redelivery of an unacknowledged job; default and minimum: TASK_TIME_LIMIT_S + 600")
    validate_ep: str | None = Field(None, description="EP to validate and bench on; default the request's")
    quality_thresholds: dict[str, dict[str, float]] = Field(
        default_factory=dict, description='int4 / int8 quality gate limits over the defaults, e.g. '
        '{"int4": {"kl_max": 0.2, "agreement_min": 0.8, "ppl_delta_max": 0.2}}')
    cache_max_gb: float = Field(
        20.0, gt=0, description="rope tables and reference runs a worker keeps under DATA_DIR (each), least recently used "
        "deleted first")
    hub_cache_max_gb: float | None = Field(
        None, gt=0, description="downloaded hub checkpoints a worker keeps (huggingface_hub's cache), least recently "
        "used revisions deleted first; default unbounded")
    bench_contexts: list[int] = Field([128, 512], description="decode context lengths the worker benchmarks")
    bench_batches: list[int] = Field([1], description="batch sizes the worker benchmarks (rows decoded at once)")
    bench_steps: int = Field(32, gt=0, description="timed decode steps per context")
    bench_repeats: int = Field(1, description="benchmark runs per context (step times pooled)")
    publish_retries: int = Field(5, description="publish attempts while the object store fails, backing off")
    reexport_policy: str = Field("all", description="all | listed | dry-run: what an ORT upgrade re-exports")
    reexport_models: list[str] = Field(default_factory=list, description="models re-exported under 'listed'")
    reexport_max_in_flight: int = Field(4, ge=0, description="cap on re-exports queued or running at once")
    reexport_timeout_s: float = Field(
        24 * 3600.0, description="a re-export no worker of its target runtime starts within this long fails")
    beat_interval_s: float = Field(300.0, description="how often beat checks workers' runtimes for re-exports")
    regression_latency_pct: float = Field(10.0, description="decode latency increase a re-export's diff flags")
    regression_node_count_pct: float = Field(10.0, description="node count increase a re-export's diff flags")
    heartbeat_s: float = Field(10.0, gt=0, description="how often a worker renews its job's lease")
    worker_report_s: float = Field(60.0, gt=0, description="how often a worker reports its runtime")
    lease_s: float = Field(60.0, gt=0, description="a running job whose lease is older than this is re-dispatched")
    max_attempts: int = Field(3, ge=1, description="lost attempts (its worker died or was cut off) before a job fails with the reason")
    sweep_interval_s: float = Field(10.0, gt=0, description="how often the sweeper re-dispatches and expires leases")
    redispatch_s: float = Field(
        60.0, gt=0, description="re-send a queued job's message when a worker of its queue sat idle this long")
    shutdown_grace_s: float = Field(5.0, ge=0, description="embedded serve: wait this long for its worker to stop")

    @field_validator("bench_contexts", "bench_batches", mode="after")
    @classmethod
    def _positive_sizes(cls, value: list[int], info) -> list[int]:
        if not value or any(v < 1 for v in value):
            raise ValueError(f"{info.field_name.upper()} must be a non-empty list of positive integers, e.g. [1, 8]; "
                             f"got {value}")
        return value

    @field_validator("queue_classes", mode="before")
    @classmethod
    def _classes_from_json(cls, value):
        # The environment gives JSON (pydantic-settings decodes it); a settings file or a test may
        # hand over the same text.
        if isinstance(value, str):
            import json

            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"QUEUE_CLASSES is not JSON ({err}): e.g. "
                                 '{"gpu": {"ep": "cuda", "memory_gb": 64, "gpu_memory_gb": 80}}') from None
        return value

    @field_validator("queue_classes", mode="after")
    @classmethod
    def _sized_classes(cls, value: dict) -> dict:
        sizes = ("memory_gb", "gpu_memory_gb", "disk_gb")
        for name, spec in value.items():
            if not name or not all(c.isalnum() or c in "-_" for c in name) or len(name) > 30:
                raise ValueError(f"QUEUE_CLASSES name {name!r}: use letters, digits, '-' and '_' (at most 30)")
            if spec.get("ep") not in ("cpu", "cuda"):
                raise ValueError(f"QUEUE_CLASSES[{name!r}] needs \"ep\": \"cpu\" or \"cuda\", got {spec.get('ep')!r}")
            unknown = sorted(set(spec) - {"ep", *sizes})
            if unknown:
                raise ValueError(f"QUEUE_CLASSES[{name!r}] has {', '.join(unknown)}: use ep, {', '.join(sizes)}")
            for key in sizes:
                if key in spec and not (isinstance(spec[key], (int, float)) and spec[key] > 0):
                    raise ValueError(f"QUEUE_CLASSES[{name!r}][{key!r}] must be a positive number of GiB, "
                                     f"got {spec[key]!r}")
        return value

    @field_validator("quality_thresholds", mode="after")
    @classmethod
    def _known_thresholds(cls, value: dict) -> dict:
        from exporter.validation.gates.quality import DEFAULT_THRESHOLDS

        for dtype, limits in value.items():
            if dtype not in DEFAULT_THRESHOLDS:
                raise ValueError(f"QUALITY_THRESHOLDS has dtype {dtype!r}: use {', '.join(DEFAULT_THRESHOLDS)}")
            unknown = sorted(set(limits) - set(DEFAULT_THRESHOLDS[dtype]))
            if unknown:
                raise ValueError(f"QUALITY_THRESHOLDS[{dtype!r}] has {', '.join(unknown)}: use "
                                 f"{', '.join(DEFAULT_THRESHOLDS[dtype])}")
        return value

    @field_validator("admin_token", mode="after")
    @classmethod
    def _long_enough_token(cls, value: str | None) -> str | None:
        if value is not None and len(value) < MIN_TOKEN_LENGTH:
            raise ValueError(f"ADMIN_TOKEN must be at least {MIN_TOKEN_LENGTH} characters (got {len(value)}): "
                             "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        return value

    @field_validator("signing_secret", mode="after")
    @classmethod
    def _long_enough_secret(cls, value: str | None) -> str | None:
        if value is not None and len(value) < MIN_SECRET_LENGTH:
            raise ValueError(f"SIGNING_SECRET must be at least {MIN_SECRET_LENGTH} characters (got {len(value)}): "
                             "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
        return value

    @model_validator(mode="after")
    def _lifecycle_bounds(self) -> Settings:
        if self.task_soft_time_limit_s > self.task_time_limit_s:
            raise ValueError(
                f"TASK_SOFT_TIME_LIMIT_S ({self.task_soft_time_limit_s}) is above TASK_TIME_LIMIT_S "
                f"({self.task_time_limit_s}): the soft limit must come first")
        if self.visibility_timeout_s is not None and self.visibility_timeout_s < self.task_time_limit_s:
            # Redis hands an unacknowledged job to another worker after this long, even while the
            # first still runs it: shorter than the hard limit means two workers on one job.
            raise ValueError(
                f"VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) is shorter than TASK_TIME_LIMIT_S "
                f"({self.task_time_limit_s}): a long job would be redelivered while it still runs; "
                "raise it or leave it unset")
        if self.lease_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"LEASE_S ({self.lease_s}) must be at least twice HEARTBEAT_S ({self.heartbeat_s}): "
                "one late heartbeat would otherwise hand a live job to another worker")
        return self

    @property
    def broker_visibility_timeout_s(self) -> int:
        return self.visibility_timeout_s if self.visibility_timeout_s is not None else self.task_time_limit_s + 600

    @field_validator("database_url", "redis_url", "s3_endpoint_url", "s3_public_endpoint_url", "s3_access_key",
                     "s3_secret_key", "admin_token", "models_dir", "work_dir", "validate_ep", "visibility_timeout_s",
                     "worker_memory_gb", "worker_gpu_memory_gb", "worker_disk_gb", "gpu_device", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        # `REDIS_URL=` in a .env file or a compose file means "not set", not "the empty URL".
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("data_dir", mode="after")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @property
    def embedded(self) -> bool:
        """Nothing external: SQLite catalog and filesystem queue under DATA_DIR (one host, one serve)."""
        return not self.database_url and not self.redis_url

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


class SettingsError(ExportError):
    """Settings the farm cannot start with: one line per setting, what is wrong and what to set."""


def describe_invalid(err: ValidationError) -> str:
    """A pydantic ValidationError as the settings a user sets (environment names) and what is wrong."""
    parts = []
    for problem in err.errors():
        name = "_".join(str(p) for p in problem.get("loc", ()) if not isinstance(p, int)).upper() or "settings"
        given = problem.get("input")
        shown = f" (got a {len(given)}-character value)" if isinstance(given, str) and "length" in problem["msg"] \
            else ""
        parts.append(f"{name}: {problem['msg'].removeprefix('Value error, ')}{shown}")
    return "invalid settings: " + "; ".join(parts) + ": fix them in the environment or .env"


@functools.cache
def get_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as err:
        raise SettingsError(describe_invalid(err)) from None
