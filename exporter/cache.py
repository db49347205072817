"""Where computed artifacts are kept between runs: $EXPORTFARM_CACHE, default ~/.cache/exportfarm.

Each cache holds pure functions of their key (reference runs, rope tables), so a file is either
the right answer or not there; writers replace files atomically, readers recompute anything torn.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("EXPORTFARM_CACHE") or Path.home() / ".cache" / "exportfarm")


def rope_cache_default() -> Path:
    """Rope cos/sin tables by rope parameters and table length (exporter.graph.rope)."""
    return cache_root() / "rope"
