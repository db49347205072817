"""The host's cores: a process pinned to some of them counts those; work over them comes back in order."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from exporter.cores import in_order, usable_cores


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_one_core_uses_one():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from exporter.cores import usable_cores; from exporter.validation.gates.weights import compare_threads; " \
           "print(usable_cores(), compare_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1"]
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_in_order_gives_each_result_in_the_items_order_and_draws_no_more_than_it_runs():
    drawn, done = [], []

    def items():
        for i in range(20):
            drawn.append(i)
            yield i

    def slow_first(i):
        time.sleep(0.05 if i % 7 == 0 else 0.001)  # later items finish first
        done.append(threading.current_thread().name)
        return i * i

    results = in_order(slow_first, items(), workers=3, name="square")
    assert next(results) == 0
    assert len(drawn) <= 4  # three at work and the one taken: never the whole list ahead
    assert list(results) == [i * i for i in range(1, 20)]
    assert all(name.startswith("square") for name in done)
    assert list(in_order(slow_first, range(3), workers=1)) == [0, 1, 4]  # one worker: the caller's thread


def test_an_error_in_one_item_reaches_the_caller_and_stops_the_rest():
    started = []

    def fail_at_two(i):
        started.append(i)
        if i == 2:
            raise ValueError("item 2")
        time.sleep(0.01)
        return i

    with pytest.raises(ValueError, match="item 2"):
        list(in_order(fail_at_two, range(100), workers=2))
    assert len(started) < 10
