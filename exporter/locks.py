"""An exclusive hold on a lock file, naming its holder: one process per data directory, per GPU."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class Held(Exception):
    """Another process holds the lock; ``holder`` is what it wrote there."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def hold(path: Path, owner: str):
    """Take ``path``'s exclusive flock for this process's life and write ``owner`` into it; returns the
    open file (closing it releases the lock, and so does the process's end, however it ends).
    Raises ``Held`` with what the holder wrote when another process has it."""
    # Never through a link: a lock file planted as a symlink would be truncated in its target's place.
    handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise Held(holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(owner)
    handle.flush()
    return handle
