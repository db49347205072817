"""Worker caches stay within their sizes: rope tables and reference runs (least recently used
first, a read counting as a use), and downloaded hub checkpoints (whole revisions, through
huggingface_hub's own cache scan and delete). Nothing used in the last hour is evicted."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest

from exporter.cache import read_npz, trim_hub_cache, trim_lru, write_atomic, write_npz

HOUR = 3600


def aged(path: Path, hours: float) -> Path:
    stamp = time.time() - hours * HOUR
    os.utime(path, (stamp, stamp))
    return path


def test_trim_lru_deletes_least_recently_used_first_and_a_read_counts(tmp_path):
    files = []
    for i in range(4):  # run-0 written longest ago
        write_npz(tmp_path / "references" / f"run-{i}.npz", x=np.zeros(25_000, np.float32))
        files.append(aged(tmp_path / "references" / f"run-{i}.npz", 10 - i))
    size = files[0].stat().st_size
    aged(files[0], 20)
    assert read_npz(files[0]) is not None  # the oldest one is read: used now
    write_npz(tmp_path / "references" / "fresh.npz", x=np.zeros(25_000, np.float32))

    deleted, freed = trim_lru(tmp_path / "references", max_bytes=3 * size)

    assert (deleted, freed) == (2, 2 * size)
    left = sorted(p.name for p in (tmp_path / "references").iterdir())
    assert left == ["fresh.npz", "run-0.npz", "run-3.npz"]  # run-1 and run-2 were the least recently used


def test_trim_lru_never_deletes_what_was_used_in_the_last_hour(tmp_path):
    for i in range(3):
        write_npz(tmp_path / f"t{i}.npz", x=np.zeros(1000))
    assert trim_lru(tmp_path, max_bytes=0) == (0, 0)
    assert len(list(tmp_path.iterdir())) == 3


def _hub_revision(cache: Path, repo: str, commit: str, nbytes: int, hours_ago: float) -> None:
    """One revision in huggingface_hub's documented cache layout (blobs, snapshots, refs)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / f"{commit}-weights"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(os.urandom(nbytes))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    aged(blob, hours_ago)


def test_trim_hub_cache_deletes_whole_least_recently_used_revisions(tmp_path):
    cache = tmp_path / "hub"
    mb = 1 << 20
    _hub_revision(cache, "org/old", "a" * 40, mb, hours_ago=48)
    _hub_revision(cache, "org/kept", "b" * 40, mb, hours_ago=72)  # the running job's revision
    _hub_revision(cache, "org/middle", "c" * 40, mb, hours_ago=24)
    _hub_revision(cache, "org/recent", "d" * 40, mb, hours_ago=0.1)  # another job's, in use

    removed, freed = trim_hub_cache(2 * mb, keep={"b" * 40}, cache_dir=cache)

    assert removed == ["org/old@" + "a" * 40, "org/middle@" + "c" * 40] and freed >= 2 * mb
    left = sorted(p.name for p in cache.iterdir())
    assert left == ["models--org--kept", "models--org--recent"]
    assert trim_hub_cache(0, cache_dir=cache, keep_repos={"org/kept"}) == ([], 0)  # its ref not resolved yet
    removed, _ = trim_hub_cache(0, cache_dir=cache)  # no budget at all: still nothing used in the last hour
    assert removed == ["org/kept@" + "b" * 40] and [p.name for p in cache.iterdir()] == ["models--org--recent"]


def test_a_write_that_fills_the_disk_leaves_no_temporary_file(small_filesystem):
    """ENOSPC half way through a cache write: the error comes out as it is, and neither the file
    nor its temporary is left taking the space."""
    root = small_filesystem("256k")
    with pytest.raises(OSError) as raised:
        write_atomic(root / "rope" / "table.npz", os.urandom(1 << 20))
    assert raised.value.errno == errno.ENOSPC
    assert list((root / "rope").iterdir()) == []
    write_atomic(root / "rope" / "table.npz", b"fits")  # the space is back
    assert [p.name for p in (root / "rope").iterdir()] == ["table.npz"]


def _hub_job(settings, model: str, worker: str, done: list[str]) -> str:
    """An export of hub revision ``model`` claimed by ``worker``, with the work directory the worker
    keeps for it (its record after ``done``, where a later attempt resumes), as workers/job.py writes it."""
    from services import lifecycle
    from services.catalog.database import session_scope
    from services.jobs import submit_export
    from workers.job import JobRecord, WorkerIdentity, _work_root, current_runtime

    from exporter.request import ExportRequest

    repo, _, commit = model.partition("@")
    with session_scope(settings.catalog_url) as session:
        export, _ = submit_export(session, settings, ExportRequest(model=model, dtype="fp32", ep="cpu"), force=True)
        export_id = export.id
        lifecycle.claim(session, export_id, worker, 100, "1.31.1", 60.0)
    work = _work_root(settings, WorkerIdentity(worker, 100)) / export_id
    work.mkdir(parents=True)
    source = {"path": str(settings.data_dir / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit),
              "kind": "hub", "repo_id": repo, "revision": commit}
    JobRecord(export_id, {"model": model, "dtype": "fp32", "ep": "cpu"}, commit, None, current_runtime(),
              done=done, source=source).save(work)
    return export_id


def test_a_revision_a_resumable_job_needs_survives_another_job_s_trim(tmp_path, monkeypatch):
    """HUB_CACHE_MAX_GB: a worker's trim deletes least recently used hub revisions, but never one a
    live job on this host still reads, however long ago its files were last touched: here a job
    whose worker died after its build (its next attempt resumes at validate, reading the checkpoint
    without downloading it again). A revision no live job needs is still trimmed, and so is one whose
    job has ended, its work directory not yet pruned."""
    from huggingface_hub import constants

    from services import lifecycle
    from services.catalog.database import session_scope, upgrade_schema
    from services.catalog.models import Export, ExportStatus
    from services.settings import Settings
    from workers.job import trim_caches

    cache = tmp_path / "data" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # the HF_HUB_CACHE variable, as read at start
    settings = Settings(data_dir=tmp_path / "data", hub_access=True, hub_cache_max_gb=0.001)
    upgrade_schema(settings.catalog_url)
    mb = 1 << 20
    resumed, free, ended = "a" * 40, "c" * 40, "e" * 40
    _hub_revision(cache, "org/resumed", resumed, mb, hours_ago=3)
    _hub_revision(cache, "org/free", free, mb, hours_ago=2)
    _hub_revision(cache, "org/ended", ended, mb, hours_ago=4)
    lost = _hub_job(settings, f"org/resumed@{resumed}", "w1", done=["resolve", "build"])
    with session_scope(settings.catalog_url) as session:  # its worker died: the sweeper will queue it again
        assert lifecycle.release_lost(session, lost, "w1", 100, "killed during validate")
    over = _hub_job(settings, f"org/ended@{ended}", "w2", done=["resolve"])
    with session_scope(settings.catalog_url) as session:
        session.get(Export, over).status = ExportStatus.FAILED

    trim_caches(settings, "d" * 40, "org/other")  # another job's resolve stage, on another worker

    assert sorted(p.name for p in cache.iterdir()) == ["models--org--resumed"]
    assert (cache / "models--org--resumed" / "snapshots" / resumed / "model.safetensors").is_file()
