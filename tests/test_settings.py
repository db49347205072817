"""Settings: one object, every field documented in .env.example, embedded defaults."""

from pathlib import Path

from services.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_env_example_lists_every_setting():
    text = (ROOT / ".env.example").read_text()
    missing = [name.upper() for name in Settings.model_fields if f"{name.upper()}=" not in text]
    assert missing == []


def test_embedded_defaults(tmp_path, monkeypatch):
    for name in ("DATABASE_URL", "REDIS_URL", "S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(data_dir=tmp_path)
    assert settings.catalog_url == f"sqlite:///{tmp_path / 'catalog.db'}"
    assert settings.broker_url == "filesystem://"
    assert settings.store_dir == tmp_path / "store"


def test_bench_sizes_must_be_positive(tmp_path):
    import pytest
    from pydantic import ValidationError

    assert Settings(data_dir=tmp_path, bench_batches=[1, 8]).bench_batches == [1, 8]
    with pytest.raises(ValidationError, match="BENCH_BATCHES must be a non-empty list of positive integers"):
        Settings(data_dir=tmp_path, bench_batches=[0])
    with pytest.raises(ValidationError, match="BENCH_CONTEXTS"):
        Settings(data_dir=tmp_path, bench_contexts=[])


def test_a_bad_setting_stops_serve_with_one_line_naming_it(tmp_path):
    """Not a pydantic traceback: the setting, what is wrong, where to fix it; exit status 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DATA_DIR": str(tmp_path), "ADMIN_TOKEN": "x" * 17}
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--port", "0"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("exportfarm: error: invalid settings: ADMIN_TOKEN: ")
    assert "at least 24 characters (got 17)" in lines[0]
