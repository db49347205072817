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


_ENGINES: dict[str, Engine] = {}


def engine_for(url: str) -> Engine:
    if url not in _ENGINES:
        _ENGINES[url] = _make_engine(url)
    return _ENGINES[url]


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):
            # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
            cursor = conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    # More connections than the API's 40 worker threads: a request never waits for one while holding another.
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=30)


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
    from alembic.config import Config

    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
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
