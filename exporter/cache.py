"""Where computed artifacts are kept between runs: $EXPORTFARM_CACHE, default ~/.cache/exportfarm.

Each cache holds pure functions of their key (reference runs, rope tables), so a file is either
the right answer or not there; writers replace files atomically, readers recompute anything torn.
A read marks a file used (its mtime), and ``trim_lru`` keeps a cache within a size by deleting
what was used least recently; ``trim_hub_cache`` does the same for downloaded checkpoints. Each
trim is planned first (``plan_lru``, ``plan_hub_cache``): a worker counts the space a trim frees
as its own before it takes a job whose first stage trims.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

log = logging.getLogger(__name__)
# A file (or checkpoint) used this recently is never evicted: a job on the same host may be reading it.
# A file's times say little of a checkpoint's use (a resumed job reads one it downloaded hours ago):
# the revisions live jobs need are the caller's ``keep`` (workers.job.revisions_in_use).
IN_USE_S = 3600.0


def cache_root() -> Path:
    return Path(os.environ.get("EXPORTFARM_CACHE") or Path.home() / ".cache" / "exportfarm")


def rope_cache_default() -> Path:
    """Rope cos/sin tables by rope parameters and table length (exporter.graph.rope)."""
    return cache_root() / "rope"


def reference_cache_default() -> Path:
    """Reference runs by checkpoint, prompt and steps (exporter.validation.reference)."""
    return cache_root() / "references"


def cache_key(payload: dict) -> str:
    """A file name's key: everything that decides the cached bits, hashed."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``path`` (``data``: its bytes, or a function that writes them to the open file) whole or
    not at all: concurrent readers never see half a file, and a write that fails (a full disk)
    leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
        Path(name).replace(path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def write_npz(path: Path, **arrays: np.ndarray) -> None:
    """Keep ``arrays`` at ``path`` (atomically), numpy writing them to the file a buffer at a time:
    the whole file in memory first held the arrays' size again (1 GiB for the rope tables of 2^20
    positions of a 256-wide head)."""
    write_atomic(path, lambda file: np.savez(file, **arrays))


def read_npz(source: Path | bytes) -> dict[str, np.ndarray] | None:
    """The arrays of an .npz file (a path or its bytes), or None for a missing, torn or foreign one."""
    if isinstance(source, Path) and not source.is_file():
        return None
    try:
        with np.load(io.BytesIO(source) if isinstance(source, bytes) else source) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    if isinstance(source, Path):
        mark_used(source)
    return arrays


def mark_used(path: Path) -> None:
    """Record a cache hit (the file's mtime; atime is often not kept), so LRU eviction keeps it."""
    try:
        os.utime(path)
    except OSError:
        pass  # read-only or gone: eviction just sees it as older


@dataclasses.dataclass(frozen=True)
class Trim:
    """What keeping one cache within its size deletes now, found before anything is deleted: a worker
    counts the space as its own before a job (``freed_on``), and the job's trim then deletes it."""

    root: Path  # the cache's directory: the filesystem the space is freed on
    names: tuple[str, ...]  # files, or "repo@commit" revisions
    freed: int  # bytes
    delete: Callable[[], tuple[int, int]] = dataclasses.field(repr=False, compare=False)  # -> (deleted, bytes freed)

    def freed_on(self, directory: Path) -> int:
        """The bytes this trim frees on ``directory``'s filesystem (none where the cache is elsewhere)."""
        try:
            return self.freed if os.stat(self.root).st_dev == os.stat(directory).st_dev else 0
        except OSError:
            return 0


def plan_lru(root: Path, max_bytes: int, in_use_s: float = IN_USE_S) -> Trim:
    """The least recently used files under ``root`` to delete for it to hold at most ``max_bytes``,
    never one used in the last ``in_use_s``."""
    entries = []
    for path in Path(root).rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                stat = path.stat()
                entries.append((stat.st_mtime, stat.st_size, path))
        except OSError:
            continue  # removed meanwhile
    total = sum(size for _, size, _ in entries)
    cutoff = time.time() - in_use_s
    chosen = []
    for mtime, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes or mtime > cutoff:
            break
        chosen.append((path, size))
        total -= size

    def delete() -> tuple[int, int]:
        deleted = freed = 0
        for path, size in chosen:
            try:
                path.unlink()
            except OSError:
                continue
            deleted, freed = deleted + 1, freed + size
        return deleted, freed

    return Trim(Path(root), tuple(str(path) for path, _ in chosen), sum(size for _, size in chosen), delete)


def trim_lru(root: Path, max_bytes: int, in_use_s: float = IN_USE_S) -> tuple[int, int]:
    """Delete the least recently used files under ``root`` until it holds at most ``max_bytes``,
    never one used in the last ``in_use_s``; returns (files deleted, bytes freed)."""
    return plan_lru(root, max_bytes, in_use_s).delete()


def plan_hub_cache(max_bytes: int, keep: set[str] = frozenset(), in_use_s: float = IN_USE_S,
                   cache_dir: Path | None = None, keep_repos: set[str] = frozenset()) -> Trim:
    """The downloaded checkpoint revisions (huggingface_hub's cache) to delete, least recently used
    first, for the cache to hold at most ``max_bytes``: never a commit in ``keep``, a revision of a
    repository in ``keep_repos``, nor one used in the last ``in_use_s``. huggingface_hub scans, and
    counts and deletes (blobs shared with a kept revision stay)."""
    from huggingface_hub import constants, scan_cache_dir

    root = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        info = scan_cache_dir(root)
    except Exception as err:  # no cache yet, or one it cannot read: nothing to trim
        log.info("hub cache not trimmed: %s", err)
        return Trim(root, (), 0, lambda: (0, 0))
    total = info.size_on_disk
    cutoff = time.time() - in_use_s
    candidates = sorted(
        ((max(repo.last_accessed, revision.last_modified), repo, revision)
         for repo in info.repos if repo.repo_id not in keep_repos
         for revision in repo.revisions if revision.commit_hash not in keep),
        key=lambda c: c[0])
    chosen, names = [], []
    for used, repo, revision in candidates:
        if total <= max_bytes or used > cutoff:
            break
        chosen.append(revision.commit_hash)
        names.append(f"{repo.repo_id}@{revision.commit_hash}")
        total -= revision.size_on_disk
    if not chosen:
        return Trim(root, (), 0, lambda: (0, 0))
    strategy = info.delete_revisions(*chosen)

    def delete() -> tuple[int, int]:
        strategy.execute()
        return len(chosen), strategy.expected_freed_size

    return Trim(root, tuple(names), strategy.expected_freed_size, delete)


def trim_hub_cache(max_bytes: int, keep: set[str] = frozenset(), in_use_s: float = IN_USE_S,
                   cache_dir: Path | None = None, keep_repos: set[str] = frozenset()) -> tuple[list[str], int]:
    """Delete what ``plan_hub_cache`` chooses; returns ("repo@commit" deleted, bytes freed)."""
    trim = plan_hub_cache(max_bytes, keep, in_use_s, cache_dir, keep_repos)
    return list(trim.names), trim.delete()[1]
