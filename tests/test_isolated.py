"""Native work in a child process (exporter/runtime/isolated.py): real processes, real signals.

A crash inside native code (here a read of address 0 through ctypes, or abort(): what a kernel bug
does) must end the work with a message that names the signal and the step, and leave the caller
running; a kill from outside is told apart from a crash; the caller's stop kills the child; a child
whose caller dies goes too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from exporter.errors import ExportError
from exporter.runtime import isolated
from exporter.runtime.isolated import NativeCrash, ProcessLost, run_isolated


class Recorder:
    def __init__(self):
        self.calls = []

    def stage(self, name):
        self.calls.append(("stage", name))

    def layer(self, index, total):
        self.calls.append(("layer", index, total))

    def bytes_written(self, count, total):
        self.calls.append(("bytes", count, total))


def add(a, b, progress=None):
    isolated.phase("adding")
    if progress is not None:
        progress.stage("validate")
        progress.layer(1, 2)
    return {"sum": a + b, "pid": os.getpid()}


def refuse():
    raise ExportError("that request cannot be served: change X")


def segfault_in_native_code():
    isolated.phase("reading bf16 logits back")
    ctypes.string_at(0)


def abort_in_native_code():
    isolated.phase("replaying a captured graph")
    os.abort()


def killed_from_outside():
    isolated.phase("allocating")
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_and_write(path, seconds):
    from exporter import checkpoints

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        checkpoints.checkpoint()
        time.sleep(0.05)
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def pass_checkpoints(path, count):
    from exporter import checkpoints

    with open(path, "w") as f:
        for _ in range(count):
            checkpoints.checkpoint()
            f.write(f"{time.monotonic()}\n")
            f.flush()
            time.sleep(0.05)


def test_the_result_progress_and_errors_come_back_as_if_run_here():
    progress = Recorder()
    result = run_isolated(add, 2, 3, what="a sum", progress=progress)
    assert result["sum"] == 5 and result["pid"] != os.getpid()  # it ran elsewhere
    assert progress.calls[:2] == [("stage", "validate"), ("layer", 1, 2)]
    with pytest.raises(ExportError, match="change X"):
        run_isolated(refuse, what="a refusal")


@pytest.mark.parametrize("target, signal_name, step", [
    (segfault_in_native_code, "SIGSEGV", "reading bf16 logits back"),
    (abort_in_native_code, "SIGABRT", "replaying a captured graph"),
])
def test_a_native_crash_names_the_signal_the_step_and_the_frame_and_the_caller_lives_on(target, signal_name, step):
    with pytest.raises(NativeCrash) as caught:
        run_isolated(target, what="the benchmark of an int4 export", crash_advice="try --no-cuda-graph")
    err = caught.value
    assert err.signal_name == signal_name and err.phase == step
    message = str(err)
    assert f"died of {signal_name}" in message and f"while {step}" in message and "try --no-cuda-graph" in message
    assert target.__name__ in err.frames  # the Python frame the native code was called from
    assert isinstance(err, ExportError)  # a failure with a reason, not a worker lost
    assert run_isolated(add, 1, 1, what="the next job")["sum"] == 2  # the caller (a worker) goes on


def test_a_kill_from_outside_is_a_lost_process_not_a_crash():
    with pytest.raises(ProcessLost, match="SIGKILL.*while allocating"):
        run_isolated(killed_from_outside, what="validation")


def test_the_callers_stop_kills_the_child_at_once(tmp_path):
    marker = tmp_path / "written"
    started = time.monotonic()

    class Cancelled(Exception):
        pass

    def poll():
        if time.monotonic() - started > 0.5:
            raise Cancelled()

    with pytest.raises(Cancelled):
        run_isolated(sleep_and_write, str(marker), 3.0, what="a long stage", poll=poll)
    time.sleep(3.5)
    assert not marker.exists()  # killed, it never finished its work


def test_a_child_that_does_not_hear_in_time_that_it_may_go_on_waits_at_its_checkpoints(tmp_path):
    """The caller's promise lapses (a worker renewing its lease late, or waiting for its catalog): the
    child holds at its next checkpoint until the caller confirms again, then goes on, as the worker's
    own check waits rather than write on a lease it cannot confirm."""
    times = tmp_path / "times"
    start = time.monotonic()
    quiet_until = start + 2.0  # the caller says nothing new for 2 s, then confirms again

    def owned_until():
        now = time.monotonic()
        return start + 0.5 if now < quiet_until else now + 60

    run_isolated(pass_checkpoints, str(times), 20, what="a long stage", owned_until=owned_until)
    passed = [float(t) for t in times.read_text().split()]
    assert len(passed) == 20  # it went on to the end once confirmed
    gaps = [b - a for a, b in zip(passed, passed[1:])]
    assert max(gaps) >= 1.0  # and held, unconfirmed, at a checkpoint in between
    assert not [t for t in passed if start + 0.6 < t < quiet_until - 0.1]  # no checkpoint passed while unconfirmed


def test_a_child_dies_with_its_caller(tmp_path):
    """The caller SIGKILLed (the OOM killer taking a worker's pool process): its stage process goes too,
    instead of writing on for a job another attempt now owns."""
    marker, pidfile = tmp_path / "written", tmp_path / "caller"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        from exporter.runtime.isolated import run_isolated
        import test_isolated
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        run_isolated(test_isolated.sleep_and_write, {str(marker)!r}, 4.0, what="a long stage")
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], cwd=os.path.dirname(__file__))
    try:
        for _ in range(200):
            children = _descendants(caller.pid)
            if len(children) >= 2 and pidfile.exists():  # the forkserver and the stage process
                break
            time.sleep(0.05)
        time.sleep(0.3)
        children = _descendants(caller.pid)
        assert children
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 30  # each notices on its own pipe (a loaded machine is slow to say)
        while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
        time.sleep(max(0.0, 4.5 - (time.monotonic() - deadline + 30)))  # past when its work would have ended
        assert not marker.exists()
    finally:
        if caller.poll() is None:
            caller.kill()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else []:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(p) for p in f.read().split()]
            except OSError:
                kids = []
            found += kids
            todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def crash_while_reading_logits(export_dir, ep):
    """A rehearsal runner that crashes as onnxruntime-gpu 1.31.1 did under a bf16 bench."""
    isolated.phase("reading bf16 logits back to the host (a one-node Cast session)")
    ctypes.string_at(0)


@pytest.fixture(scope="module")
def gqa_export(checkpoint, tmp_path_factory):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    out = tmp_path_factory.mktemp("rehearsal") / "export"
    export_model(ExportRequest(model=str(checkpoint("qwen2")), dtype="fp16", ep="cpu", variant="gqa"), out,
                 validate=False)
    return out


def _rehearse(export_dir, **kw):
    import json

    from exporter.runtime.session import read_metadata
    from exporter.validation.gates.rehearsal import rehearsal_gate

    meta = read_metadata(export_dir / "model.onnx")
    return rehearsal_gate(json.loads((export_dir / "manifest.json").read_text()), meta["config"], "fp16", "cpu", **kw)


def test_the_decode_rehearsal_fails_its_gate_naming_a_crash_and_passes_a_sound_runtime(gqa_export):
    """The rehearsal of a tiny twin of the export (validation runs it on CUDA, where bench captures
    graphs; here on the CPU, where the driving path is the same without capture)."""
    crashed = _rehearse(gqa_export, runner=crash_while_reading_logits)
    assert crashed.status == "fail" and crashed.measured == "crashed (SIGSEGV)"
    assert "while reading bf16 logits back" in crashed.message and "would crash the same way" in crashed.message
    sound = _rehearse(gqa_export)
    assert sound.status == "pass" and sound.measured == 0.0 and sound.details["runs"] == 4, sound
