"""Points inside long work where the caller may stop it: a download, the reference, the gates.

The exporter has no notion of jobs; a worker installs its own check (does this attempt still own
its job? was it cancelled?) for the duration of a stage, and every ``checkpoint()`` in the code
below calls it. Whatever the check raises ends the work there and reaches the caller unchanged:
code that turns failures into messages (a download's "cannot download ...") lets it through
(``is_stop``). Without an installed check a checkpoint costs one attribute read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_check: Callable[[], None] | None = None
_raised: dict[int, BaseException] = {}  # by thread: what the check raised last
_lock = threading.Lock()


def checkpoint() -> None:
    """Call the installed check (from any thread); re-raises what it raises."""
    check = _check
    if check is None:
        return
    try:
        check()
    except BaseException as err:
        with _lock:
            _raised[threading.get_ident()] = err
        raise


def is_stop(err: BaseException) -> bool:
    """Whether ``err`` is (or was caused by) a stop a checkpoint raised, on any thread."""
    with _lock:
        stops = {id(e) for e in _raised.values()}
    seen = 0
    while err is not None and seen < 16:
        if id(err) in stops:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


@contextlib.contextmanager
def installed(check: Callable[[], None]) -> Iterator[None]:
    """Run the block with ``check`` called at every checkpoint (one worker job at a time)."""
    global _check
    previous, _check = _check, check
    try:
        yield
    finally:
        _check = previous
        with _lock:
            _raised.clear()


def hub_progress_class():
    """A huggingface_hub progress bar class whose every update is a checkpoint: a download of a
    many-gigabyte shard stops within one chunk of a cancel instead of at the end of the file."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class CheckedProgress(hub_tqdm):
        def update(self, n=1):
            checkpoint()
            return super().update(n)

    return CheckedProgress
