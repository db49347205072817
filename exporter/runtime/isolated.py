"""Native work in a child process: a crash in a kernel ends the work with a clear error, not the caller.

onnxruntime, onnxruntime-genai and torch run native kernels; a bug in one of them (a bad pointer under
CUDA graph replay, an unsupported dtype path) kills the process with a signal, and a farm worker whose
pool process dies loses the job and is handed it again, into the same crash. ``run_isolated`` runs a
stage function in a child process instead and watches it:

- what the child reports goes to the caller as it happens: progress (``stage`` waits for the caller,
  which may stop the work there) and ``phase`` (what it is doing now, e.g. "decode ctx 128: CUDA graph
  replay"), so a crash can be named by the step it happened in;
- the child's checkpoints (``exporter.checkpoints``) hold it once the caller has not confirmed, within
  the time it last promised (``owned_until``), that the work may go on (a farm worker's lease), until
  it does;
- the caller's ``poll`` runs while the child works; what it raises (a cancel, a lost lease, a soft time
  limit) kills the child and is raised again;
- the child's result, or the exception it raised, comes back as if the function had run here;
- a child that dies of a signal raises ``NativeCrash``: the signal, the step, the Python frames the
  crash happened under (``faulthandler``), and what the caller says about the work and what to do;
  one killed by SIGKILL (the kernel's OOM killer, an operator) raises ``ProcessLost`` instead: that is
  not the work's fault, and a farm retries it;
- the child dies with its caller: it watches its end of the pipe and exits when the caller is gone.

Children are forked from one forkserver per calling process, which imports ``PRELOAD`` once, so a
child starts without paying torch's and onnxruntime's imports again (a worker runs one per stage).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import spawn
from pathlib import Path

from exporter import checkpoints
from exporter.errors import ExportError

log = logging.getLogger(__name__)

# What a stage child needs, imported once into the forkserver its children are forked from.
PRELOAD = ["numpy", "onnx", "onnxruntime", "exporter.runtime.bench", "exporter.validation.validate"]
POLL_S = 0.2
# Signals a native bug raises in the process itself; anything else (SIGKILL, SIGTERM) came from outside.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)


class NativeCrash(ExportError):
    """The child process died of a signal it raised itself (a native kernel's bug): the work cannot
    succeed as it is, and running it again would crash the same way."""

    def __init__(self, message: str, signal_name: str = "", phase: str | None = None, frames: str = ""):
        super().__init__(message)
        self.signal_name, self.phase, self.frames = signal_name, phase, frames


class ProcessLost(Exception):
    """The child process was killed from outside (SIGKILL: out of memory, an operator) or vanished."""


@dataclasses.dataclass
class _Channel:
    """The child's end: messages to the caller, and what the caller last said."""

    conn: object
    owned_until: float | None = None
    acked: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


_channel: _Channel | None = None


def phase(text: str) -> None:
    """In a child of ``run_isolated``: what the work is doing now, named if the process dies in it.
    Elsewhere a no-op."""
    channel = _channel
    if channel is not None:
        channel.send(("phase", text))


def in_child() -> bool:
    return _channel is not None


class _ChildProgress:
    """The Progress a child's stage function reports to: forwarded to the caller's. ``stage`` waits
    until the caller has recorded it (the caller may stop the work there); the rest is sent as it
    comes."""

    def __init__(self, channel: _Channel):
        self.channel = channel

    def stage(self, name: str) -> None:
        self.channel.acked.clear()
        self.channel.send(("progress", "stage", (name,)))
        while not self.channel.acked.wait(POLL_S):
            _check(self.channel)

    def layer(self, index: int, total: int) -> None:
        self.channel.send(("progress", "layer", (index, total)))

    def bytes_written(self, count: int, total: int) -> None:
        self.channel.send(("progress", "bytes_written", (count, total)))


def _check(channel: _Channel) -> None:
    """A checkpoint in the child: go on while the caller's last word allows it; past that, wait for
    its next (a farm worker renewing its lease late, or waiting for its catalog, as its own check
    waits) rather than go on unconfirmed. The caller kills the child when the work must end, and a
    child whose caller died exits (``_listen``)."""
    while channel.owned_until is not None and time.monotonic() > channel.owned_until:
        time.sleep(POLL_S / 4)


def _listen(channel: _Channel) -> None:
    """The child's thread on the pipe: the caller's confirmations and acks; gone caller, gone child."""
    while True:
        try:
            message = channel.conn.recv()
        except (EOFError, OSError):
            os._exit(70)  # the caller died (SIGKILL, OOM): nothing of this work is wanted any more
        kind = message[0]
        if kind == "owned_until":
            channel.owned_until = message[1]
        elif kind == "ack":
            channel.acked.set()


def _child_main(conn, crash_log: str, owned_until: float | None, target: Callable, args: tuple, kwargs: dict,
                progress_arg: str | None, environ: dict) -> None:
    global _channel
    # The caller's environment now, not the forkserver's from when it started (a bound GPU, failpoints).
    os.environ.clear()
    os.environ.update(environ)
    log_file = open(crash_log, "w")  # noqa: SIM115 - open for the life of the process, for faulthandler
    faulthandler.enable(log_file, all_threads=True)
    channel = _Channel(conn, owned_until)
    _channel = channel
    threading.Thread(target=_listen, args=(channel,), daemon=True, name="isolated-listen").start()
    if progress_arg is not None:
        kwargs = {**kwargs, progress_arg: _ChildProgress(channel)}
    try:
        with checkpoints.installed(lambda: _check(channel)):
            result = target(*args, **kwargs)
        channel.send(("result", result))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the caller, as raised
        channel.send(("error", _picklable(err)))
    finally:
        faulthandler.disable()


def _picklable(err: BaseException):
    """``err`` if it survives pickling whole, else a stand-in of its type's kind with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = f"{type(err).__name__}: {err}"
        if isinstance(err, ExportError):
            return ExportError(str(err))
        return RuntimeError(f"{text}\n{''.join(traceback.format_exception(err))}")


_context = None
_context_lock = threading.Lock()


def preload(modules: list[str]) -> None:
    """Also import ``modules`` into the forkserver, if it has not started yet (a farm worker adds
    torch and transformers, which its validation children import anyway)."""
    with _context_lock:
        for module in modules:
            if module not in PRELOAD:
                PRELOAD.append(module)
        if _context is not None:
            _context.set_forkserver_preload(PRELOAD)  # effective only before the server starts


def _mp_context():
    """One forkserver per process (started at the first call), with PRELOAD imported in it."""
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


_start_lock = threading.Lock()


def _start(process) -> None:
    """Start ``process`` also from a daemonic process: a Celery pool process is one, and
    multiprocessing refuses it children because nothing would end them with it. A stage process
    ends itself when its caller is gone (``_listen``), so the refusal does not apply."""
    with _start_lock:
        _start_locked(process)


def _start_locked(process) -> None:
    me = multiprocessing.current_process()
    config = dict(me._config)
    me._config["daemon"] = False
    # A Celery pool process's key is billiard's, which multiprocessing will not pass on: the same
    # bytes as multiprocessing's own type, for the start.
    key = multiprocessing.process.AuthenticationString(bytes(me._config["authkey"]))
    me._config["authkey"] = process._config["authkey"] = key
    prepare = spawn.get_preparation_data
    # Targets are importable functions: the child needs none of the caller's __main__, which
    # multiprocessing would otherwise run again there (a script without a __main__ guard, whole).
    spawn.get_preparation_data = lambda name: {
        k: v for k, v in prepare(name).items() if k not in ("init_main_from_path", "init_main_from_name")}
    try:
        process.start()
    finally:
        spawn.get_preparation_data = prepare
        me._config.clear()
        me._config.update(config)


def signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def crash_frames(text: str, limit: int = 3) -> str:
    """The innermost Python frames of the thread that crashed, from faulthandler's dump (its
    "Current thread" block), leaving out this module's and multiprocessing's own."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return ""
    frames = []
    for line in lines[start + 1:]:
        if not line.startswith("  File"):
            break
        if "/multiprocessing/" not in line and f'"{__file__}"' not in line and '"<string>"' not in line:
            frames.append(line.strip())
    return " <- ".join(frames[:limit])


def run_isolated(target: Callable, *args, what: str, progress=None, poll: Callable[[], None] | None = None,
                 owned_until: Callable[[], float] | None = None, crash_advice: str = "", **kwargs):
    """``target(*args, **kwargs)`` in a child process (``target`` importable by name); returns what
    it returns, raises what it raises.

    ``what`` names the work for messages ("bench of int4 gqa on cuda"). ``progress``: given, the
    child's ``progress`` keyword is a stand-in forwarding to it. ``poll`` runs in this process while
    the child works (raise to stop it); ``owned_until()`` is the monotonic time until which the child
    may go on without hearing from here again (without it, it goes on while this process lives).
    ``crash_advice`` is added to a ``NativeCrash``'s message: what the user can do.
    """
    context = _mp_context()
    parent_end, child_end = context.Pipe(duplex=True)
    crash_log = tempfile.NamedTemporaryFile(prefix="exportfarm-crash-", suffix=".log", delete=False)
    crash_log.close()
    process = context.Process(
        target=_child_main, name=f"exportfarm-{what.split()[0]}",
        args=(child_end, crash_log.name, owned_until() if owned_until else None, target, args, kwargs,
              "progress" if progress is not None else None, dict(os.environ)), daemon=True)
    _start(process)
    child_end.close()
    last_phase: str | None = None
    outcome: tuple | None = None
    try:
        polled = 0.0
        while outcome is None:
            if time.monotonic() - polled >= POLL_S:  # whatever the child sends, at this pace at least
                if poll is not None:
                    poll()  # raises when the work must stop
                if owned_until is not None:
                    parent_end.send(("owned_until", owned_until()))
                polled = time.monotonic()
            if parent_end.poll(POLL_S):
                try:
                    message = parent_end.recv()
                except (EOFError, OSError):
                    break  # the child is gone; its exit code says how
                kind = message[0]
                if kind == "phase":
                    last_phase = message[1]
                elif kind == "progress":
                    getattr(progress, message[1])(*message[2])
                    if message[1] == "stage":
                        parent_end.send(("ack",))
                else:
                    outcome = message
            elif not process.is_alive() and not parent_end.poll(0):
                break  # ended, and everything it sent was read
        process.join()
    except BaseException:
        # A stop raised here (a cancel, a lost lease, a time limit): the child has nothing more to do.
        if process.is_alive():
            process.kill()
        process.join(5)
        _discard(crash_log.name)
        raise
    finally:
        parent_end.close()
    if outcome is not None:
        _discard(crash_log.name)
        if outcome[0] == "result":
            return outcome[1]
        raise outcome[1]
    code = process.exitcode
    dump = _read(crash_log.name)
    _discard(crash_log.name)
    where = f" while {last_phase}" if last_phase else ""
    if code is not None and code < 0 and -code in CRASH_SIGNALS:
        name = signal_name(code)
        frames = crash_frames(dump)
        if dump:
            log.error("%s died of %s%s; faulthandler:\n%s", what, name, where, dump)
        message = (f"{what} crashed: its process died of {name} inside native code{where}"
                   + (f" (Python frames, innermost first: {frames})" if frames else "")
                   + ". This is a bug in the runtime's kernels, not in the request, and running it again crashes "
                     "the same way" + (f"; {crash_advice}" if crash_advice else ""))
        raise NativeCrash(message, name, last_phase, frames)
    how = signal_name(code) if code is not None and code < 0 else f"exit status {code}"
    raise ProcessLost(f"{what}: its process was lost ({how}{where}; killed for memory?)")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = ["run_isolated", "phase", "in_child", "NativeCrash", "ProcessLost", "crash_frames"]
