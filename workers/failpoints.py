"""Fault-injection points, so a test or a benchmark can kill or stop a real worker at a known moment.

With ``EXPORTFARM_FAILPOINTS`` naming a JSON file, a worker reaching a point reads it:
``{"<export id>": {"point": "validate", "attempt": 1, "seconds": 3600}}`` ("*" for any export, and
``"attempt": null`` for every attempt) holds that export's job there for that long, while its lease
is still renewed, as a slow stage would. The file is read at every point, so a running worker picks
up changes. Points: the stages as the catalog names them (``resolve``, ``build``, ``fold``,
``package``, ``validate``, ``bench``, ``diff``, ``publish``), ``upload`` (publishing: the weights are
in the store, the manifest is not) and ``published`` (the manifest is in the store, the catalog does
not know yet). Without the variable every point is a no-op.

A rule with ``"crash": "SIGSEGV"`` (or ``"SIGABRT"``) instead crashes the process that runs the stage
inside native code at that point (``crash``; the validate and bench stages call it in their stage
process): what a kernel bug does, for the tests and benchmarks of crash containment.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)
POINTS = ("resolve", "build", "fold", "package", "validate", "bench", "diff", "layout", "publish", "upload", "published")


def _rule(point: str, export_id: str, attempt: int) -> dict | None:
    path = os.environ.get("EXPORTFARM_FAILPOINTS")
    if not path:
        return None
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return None
    rule = table.get(export_id) or table.get("*")
    if not rule or rule.get("point") != point or rule.get("attempt", 1) not in (None, attempt):
        return None
    return rule


def crash(point: str, export_id: str, attempt: int) -> None:
    """Crash this process inside native code here if the failpoint file says so: a read of address 0
    through ctypes (SIGSEGV), or abort() (SIGABRT), as a kernel's bug would."""
    rule = _rule(point, export_id, attempt)
    if not rule or not rule.get("crash"):
        return
    log.warning("failpoint: export %s crashes with %s at %s (attempt %d)", export_id, rule["crash"], point, attempt)
    from exporter.runtime.isolated import phase

    phase(f"the {point} failpoint's planted crash")
    if rule["crash"] == "SIGABRT":
        os.abort()
    import ctypes

    ctypes.string_at(0)  # a native read of address 0: SIGSEGV


def pause(point: str, export_id: str, attempt: int, check=None) -> None:
    """Hold here if the failpoint file says so; ``check()`` runs as often as a slow stage checks its
    lease (a cancel or a lost lease ends the pause by raising, as it would end a long benchmark)."""
    rule = _rule(point, export_id, attempt)
    if not rule or rule.get("crash"):
        return
    seconds = float(rule.get("seconds", 3600))
    log.warning("failpoint: export %s paused %.0f s at %s (attempt %d)", export_id, seconds, point, attempt)
    # Deadline-based: a process stopped (SIGSTOP) through the pause carries on right after it.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check is not None:
            check()
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
