"""Real services for the farm tests: a fresh PostgreSQL database, a Redis database, settings."""

from __future__ import annotations

import contextlib
import os
import uuid

POSTGRES_ADMIN_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_TEST_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


@contextlib.contextmanager
def fresh_postgres_database():
    """Create an empty database for one test session on the local server; drop it afterwards."""
    import psycopg

    name = f"exportfarm_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base.replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    finally:
        from services.catalog.database import forget_engines

        forget_engines()
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def flush_redis(url: str = REDIS_TEST_URL) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


@contextlib.contextmanager
def farm_api(env: dict, admin: str):
    """The real API app (TestClient, admin token set) on the settings ``env`` gives, its catalog
    migrated first as `exportfarm db-upgrade` (the Helm job) does; ``client.settings`` holds them."""
    import pytest
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from services.catalog.database import upgrade_schema
    from services.settings import Settings

    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    try:
        settings = Settings()
        upgrade_schema(settings.catalog_url)
        client = TestClient(create_app(settings))
        client.headers["Authorization"] = f"Bearer {admin}"
        client.settings = settings
        yield client
    finally:
        mp.undo()
