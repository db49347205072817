"""Engines, sessions and schema migrations (Alembic) for the catalog."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.pool import NullPool
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_S = 5.0


_ENGINES: dict[str, Engine] = {}


def engine_for(url: str) -> Engine:
    if url not in _ENGINES:
        _ENGINES[url] = _make_engine(url)
    return _ENGINES[url]


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # A writer waits at most BUSY_TIMEOUT_S for another's lock, then the API answers 503.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):
            # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
            cursor = conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    # More connections than the API's 40 worker threads: a request never waits for one while holding
    # another. Waits are bounded (connect, pool, row locks), so an unavailable or locked catalog is an
    # error within seconds, not a hung request.
    connect_args = {"connect_timeout": int(BUSY_TIMEOUT_S)} if url.startswith("postgresql") else {}
    if url.startswith("postgresql"):
        connect_args["options"] = f"-c lock_timeout={int(BUSY_TIMEOUT_S * 1000)}"
    # pool_size covers the 40 threads of the API's pool: overflow connections are opened and closed per
    # checkout, which under load is a PostgreSQL connection setup per request.
    return create_engine(url, pool_pre_ping=True, pool_size=40, max_overflow=10, pool_timeout=BUSY_TIMEOUT_S,
                         connect_args=connect_args)


@functools.cache
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


@contextlib.contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """One transaction: committed on success, rolled back on any error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def upgrade_schema(url: str) -> None:
    """Bring the catalog schema to the newest Alembic revision (idempotent)."""
    from alembic import command

    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    config = _alembic_config(url)
    if not url.startswith("postgresql"):
        command.upgrade(config, "head")
        return
    # Several API workers or pods may start at once: one migrates, the others wait for it. A
    # throwaway engine: no pooled connection may outlive this (a forking worker would share it).
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(hashtext('exportfarm-migrations'))"))
            try:
                command.upgrade(config, "head")
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(hashtext('exportfarm-migrations'))"))
    finally:
        engine.dispose()


def _alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def check_schema(url: str) -> None:
    """Refuse to run on a catalog whose schema is not the newest revision (say what to run)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from exporter.errors import ExportError

    head = ScriptDirectory.from_config(_alembic_config(url)).get_current_head()
    from sqlalchemy.exc import OperationalError

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except OperationalError as err:
        raise ExportError(f"cannot open the catalog ({str(err.orig).splitlines()[0]}): check DATABASE_URL; a new "
                          "catalog is created by `exportfarm db-upgrade`") from None
    finally:
        engine.dispose()
    if current != head:
        raise ExportError(
            f"the catalog schema is at revision {current or 'none (empty database)'}, this exportfarm needs {head}: "
            "run `exportfarm db-upgrade` (the Helm chart's migration job and docker compose's migrate service do)")


def forget_engines() -> None:
    """Close and forget every engine (a test dropping its database first closes our connections)."""
    for engine in _ENGINES.values():
        engine.dispose()
    _ENGINES.clear()
    session_factory.cache_clear()


def forget_inherited_connections() -> None:
    """In a forked child: drop pooled connections the parent opened (never share a socket)."""
    for engine in list(_ENGINES.values()):
        engine.dispose(close=False)
