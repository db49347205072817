"""Embedded mode's farm beside ``exportfarm serve``: one supervised worker, and the beat loop.

With no external servers (SQLite catalog, filesystem queue, local store) ``serve`` holds a lock on
DATA_DIR, so exactly one serve, and so one embedded worker, uses it at a time. That lock is what
lets it settle at once, without waiting for leases, the jobs the embedded worker held when the last
serve ended however it ended. The worker runs in its own process group, is restarted when it dies
(its jobs are settled first), dies with serve (PR_SET_PDEATHSIG), and is stopped within
SHUTDOWN_GRACE_S when serve stops, its job handed back to the queue to resume on the next start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from exporter.errors import ExportError
from exporter.locks import Held, hold
from services.beat import Beat
from services.queue import CeleryQueue
from services.settings import Settings

log = logging.getLogger(__name__)
WORKER_NAME = "embedded"


def worker_name(settings: Settings) -> str:
    """The embedded worker's name: its host and its DATA_DIR, which one serve holds at a time. Two
    serves sharing a DATABASE_URL settle only their own worker's jobs at start (one name for every
    embedded worker once released another serve's live job)."""
    import hashlib
    import socket

    where = hashlib.sha256(str(settings.data_dir.expanduser().resolve()).encode()).hexdigest()[:8]
    return f"{WORKER_NAME}-{socket.gethostname()}-{where}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class EmbeddedFarm:
    def __init__(self, settings: Settings, *, worker: bool = True, queues: str = "cpu,gpu"):
        self.settings, self.with_worker, self.queues = settings, worker, queues
        self.worker_name = worker_name(settings)
        self.beat = Beat(settings, CeleryQueue(settings))
        self._stopping = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._proc_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._lock_file = None

    # --- the data directory lock ---

    def _lock_data_dir(self) -> None:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock_file = hold(self.settings.data_dir / "serve.lock", str(os.getpid()))
        except Held as held:
            raise ExportError(
                f"another exportfarm serve (pid {held.holder}) is using {self.settings.data_dir}: stop it, or give "
                "this one its own DATA_DIR") from None

    # --- life cycle ---

    def start(self) -> None:
        self._lock_data_dir()
        settled = self.beat.sweeper.recover_worker(
            self.worker_name, None, "the embedded worker stopped when the previous exportfarm serve did")
        if settled.changed():
            log.info("embedded: settled what the previous serve's worker held: %s",
                     {k: v for k, v in settled.to_dict().items() if v})
        self._spawn_thread("beat", lambda: self.beat.run(self._stopping))
        if self.with_worker:
            self._spawn_thread("worker-supervisor", self._supervise)

    def _spawn_thread(self, name: str, target) -> None:
        thread = threading.Thread(target=target, daemon=True, name=name)
        thread.start()
        self._threads.append(thread)

    def _start_worker(self) -> subprocess.Popen:
        env = {**os.environ, "EXPORTFARM_WORKER_NAME": self.worker_name, "EXPORTFARM_PARENT_PID": str(os.getpid())}
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "worker", "--queues", self.queues, "--name", self.worker_name],
            env=env, start_new_session=True,  # its own process group: a signal reaches its pool process too
        )

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            with self._proc_lock:
                if self._stopping.is_set():
                    return
                self._proc = proc = self._start_worker()
            log.info("embedded: worker started (pid %d)", proc.pid)
            started = time.monotonic()
            returncode = proc.wait()
            if self._stopping.is_set():
                return
            how = describe_exit(returncode)
            log.warning("embedded: worker (pid %d) %s; settling its job and restarting it", proc.pid, how)
            _kill_group(proc.pid)  # a pool process that outlived its parent
            try:
                self.beat.sweeper.recover_worker(self.worker_name, proc.pid, f"the embedded worker process was {how}"
                                                 if returncode < 0 else f"the embedded worker process ended ({how})")
            except Exception:
                log.warning("embedded: could not settle the worker's job now; its lease will expire", exc_info=True)
            # A worker that dies right after starting (bad settings, say) is restarted ever more slowly.
            backoff = 1.0 if time.monotonic() - started > 10 else min(backoff * 2, 30.0)
            self._stopping.wait(backoff)

    def stop(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL after SHUTDOWN_GRACE_S), hand its job back, release DATA_DIR."""
        if self._lock_file is None:
            return  # not started, or stopped already
        self._stopping.set()
        with self._proc_lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.settings.shutdown_grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
        if proc is not None:
            _kill_group(proc.pid)
            try:
                returned = self.beat.sweeper.hand_back(self.worker_name, proc.pid, "exportfarm serve stopped")
                if returned:
                    log.info("embedded: handed back %s; it resumes when serve starts again", ", ".join(returned))
            except Exception:
                log.warning("embedded: could not hand the worker's job back; the next serve settles it", exc_info=True)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> EmbeddedFarm:
        self.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int) -> None:
    _signal_group(pid, signal.SIGKILL)
