"""Where computed artifacts are kept between runs: $EXPORTFARM_CACHE, default ~/.cache/exportfarm.

Each cache holds pure functions of their key (reference runs, rope tables), so a file is either
the right answer or not there; writers replace files atomically, readers recompute anything torn.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np


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


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: concurrent readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    Path(name).replace(path)


def write_npz(path: Path, **arrays: np.ndarray) -> bytes:
    """Keep ``arrays`` at ``path`` (atomically); returns the file's bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue())
    return buffer.getvalue()


def read_npz(source: Path | bytes) -> dict[str, np.ndarray] | None:
    """The arrays of an .npz file (a path or its bytes), or None for a missing, torn or foreign one."""
    if isinstance(source, Path) and not source.is_file():
        return None
    try:
        with np.load(io.BytesIO(source) if isinstance(source, bytes) else source) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
