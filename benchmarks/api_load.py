"""API load and queue latency of the farm on this machine: uvicorn + PostgreSQL + Redis, no mocks.

What is measured
----------------
* Load: ``--clients`` (50) concurrent clients, each in a closed loop for ``--duration`` (30 s) with no
  think time (``--think-ms`` adds a random pause of that mean between a client's requests), each on
  its own keep-alive connection, cycling through three kinds of request:

  - ``post``: ``POST /exports`` with one of three fixed bodies. The first of each body creates the
    export (202); every later one is a duplicate answered with the existing export (200);
  - ``get``: ``GET /exports/{id}`` of an export a client has seen;
  - ``list``: ``GET /exports?limit=20``.

  Every request's latency (send to body read) and status are recorded; any non-2xx answer or
  exception is an error. No worker runs, so queued jobs stay queued: this is API + catalog + broker.
  Before the clock starts, rounds of concurrent requests of each kind (POSTs of a fourth body) warm
  every uvicorn worker until a round has no error; they are not counted, but their errors are
  reported (a fresh worker's first POSTs import transformers).
* Queue latency: one ``exportfarm worker`` (BENCH_CONTEXTS=[16], BENCH_STEPS=4) is started and waits,
  idle and registered. Then ``--queue-samples`` (10) times: POST a new export (``"force": true``),
  poll ``GET /exports/{id}`` every 10 ms until it leaves ``queued``, then wait for ``ready`` so the
  worker is idle again. Two figures per job: ``started_at - created_at`` of the catalog row, and the
  wall time from sending the POST to the first GET that shows ``running``. The first job is the first
  the worker's pool child runs (it imports the job code then); it is reported on its own as well.
  Jobs left queued by the load phase are cancelled and their messages purged before the worker starts.

Each ``--uvicorn-workers`` count gets a fresh PostgreSQL database and a flushed Redis DB 12; one worker
runs ``exportfarm serve --no-worker``, more run ``uvicorn --workers N`` on :func:`served_app` (the same
``create_app``). The schema and the bootstrap token are created before the server starts, so several
uvicorn workers do not race to create them. The artifact store is a local directory (no S3). With
several uvicorn workers the kernel decides which worker accepts each client connection; how many each
got is recorded (keep-alive connections stay where they landed).

The machine has few cores and the load generator (one asyncio process with a minimal HTTP/1.1 client,
see :class:`Connection`) competes with uvicorn, PostgreSQL and Redis for them: the CPU seconds each
used (and those of unrelated processes) and the generator's event-loop lag are recorded next to the
latencies. Before each load phase the script waits (``--quiet-wait``) for the machine to be idle.
With a closed loop, mean latency = clients / throughput (Little's law).

Targets: load errors = 0 and p99 < 100 ms; POST to job start < 1 s.

With ``--profile`` the first configuration's load is run a second time (unmeasured) with py-spy
sampling the API process only while a thread holds the GIL: ``results.profile`` splits that CPU
time by where the innermost frame is (uvicorn, Starlette/FastAPI, pydantic, SQLAlchemy, psycopg,
thread hand-off, this project's code).

Usage::

    python benchmarks/api_load.py [--clients 50] [--duration 30] [--think-ms 0] [--uvicorn-workers 1,2]
                                  [--queue-samples 10] [--quiet-wait 300] [--profile]
                                  [--out benchmarks/results/api_load.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from scale import process_tree  # the script's own folder is on the path

REPO = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/12"
ADMIN_TOKEN = "api-load-admin-token-0123456789abcd"
WORKER_NAME = "bench-w1"
P99_TARGET_MS = 100.0
QUEUE_TARGET_S = 1.0
POLL_S = 0.01
PACKAGES = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "psycopg", "celery", "kombu", "redis", "httpx", "pydantic")
ARCHS = ("llama", "qwen2", "mistral")
KINDS = ("post", "get", "list")
LOAD_BODIES = (
    {"model": "tiny-llama", "dtype": "fp32", "ep": "cpu"},
    {"model": "tiny-qwen2", "dtype": "fp16", "ep": "cpu"},
    {"model": "tiny-mistral", "dtype": "fp32", "ep": "cpu", "variant": "gqa"},
)
POST_BODIES = tuple(json.dumps(body).encode() for body in LOAD_BODIES)
WARMUP_BODY = {"model": "tiny-llama", "dtype": "fp16", "ep": "cpu"}
QUEUE_BODY = {"model": "tiny-qwen2", "dtype": "fp32", "ep": "cpu", "force": True}
TERMINAL = ("ready", "failed", "cancelled", "quarantined")
PREPARE_CATALOG = """
import os
from services.auth import install_bootstrap
from services.catalog.database import session_scope, upgrade_schema

upgrade_schema(os.environ["DATABASE_URL"])
with session_scope(os.environ["DATABASE_URL"]) as session:
    install_bootstrap(session, os.environ["ADMIN_TOKEN"])
"""


def served_app():
    """uvicorn ``--factory`` target for several uvicorn workers: the farm's app from the environment."""
    from services.api.app import create_app

    return create_app()


# ---------------------------------------------------------------------------------------------- setup


def make_models(models_dir: Path) -> None:
    """Tiny random-weight checkpoints named ``tiny-<arch>`` (built in a subprocess: torch stays out of here)."""
    code = ("import sys; from exporter.tiny_checkpoint import make_tiny_checkpoint as m; "
            "[m(a, sys.argv[1] + '/tiny-' + a) for a in sys.argv[2:]]")
    subprocess.run([sys.executable, "-c", code, str(models_dir), *ARCHS], check=True, cwd=REPO)


@contextlib.contextmanager
def fresh_database():
    """An empty PostgreSQL database on the local server, dropped (with its connections) afterwards."""
    import psycopg

    name = f"exportfarm_api_load_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def farm_env(database_url: str, data_dir: Path, models_dir: Path) -> dict[str, str]:
    """The process environment of the API and the worker (no S3_*: the store is a local directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3_")}
    env.update(DATABASE_URL=database_url, REDIS_URL=REDIS_URL, DATA_DIR=str(data_dir), MODELS_DIR=str(models_dir),
               ADMIN_TOKEN=ADMIN_TOKEN, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               SIGNING_SECRET="api-load-signing-secret-0123456789abcdef")
    return env


def prepare_catalog(env: dict[str, str]) -> None:
    """Migrate the schema and store the bootstrap token once, before any uvicorn worker starts."""
    subprocess.run([sys.executable, "-c", PREPARE_CATALOG], check=True, cwd=REPO, env=env)


def redis_client():
    """A client of the benchmark's Redis database (the broker)."""
    import redis

    return redis.Redis.from_url(REDIS_URL)


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in its own process group (so stopping it takes its children too)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process group started by :func:`start_process`; SIGKILL it if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen, log_path: Path) -> None:
    """Poll ``predicate`` until true; fail with the log's tail if ``proc`` died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited {proc.returncode}\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not after {timeout} s\n{log_path.read_text()[-3000:]}")


def api_command(port: int, uvicorn_workers: int) -> list[str]:
    """``exportfarm serve`` for one uvicorn worker; ``uvicorn --workers N --factory`` for more."""
    if uvicorn_workers == 1:
        return [sys.executable, "-m", "services.cli", "serve", "--no-worker", "--host", "127.0.0.1", "--port", str(port)]
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(__file__).parent), "api_load:served_app", "--factory",
            "--workers", str(uvicorn_workers), "--host", "127.0.0.1", "--port", str(port),
            "--no-proxy-headers"]  # as serve runs it: the app's TRUSTED_PROXIES alone names the client


@dataclasses.dataclass
class Farm:
    """A running API: where it answers, its environment, its process and where its logs go."""

    base_url: str
    env: dict[str, str]
    api: subprocess.Popen
    api_command: list[str]
    logs: Path


@contextlib.contextmanager
def running_farm(work: Path, models_dir: Path, uvicorn_workers: int):
    """Fresh database, flushed Redis DB, the API up and healthy; everything stopped and dropped after."""
    work.mkdir(parents=True)
    with fresh_database() as database_url:
        redis_client().flushdb()
        env = farm_env(database_url, work / "data", models_dir)
        prepare_catalog(env)
        port = free_port()
        command = api_command(port, uvicorn_workers)
        log_path = work / "api.log"
        api = start_process(command, env, log_path)
        try:
            base_url = f"http://127.0.0.1:{port}"

            def healthy() -> bool:
                started = log_path.read_text().count("Application startup complete")
                return started >= uvicorn_workers and httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200

            wait_until(healthy, 120, "API start", api, log_path)
            yield Farm(base_url, env, api, command, work)
        finally:
            stop_process(api)
            redis_client().flushdb()


# ------------------------------------------------------------------------------------- measurements


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def latency_summary(latencies_s: list[float]) -> dict:
    """Count, mean and percentiles in milliseconds."""
    values = sorted(latencies_s)
    if not values:
        return {"count": 0}
    ms = lambda v: round(v * 1000, 2)
    return {"count": len(values), "mean_ms": ms(sum(values) / len(values)), "p50_ms": ms(percentile(values, 0.5)),
            "p90_ms": ms(percentile(values, 0.9)), "p99_ms": ms(percentile(values, 0.99)), "max_ms": ms(values[-1])}


def proc_stat(pid: int) -> tuple[str, float, float] | None:
    """(command name, own CPU seconds, CPU seconds of its exited children) of a process; None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return raw[raw.index("(") + 1:raw.rindex(")")], (int(fields[11]) + int(fields[12])) / tick, \
        (int(fields[13]) + int(fields[14])) / tick


def group_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of a group of processes: their own, plus their exited children's."""
    return sum(own + reaped for _, own, reaped in filter(None, map(proc_stat, pids)))


def pids_named(name: str) -> list[int]:
    """Every process whose command name is ``name``."""
    return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if (proc_stat(pid) or ("",))[0] == name]


def connections_per_process(port: int, pids: list[int]) -> dict[str, int]:
    """How many established TCP connections to the server ``port`` each of these processes holds."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            inodes.add(f"socket:[{fields[9]}]")
    counts = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            held = sum(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd"))
            if held:
                counts[str(pid)] = held
    return counts


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet_machine(max_wait_s: float, busy_below_cores: float = 0.3, window_s: float = 3.0) -> dict:
    """Wait (up to ``max_wait_s``) until the machine is nearly idle, so unrelated jobs do not share the run."""
    waited = time.monotonic()
    while True:
        before = machine_busy_seconds()
        time.sleep(window_s)
        busy = (machine_busy_seconds() - before) / window_s
        elapsed = time.monotonic() - waited
        if busy < busy_below_cores or elapsed >= max_wait_s:
            return {"busy_cores_before_load": round(busy, 2), "waited_s": round(elapsed, 1)}


class CpuMeter:
    """CPU seconds used between start() and stop(), by who: generator, API, PostgreSQL, Redis, the rest.

    PostgreSQL is every ``postgres`` process (all databases; backends that exit are counted through
    the postmaster, their parent). "rest" is the machine's busy time minus those: kernel and unrelated jobs.
    """

    def __init__(self, api_pid: int):
        self.groups = {"api": process_tree(api_pid), "redis": pids_named("redis-server")}

    def _read(self) -> dict[str, float]:
        own = os.times()
        return {"wall": time.monotonic(), "busy": machine_busy_seconds(), "load_generator": own.user + own.system,
                **{name: group_cpu_seconds(pids) for name, pids in self.groups.items()},
                "postgres": group_cpu_seconds(pids_named("postgres"))}

    def start(self) -> None:
        self.begin = self._read()

    def stop(self) -> dict:
        delta = {key: value - self.begin[key] for key, value in self._read().items()}
        wall, busy = delta.pop("wall"), delta.pop("busy")
        cores = os.cpu_count()
        used = {f"{name}_cpu_s": round(value, 1) for name, value in delta.items()}
        return {"wall_s": round(wall, 2), "cores": cores, **used,
                "rest_cpu_s (kernel, unrelated processes)": round(busy - sum(delta.values()), 1),
                "idle_cpu_s": round(wall * cores - busy, 1)}


class Connection:
    """One client's keep-alive HTTP/1.1 connection to the API.

    Deliberately minimal (requests with a JSON body or none; responses with Content-Length, as uvicorn
    sends them): per request it costs the generator a fraction of the CPU httpx does, which matters when
    the generator shares the cores with the server. After any failure the connection is reopened.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.headers = f"Host: {host}:{port}\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"

    async def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, bytes]:
        """Send one request; returns (status, response body)."""
        try:
            async with asyncio.timeout(timeout):
                if self.writer is None or self.reader.at_eof():  # the server closes idle keep-alive connections
                    self.close()
                    self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                head = f"{method} {path} HTTP/1.1\r\n{self.headers}"
                if body is not None:
                    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                self.writer.write(head.encode() + b"\r\n" + (body or b""))
                return await self._response()
        except BaseException:
            self.close()
            raise

    async def _response(self) -> tuple[int, bytes]:
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status, length, close = int(status_line.split(None, 2)[1]), 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
            elif name == b"transfer-encoding":
                raise ValueError("chunked responses are not supported by this client")
        data = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def failure(outcome: tuple[int, bytes] | BaseException) -> str | None:
    """Why a request failed (an exception or a non-2xx status), or None if it succeeded."""
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    status, data = outcome
    return None if 200 <= status < 300 else f"HTTP {status}: {data[:200].decode(errors='replace')}"


@dataclasses.dataclass
class LoadState:
    """What the clients share: export ids seen so far, the 202s per body, and every request's record."""

    ids: list[str] = dataclasses.field(default_factory=list)
    created: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    records: list[tuple[str, float, float, int | None, str | None]] = dataclasses.field(default_factory=list)


async def one_request(conn: Connection, kind: str, body_index: int, rng: random.Random, state: LoadState) -> tuple:
    """Send one request of ``kind``; returns (latency_s, status or None, error or None)."""
    start = time.perf_counter()
    try:
        if kind == "post":
            outcome = await conn.request("POST", "/exports", POST_BODIES[body_index])
        elif kind == "get":
            outcome = await conn.request("GET", f"/exports/{rng.choice(state.ids)}")
        else:
            outcome = await conn.request("GET", "/exports?limit=20")
    except Exception as err:  # noqa: BLE001 -- any failure to get an answer is an error of the run
        return time.perf_counter() - start, None, failure(err)
    latency = time.perf_counter() - start
    status, data = outcome
    if kind == "post" and status in (200, 202):
        export_id = json.loads(data)["id"]
        if export_id not in state.ids:
            state.ids.append(export_id)
        if status == 202:
            state.created.setdefault(body_index, []).append(export_id)
    return latency, status, failure(outcome)


async def client_loop(conn: Connection, index: int, t0: float, deadline: float, state: LoadState, think_s: float) -> None:
    """One closed-loop client, kinds in rotation: each request goes when the previous answered, after a
    random pause of mean ``think_s`` if any (exponential, so that clients do not move in lockstep)."""
    rng = random.Random(index)
    step = index
    while True:
        if think_s:
            await asyncio.sleep(min(rng.expovariate(1 / think_s), max(0.0, deadline - time.perf_counter())))
        if time.perf_counter() >= deadline:
            return
        kind = KINDS[step % len(KINDS)]
        if kind == "get" and not state.ids:
            kind = "post"
        sent = time.perf_counter() - t0
        body_index = (step // len(KINDS)) % len(LOAD_BODIES)
        latency, status, error = await one_request(conn, kind, body_index, rng, state)
        state.records.append((kind, sent, latency, status, error))
        step += 1


async def loop_lag(deadline: float, lags: list[float], interval: float = 0.01) -> None:
    """How late the generator's event loop wakes from a 10 ms sleep (its own saturation)."""
    while time.perf_counter() < deadline:
        before = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(time.perf_counter() - before - interval)


async def warm_up(connections: list[Connection], max_rounds: int = 10) -> dict:
    """Rounds of one request of each kind on every connection at once, until a round has no error.

    Not measured. The POSTs use a body the load does not use. A fresh uvicorn worker's first POSTs
    import transformers, so a cold burst may fail: those failures are reported, not hidden.
    """
    body = json.dumps(WARMUP_BODY).encode()
    errors = []
    for round_ in range(1, max_rounds + 1):
        posts = await asyncio.gather(*(c.request("POST", "/exports", body) for c in connections), return_exceptions=True)
        ids = [json.loads(o[1])["id"] for o in posts if failure(o) is None]
        gets = [c.request("GET", f"/exports/{ids[0]}") for c in connections] if ids else []
        lists = [c.request("GET", "/exports?limit=20") for c in connections]
        outcomes = posts + await asyncio.gather(*gets, return_exceptions=True)
        outcomes += await asyncio.gather(*lists, return_exceptions=True)
        failed = [f for f in map(failure, outcomes) if f is not None]
        errors += failed
        if not failed:
            return {"rounds": round_, "requests_per_round": len(outcomes), "errors": len(errors),
                    "error_examples": sorted(set(errors))[:5]}
    raise RuntimeError(f"the API still fails after {max_rounds} warm-up rounds: {sorted(set(errors))[:5]}")


async def run_load(base_url: str, clients: int, duration: float, think_s: float, meter: CpuMeter) -> dict:
    """The load phase: ``clients`` closed loops for ``duration`` seconds; returns its summary."""
    url = httpx.URL(base_url)
    connections = [Connection(url.host, url.port) for _ in range(clients)]
    try:
        warm = await warm_up(connections)
        state, lags = LoadState(), []
        meter.start()
        t0 = time.perf_counter()
        deadline = t0 + duration
        await asyncio.gather(loop_lag(deadline, lags),
                             *(client_loop(conn, i, t0, deadline, state, think_s) for i, conn in enumerate(connections)))
        elapsed = time.perf_counter() - t0
        cpu = meter.stop()
        spread = connections_per_process(url.port, meter.groups["api"])
    finally:
        for conn in connections:
            conn.close()
    cpu["api_cpu_ms_per_request"] = round(cpu["api_cpu_s"] * 1000 / max(1, len(state.records)), 2)
    return {"warm_up": warm, "client_connections_per_api_process": spread, **summarize_load(state, elapsed, lags, cpu)}


def summarize_load(state: LoadState, elapsed: float, lags: list[float], cpu: dict) -> dict:
    """Throughput, latency overall / per kind / per second, status counts, errors, 202s per body."""
    records = state.records
    errors = [r for r in records if r[4] is not None]
    statuses: dict[str, dict[str, int]] = {}
    for kind, _, _, status, _ in records:
        counts = statuses.setdefault(kind, {})
        counts[str(status)] = counts.get(str(status), 0) + 1
    per_second = []
    for second in range(math.ceil(elapsed)):
        window = [r[2] for r in records if second <= r[1] < second + 1]
        summary = latency_summary(window)
        per_second.append({"second": second, "requests": len(window), "p99_ms": summary.get("p99_ms")})
    overall = latency_summary([r[2] for r in records])
    return {
        "requests": len(records),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(records) / elapsed, 1),
        "latency": overall,
        "latency_by_kind": {kind: latency_summary([r[2] for r in records if r[0] == kind]) for kind in KINDS},
        "status_counts_by_kind": statuses,
        "errors": len(errors),
        "error_examples": sorted({r[4] for r in errors})[:5],
        "created_202_per_body": {json.dumps(LOAD_BODIES[i]): len(ids) for i, ids in sorted(state.created.items())},
        "per_second": per_second,
        "load_generator_loop_lag": latency_summary(lags),
        "cpu": cpu,
        "p99_target_met": overall.get("p99_ms", math.inf) < P99_TARGET_MS and not errors,
    }


def cancel_queued_and_purge(http: httpx.Client) -> int:
    """Cancel every queued export (the load phase left them) and drop their messages from the broker."""
    queued = http.get("/exports", params={"status": "queued", "limit": 500}).json()["items"]
    for export in queued:
        http.delete(f"/exports/{export['id']}").raise_for_status()
    client = redis_client()
    for key in client.scan_iter(match="cpu*"):  # the cpu queue's list (and its priority lists)
        client.delete(key)
    return len(queued)


def worker_registered(env: dict[str, str]) -> bool:
    """True once the worker wrote its row to the ``workers`` table (it does so when it is ready)."""
    import psycopg

    url = env["DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT 1 FROM workers WHERE hostname = %s", (WORKER_NAME,)).fetchone() is not None


def parse_time(value: str) -> datetime.datetime:
    """An ISO timestamp of the API (timezone-aware)."""
    return datetime.datetime.fromisoformat(value)


def one_queue_sample(http: httpx.Client, job_timeout: float) -> dict:
    """POST a forced export, time until it runs, wait until it is terminal; returns the figures."""
    sent = time.perf_counter()
    posted = http.post("/exports", json=QUEUE_BODY)
    answered = time.perf_counter()
    posted.raise_for_status()
    export_id = posted.json()["id"]
    seen_running = None
    deadline = sent + job_timeout
    while time.perf_counter() < deadline:
        export = http.get(f"/exports/{export_id}").json()
        if seen_running is None and export["status"] != "queued":
            seen_running = time.perf_counter()
        if export["status"] in TERMINAL:
            break
        time.sleep(POLL_S)
    else:
        raise RuntimeError(f"export {export_id} not finished after {job_timeout} s: {export['status']}")
    started, created = export["started_at"], parse_time(export["created_at"])
    return {
        "export_id": export_id,
        "status": export["status"],
        "post_latency_ms": round((answered - sent) * 1000, 1),
        "row_started_minus_created_s": round((parse_time(started) - created).total_seconds(), 3) if started else None,
        "post_to_seen_running_s": round(seen_running - sent, 3),
        "job_s": round((parse_time(export["finished_at"]) - parse_time(started)).total_seconds(), 2) if started else None,
    }


def figure_summary(values: list[float]) -> dict:
    """Median, min and max of seconds."""
    return {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
            "max_s": round(max(values), 3)}


def run_queue_latency(farm: Farm, samples: int, job_timeout: float) -> dict:
    """Start one worker, wait until it is registered and idle, then time ``samples`` jobs one by one."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=farm.base_url, headers=headers, timeout=30) as http:
        cancelled = cancel_queued_and_purge(http)
        env = {**farm.env, "BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4"}
        command = [sys.executable, "-m", "services.cli", "worker", "--queues", "cpu", "--name", WORKER_NAME]
        log_path = farm.logs / "worker.log"
        worker = start_process(command, env, log_path)
        try:
            wait_until(lambda: worker_registered(env), 120, "worker registration", worker, log_path)
            jobs = [one_queue_sample(http, job_timeout) for _ in range(samples)]
        finally:
            stop_process(worker)
    row = [j["row_started_minus_created_s"] for j in jobs if j["row_started_minus_created_s"] is not None]
    seen = [j["post_to_seen_running_s"] for j in jobs]
    return {
        "worker_command": command,
        "worker_env": {"BENCH_CONTEXTS": "[16]", "BENCH_STEPS": "4"},
        "load_phase_exports_cancelled_and_purged": cancelled,
        "poll_interval_s": POLL_S,
        "jobs": jobs,
        "row_started_minus_created": figure_summary(row),
        "post_to_seen_running": figure_summary(seen),
        "first_job": {"row_started_minus_created_s": jobs[0]["row_started_minus_created_s"],
                      "post_to_seen_running_s": jobs[0]["post_to_seen_running_s"]},
        "after_first_job": {"row_started_minus_created": figure_summary(row[1:]),
                            "post_to_seen_running": figure_summary(seen[1:])} if samples > 1 else None,
        "all_ready": all(j["status"] == "ready" for j in jobs),
        "target_met": max(row + seen) < QUEUE_TARGET_S,
    }


# ------------------------------------------------------------------------------------------- report


def versions() -> dict:
    """Versions of the Python packages on the request path and of the PostgreSQL and Redis servers."""
    import psycopg

    found = {name: importlib.metadata.version(name) for name in PACKAGES}
    with psycopg.connect(POSTGRES_ADMIN_URL) as conn:
        found["postgresql_server"] = conn.execute("SHOW server_version").fetchone()[0]
    found["redis_server"] = redis_client().info("server")["redis_version"]
    found["python"] = platform.python_version()
    return found


def code_state() -> dict:
    """The commit, the files with uncommitted changes and a digest of the code's content (it may change under a run)."""
    import hashlib

    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()

    code = ("services", "workers", "exporter")
    digest = hashlib.sha256()
    for name in sorted(git("ls-files", "--cached", "--others", "--exclude-standard", "--", *code)):
        if (REPO / name).is_file():
            digest.update(name.encode() + b"\0" + (REPO / name).read_bytes())
    return {"commit": git("rev-parse", "HEAD")[0], "uncommitted_files": sorted(line[3:] for line in git(
        "status", "--porcelain", "--", *code)), "content_sha256": digest.hexdigest()[:16]}


def machine() -> dict:
    """Cores, CPU model, memory and kernel of this machine."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), None)
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_total_bytes": int(meminfo["MemTotal"].split()[0]) * 1024,
            "kernel": platform.release()}


def print_table(results: dict) -> None:
    """The load results per uvicorn configuration and kind, then the queue latency."""
    print(f"\n{'uvicorn workers':>15} {'kind':>6} {'requests':>9} {'req/s':>7} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8} {'errors':>6}")
    for workers, load in results["load"].items():
        rows = [("all", load["latency"], load["requests_per_s"], load["errors"])]
        rows += [(k, s, round(s["count"] / load["elapsed_s"], 1), "") for k, s in load["latency_by_kind"].items()]
        for kind, s, rate, errors in rows:
            print(f"{workers:>15} {kind:>6} {s['count']:>9} {rate:>7} {s['p50_ms']:>8} {s['p90_ms']:>8} "
                  f"{s['p99_ms']:>8} {s['max_ms']:>8} {errors:>6}")
        cpu = load["cpu"]
        print(f"{'':>15} p99 < {P99_TARGET_MS:.0f} ms and 0 errors: {load['p99_target_met']}; "
              f"202s per body {list(load['created_202_per_body'].values())} (1 each expected)")
        print(f"{'':>15} client connections per uvicorn process: "
              f"{sorted(load['client_connections_per_api_process'].values())}")
        warm = load["warm_up"]
        print(f"{'':>15} warm-up: {warm['rounds']} round(s) of {warm['requests_per_round']} requests, "
              f"{warm['errors']} errors {warm['error_examples'][:2]}")
        print(f"{'':>15} CPU s over {cpu['wall_s']} s x {cpu['cores']} cores: generator {cpu['load_generator_cpu_s']}, "
              f"api {cpu['api_cpu_s']} ({cpu['api_cpu_ms_per_request']} ms/request), postgres {cpu['postgres_cpu_s']}, "
              f"redis {cpu['redis_cpu_s']}, rest {cpu['rest_cpu_s (kernel, unrelated processes)']}, "
              f"idle {cpu['idle_cpu_s']}")
    queue = results.get("queue_latency")
    if queue:
        print(f"\nPOST -> job start over {len(queue['jobs'])} jobs (target < {QUEUE_TARGET_S:.0f} s): "
              f"met {queue['target_met']}")
        for name in ("row_started_minus_created", "post_to_seen_running"):
            s = queue[name]
            print(f"  {name:<27} median {s['median_s']:.3f} s  max {s['max_s']:.3f} s  "
                  f"(first job {queue['first_job'][name + '_s']:.3f} s)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per uvicorn configuration")
    parser.add_argument("--think-ms", type=float, default=0.0, help="mean random pause of each client between its requests")
    parser.add_argument("--uvicorn-workers", default="1", help="comma-separated uvicorn worker counts to measure")
    parser.add_argument("--queue-samples", type=int, default=10, help="0 skips the queue-latency phase")
    parser.add_argument("--job-timeout", type=float, default=300.0, help="seconds one queue-latency job may take")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="seconds to wait at most for the machine to be idle before each load phase")
    parser.add_argument("--profile", action="store_true", help="also sample the API with py-spy during a second run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "api_load.json")
    return parser.parse_args()


PROFILE_BUCKETS = (  # where a GIL-holding sample's innermost frame is, by path
    ("uvicorn, h11 (HTTP, ASGI server)", ("uvicorn/", "h11/")),
    ("asyncio event loop", ("asyncio/",)),
    ("starlette, fastapi (middleware, routing, dependencies)", ("starlette/", "fastapi/")),
    ("pydantic (validation, serialization)", ("pydantic", "annotated_types")),
    ("sqlalchemy (ORM, SQL compilation, results)", ("sqlalchemy/",)),
    ("psycopg (PostgreSQL driver)", ("psycopg",)),
    ("threads: anyio thread pool hand-off, locks", ("anyio/", "threading.py", "queue.py", "concurrent/")),
    ("exportfarm code", ("(services/", "(exporter/", "(workers/", "/services/", "/exporter/", "/workers/")),
)


def profile_api(pid: int, seconds: float, out: Path) -> dict:
    """py-spy samples (GIL holder only, so CPU and not waiting) of the API process during a load run."""
    import collections
    import re

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    subprocess.run([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "--gil", "--nonblocking",
                    "-f", "raw", "-o", str(out)], check=True, capture_output=True)
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, count = stack.split(";"), int(count)
        total += count
        leaf = frames[-1]
        own[next((name for name, marks in PROFILE_BUCKETS if any(m in leaf for m in marks)), "other")] += count
        for frame in {f for f in frames if re.search(r"[(/](services|exporter|workers)/", f)}:
            inclusive[re.sub(r":\d+\)$", ")", frame)] += count
    return {
        "tool": "py-spy record --gil -r 200 (samples only while a thread holds the GIL)", "samples": total,
        "self_time_pct_by_part": {k: round(100 * v / total, 1) for k, v in own.most_common()},
        "exportfarm_functions_inclusive_pct": {k: round(100 * v / total, 1) for k, v in inclusive.most_common(15)},
    }


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # `kill`, `timeout`: still clean up
    worker_counts = [int(n) for n in args.uvicorn_workers.split(",")]
    code_at_start = code_state()
    work = Path(tempfile.mkdtemp(prefix="exportfarm_api_load_"))
    print(f"work directory (logs): {work}", flush=True)
    make_models(work / "models")
    results: dict = {"load": {}, "queue_latency": None}
    commands = {}
    for count in worker_counts:
        with running_farm(work / f"uvicorn-{count}", work / "models", count) as farm:
            print(f"load: {args.clients} clients x {args.duration} s, {count} uvicorn worker(s), "
                  f"api pid {farm.api.pid}", flush=True)
            commands[str(count)] = farm.api_command
            quiet = wait_for_quiet_machine(args.quiet_wait)
            results["load"][str(count)] = asyncio.run(
                run_load(farm.base_url, args.clients, args.duration, args.think_ms / 1000, CpuMeter(farm.api.pid)))
            results["load"][str(count)]["machine_before_load"] = quiet
            if args.profile and "profile" not in results:
                # A second load run, sampled: the measured run above carries no profiler overhead.
                print("profile: the same load again, with py-spy on the API process", flush=True)
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    sampled = pool.submit(profile_api, farm.api.pid, args.duration - 5, work / "profile.txt")
                    asyncio.run(run_load(farm.base_url, args.clients, args.duration, args.think_ms / 1000,
                                         CpuMeter(farm.api.pid)))
                    results["profile"] = {"uvicorn_workers": count, **sampled.result()}
            if args.queue_samples and results["queue_latency"] is None:
                print(f"queue latency: {args.queue_samples} jobs", flush=True)
                results["queue_latency"] = run_queue_latency(farm, args.queue_samples, args.job_timeout)
    report = {
        "benchmark": "api_load",
        "command": [Path(sys.executable).name, *sys.argv],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "code": {**code_at_start,
                 "changed_during_run": code_state()["content_sha256"] != code_at_start["content_sha256"]},
        "versions": versions(),
        "configuration": {
            "clients": args.clients, "duration_s": args.duration, "think_ms": args.think_ms,
            "uvicorn_workers": worker_counts,
            "api_commands": commands, "request_mix": "post, get, list in rotation per client (1/3 each)",
            "load_bodies": LOAD_BODIES, "queue_body": QUEUE_BODY, "database": "PostgreSQL, a fresh database per run",
            "broker": REDIS_URL, "artifact_store": "local directory", "load_generator": (
                "one asyncio process, one keep-alive HTTP/1.1 connection per client (a minimal client in this file; "
                "httpx.AsyncClient cost 3.6 to 6.4 ms of CPU per request here), closed loop without think time, on "
                f"the same machine: it competes with uvicorn, PostgreSQL and Redis for the {os.cpu_count()} cores "
                "(see results.load.*.cpu and load_generator_loop_lag)"),
        },
        "targets": {"load": f"errors == 0 and p99 < {P99_TARGET_MS:.0f} ms",
                    "queue_latency": f"POST to job start < {QUEUE_TARGET_S:.0f} s (every sample, both figures)"},
        "results": results,
        "targets_met": {
            **{f"load_uvicorn_workers_{n}": load["p99_target_met"] for n, load in results["load"].items()},
            "queue_latency": results["queue_latency"]["target_met"] if results["queue_latency"] else None,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(results)
    if "profile" in results and "self_time_pct_by_part" in results["profile"]:
        print("\nwhere the API's CPU goes (GIL-holding samples, self time):")
        for part, pct in results["profile"]["self_time_pct_by_part"].items():
            print(f"  {pct:5.1f}%  {part}")
    if report["code"]["changed_during_run"]:
        print("warning: the service code changed during the run; configurations may have run different code")
    print(f"\nwrote {args.out}")
    if any(load["errors"] for load in results["load"].values()):
        print(f"errors: logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
