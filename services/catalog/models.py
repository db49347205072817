"""SQLAlchemy 2 models of the catalog (schema changes go through Alembic migrations)."""

from __future__ import annotations

import datetime
import enum
import uuid

from sqlalchemy import JSON, Boolean, DateTime, Enum, ForeignKey, Integer, String, Text, UniqueConstraint, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _host_is_db_clock(dialect: str) -> bool:
    """SQLite is the embedded catalog on the one host every process runs on: its clock is that host's."""
    return dialect == "sqlite"


def db_time_ago(database: str, seconds: float):
    """The catalog's time ``seconds`` ago, as the statement it is used in runs (``db_now`` for use
    inside an UPDATE's condition, so nothing changes between reading the clock and writing).
    ``database``: its URL or its dialect's name."""
    from sqlalchemy import func, literal

    delta = datetime.timedelta(seconds=seconds)
    if _host_is_db_clock(database.split(":", 1)[0].split("+", 1)[0]):
        return utcnow() - delta
    return func.now() - literal(delta)


def lease_live(database: str, lease_s: float):
    """A running row's lease was renewed within ``lease_s`` of the catalog's clock (its negation:
    the sweeper may settle the attempt). One predicate for the worker's writes and the sweeper."""
    return Export.heartbeat_at.is_not(None) & (Export.heartbeat_at >= db_time_ago(database, lease_s))


def db_now(session) -> datetime.datetime:
    """The catalog's clock, for everything that stamps or judges a lease: a worker's host clock and
    the sweeper's may disagree by minutes (a worker 65 s behind had every healthy job requeued), the
    database's is one for all of them. PostgreSQL's ``now()`` (the transaction's start); SQLite is the
    embedded catalog on the one host every process runs on, so that host's clock is the database's."""
    bind = session.get_bind()
    with session.no_autoflush:  # asking the time must not write a half-built row
        return _clock(bind.dialect.name, session.execute)


def catalog_clock(context) -> datetime.datetime:
    """Column default: the catalog's time (``db_now``) for rows any host inserts, so an export's
    events and times read in order whatever the inserting worker's clock says."""
    return _clock(context.dialect.name, context.connection.execute)


def _clock(dialect: str, execute) -> datetime.datetime:
    from sqlalchemy import func, select

    if _host_is_db_clock(dialect):
        return utcnow()
    value = execute(select(func.now())).scalar_one()
    return value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    type_annotation_map = {datetime.datetime: DateTime(timezone=True), dict: JSON}


class ExportStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    READY = "ready"
    QUARANTINED = "quarantined"  # built and published, but a validation gate failed
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (ExportStatus.READY, ExportStatus.QUARANTINED, ExportStatus.FAILED, ExportStatus.CANCELLED)


# Statuses a new identical request is deduplicated against (a failed or cancelled one is retried).
LIVE_STATUSES = (ExportStatus.QUEUED, ExportStatus.RUNNING, ExportStatus.READY)


class Export(Base):
    """One export job and its outcome. This row, not the broker, is the truth about the job.

    A worker owns a running job for one ``attempts`` value (its lease, renewed through
    ``heartbeat_at``); every write a worker makes is conditional on it (services.lifecycle).
    ``dispatched_at`` is the outbox: NULL means committed but not yet sent to the queue.
    """

    __tablename__ = "exports"
    __table_args__ = (
        # At most one re-export per (predecessor, target onnxruntime), whatever its outcome.
        UniqueConstraint("predecessor_id", "target_ort", name="uq_exports_successor"),
        # One live export per distinct request: a concurrent identical request gets this one.
        UniqueConstraint("live_key", name="uq_exports_live_key"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    cache_key: Mapped[str] = mapped_column(String(64), index=True)  # what was built (manifest's key)
    request_key: Mapped[str] = mapped_column(String(64), index=True)  # what was asked, before resolution
    live_key: Mapped[str | None] = mapped_column(String(64), nullable=True)  # request_key while it dedupes
    model: Mapped[str] = mapped_column(String(300), index=True)
    revision: Mapped[str] = mapped_column(String(100))
    dtype: Mapped[str] = mapped_column(String(8))
    ep: Mapped[str] = mapped_column(String(8))
    static_cache: Mapped[bool] = mapped_column(Boolean, default=False)
    max_seq_len: Mapped[int | None] = mapped_column(Integer, nullable=True)
    variant: Mapped[str] = mapped_column(String(20), index=True)
    quant: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # int4 / int8: QuantSpec options
    # The published files' layout (farm | hf) and the older-runtime graph target: builds of their own.
    layout: Mapped[str] = mapped_column(String(8), default="farm", server_default="farm")
    compat: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Who the request asks to build the graph (exporter.request.BUILDERS); the manifest names who did.
    builder: Mapped[str] = mapped_column(String(8), default="auto", server_default="auto")
    # The worker class the job is sent to (services.placement; NULL on older rows: its EP's default)
    # and the resource estimate that chose it.
    queue: Mapped[str | None] = mapped_column(String(40), nullable=True)
    estimate: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    ort_version: Mapped[str] = mapped_column(String(40))
    exporter_version: Mapped[str] = mapped_column(String(40))
    status: Mapped[ExportStatus] = mapped_column(Enum(ExportStatus, native_enum=False, length=16), index=True)
    stage: Mapped[str | None] = mapped_column(String(20), nullable=True)
    percent: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    reason: Mapped[str] = mapped_column(String(40), default="request")
    predecessor_id: Mapped[str | None] = mapped_column(ForeignKey("exports.id"), nullable=True, index=True)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    worker_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the worker's main process
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    target_ort: Mapped[str | None] = mapped_column(String(40), nullable=True)  # re-exports: the runtime to build on
    lost_reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # how the last attempt died
    lost_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # attempts that died
    dispatched_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    storage_prefix: Mapped[str | None] = mapped_column(String(600), nullable=True)
    manifest: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    figures: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # key parity / latency numbers
    timings: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    diff: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # against the predecessor (re-exports)
    regression: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime.datetime] = mapped_column(default=catalog_clock)
    updated_at: Mapped[datetime.datetime] = mapped_column(default=catalog_clock, onupdate=catalog_clock)
    started_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)

    events: Mapped[list[ExportEvent]] = relationship(back_populates="export", order_by="ExportEvent.id")


class ExportEvent(Base):
    """Audit trail: every state or stage change of an export, with its time."""

    __tablename__ = "export_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    export_id: Mapped[str] = mapped_column(ForeignKey("exports.id"), index=True)
    at: Mapped[datetime.datetime] = mapped_column(default=catalog_clock)
    from_status: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_status: Mapped[str] = mapped_column(String(16))
    stage: Mapped[str | None] = mapped_column(String(20), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)

    export: Mapped[Export] = relationship(back_populates="events")


class Worker(Base):
    __tablename__ = "workers"

    hostname: Mapped[str] = mapped_column(String(200), primary_key=True)
    queues: Mapped[str] = mapped_column(String(100))
    onnxruntime: Mapped[str] = mapped_column(String(40))
    cuda: Mapped[str | None] = mapped_column(String(40), nullable=True)
    gpu: Mapped[str | None] = mapped_column(String(200), nullable=True)
    exporter_version: Mapped[str] = mapped_column(String(40))
    capacity: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # host / GPU memory, disk it reported
    gpu_device: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the GPU it is bound to
    started_at: Mapped[datetime.datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime.datetime] = mapped_column(default=utcnow)


class RuntimeReport(Base):
    """History of the runtimes each worker reported (one row per change)."""

    __tablename__ = "runtime_reports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hostname: Mapped[str] = mapped_column(String(200), index=True)
    queues: Mapped[str] = mapped_column(String(100))
    onnxruntime: Mapped[str] = mapped_column(String(40))
    cuda: Mapped[str | None] = mapped_column(String(40), nullable=True)
    gpu: Mapped[str | None] = mapped_column(String(200), nullable=True)
    reported_at: Mapped[datetime.datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (UniqueConstraint("token_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    token_hash: Mapped[str] = mapped_column(String(64))  # sha256 hex; the token itself is never stored
    scope: Mapped[str] = mapped_column(String(10))  # read | admin
    created_at: Mapped[datetime.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    last_used_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
    bootstrap: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # from ADMIN_TOKEN



class UiSession(Base):
    """A signed-in browser: its own random id (only its sha256 is stored), the token it signed in
    with, and when it ends; the pages' cookie is the id, never the token."""

    __tablename__ = "ui_sessions"
    __table_args__ = (UniqueConstraint("session_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_hash: Mapped[str] = mapped_column(String(64))
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"))
    created_at: Mapped[datetime.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime.datetime] = mapped_column()
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(nullable=True)
