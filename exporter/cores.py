"""The host's cores: how many this process may use, and work spread over them in order.

A worker pinned to some of a host's cores (a container's cpuset, ``taskset``, one worker per GPU)
sees all of them in ``os.cpu_count()`` but runs on its affinity mask alone; threads beyond it only
take turns. The exporter's block-wise work (quantizing a weight, checking one against its source)
is numpy and onnxruntime on independent blocks, which release the GIL for most of their time, so
threads of one process are enough to use those cores.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def in_order(function: Callable[[T], R], items: Iterable[T], workers: int,
             name: str = "exporter") -> Iterator[R]:
    """``function(item)`` for every item, yielded in the items' order, computed ``workers`` at a
    time on threads (on the caller's thread where ``workers`` is 1). At most ``workers`` results
    are computed ahead of the one the caller takes, so what is in flight stays bounded however
    many items there are; items are drawn from ``items`` only as they are submitted. Closing the
    generator early, or an error in one item, cancels the items not started and waits for the
    ones running."""
    if workers <= 1:
        for item in items:
            yield function(item)
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    try:
        source = iter(items)
        for item in source:
            pending.append(pool.submit(function, item))
            if len(pending) >= workers:
                break
        while pending:
            result = pending.popleft().result()
            for item in source:  # one in, one out: the window stays full until the items run out
                pending.append(pool.submit(function, item))
                break
            yield result
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
