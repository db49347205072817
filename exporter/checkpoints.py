"""Points inside long work where the caller may stop it: a download, the reference, the gates.

The exporter has no notion of jobs; a worker installs its own check (does this attempt still own
its job? was it cancelled?) for the duration of a stage, and every ``checkpoint()`` in the code
below calls it. Whatever the check raises ends the work there and reaches the caller unchanged:
code that turns failures into messages (a download's "cannot download ...") lets it through
(``is_stop``). Without an installed check a checkpoint costs one attribute read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_check: Callable[[], None] | None = None
_STOP_MARK = "_exportfarm_checkpoint_stop"


def checkpoint() -> None:
    """Call the installed check (from any thread); re-raises what it raises, marked as a stop."""
    check = _check
    if check is None:
        return
    try:
        check()
    except BaseException as err:
        try:
            setattr(err, _STOP_MARK, True)
        except AttributeError:
            pass  # an exception type without attributes: is_stop cannot tell it apart
        raise


def is_stop(err: BaseException | None) -> bool:
    """Whether ``err`` is (or was caused by) a stop a checkpoint raised, on any thread."""
    seen = 0
    while err is not None and seen < 16:
        if getattr(err, _STOP_MARK, False):
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


def hub_progress_class():
    """A huggingface_hub progress bar class whose every update is a checkpoint: a download of a
    many-gigabyte shard stops within one chunk of a cancel instead of at the end of the file. (A
    repository served through Xet reports progress from hf_xet's own threads, which may log an
    exception raised there and go on: such a download stops at the end of the file it is in.)"""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class CheckedProgress(hub_tqdm):
        def update(self, n=1):
            checkpoint()
            return super().update(n)

    return CheckedProgress
