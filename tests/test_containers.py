"""The deployment as containers: the images built from deploy/, the compose stack run by podman, one
export through it while its worker container is SIGKILLed.

What runs is deploy/docker-compose.yml itself (services, commands, settings, health checks,
dependency conditions, restart policies), started by deploy/tools/compose_podman.py: this machine
has podman and no Docker engine. No registry image is reachable here, so:

- the base is a Debian 12 image made by deploy/ci/base-image.sh (mmdebstrap + podman import); the
  API / CPU worker image takes it through PYTHON_IMAGE, the GPU worker image through CUDA_IMAGE (it
  builds, and checks its onnxruntime has the CUDA provider; it cannot run without a GPU);
- Redis, PostgreSQL and SeaweedFS run from stand-ins built on that base (deploy/ci/*.Containerfile)
  with the interface the compose file uses of the official images;
- torch's CPU wheel comes from the local wheel directory instead of the PyTorch index.

The test waits for health, POSTs an export of a small checkpoint, holds its first attempt in
validation (workers/failpoints.py), SIGKILLs the worker container's main process from the host,
sees the compose restart policy bring the container back and the job end `ready` on its second
attempt, downloads every artifact through its presigned S3 link and checks its sha256, then tears
everything down. Needs podman, runc, catatonit, mmdebstrap and docker-compose (CI installs them);
EXPORTFARM_SKIP_CONTAINERS=1 skips instead, on a machine that cannot have them. With
EXPORTFARM_CONTAINER_TIMINGS=<file> the build and start times are written there as JSON. The images
are removed at the end (they take several GB) unless EXPORTFARM_KEEP_IMAGES=1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.tiny_checkpoint import make_tiny_checkpoint
from services.demo import Api
from tests.farm import until
from tests.s3_server import free_ports

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CI = DEPLOY / "ci"
sys.path.insert(0, str(DEPLOY / "tools"))
import compose_podman  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

PROJECT = "exportfarm-ci"
STAND_INS = {"redis": "redis", "postgres": "postgres", "s3": "seaweedfs"}  # service -> Containerfile
FARM = ["api", "cpu-worker", "beat"]  # and, through depends_on, migrate, postgres, redis, s3
IMAGES = ["api", "cpu-worker", "gpu-worker"]
MODEL = "tiny-qwen2"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_WHEEL = "torch-2.13.0+cpu-*.whl"
# Short leases so that a killed worker's job is taken over in seconds, not a minute.
FARM_ENV = {"LEASE_S": "10", "HEARTBEAT_S": "1", "SWEEP_INTERVAL_S": "2", "BENCH_CONTEXTS": "[64]",
            "EXPORTFARM_FAILPOINTS": "/failpoints/points.json"}


def _require_tools() -> None:
    missing = [tool for tool in ("podman", "mmdebstrap", "docker-compose") if shutil.which(tool) is None]
    if missing:
        message = (f"{', '.join(missing)} not installed (apt-get install podman runc catatonit mmdebstrap "
                   "docker-compose)")
        if os.environ.get("EXPORTFARM_SKIP_CONTAINERS") == "1":
            pytest.skip(f"{message} (EXPORTFARM_SKIP_CONTAINERS=1)")
        pytest.fail(f"{message}. CI installs them (.ci/run); set EXPORTFARM_SKIP_CONTAINERS=1 to skip these tests")


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def settings_file(tmp_path_factory) -> dict:
    """deploy/.env for this run: fresh passwords, free published ports, images tagged `ci`."""
    api_port, s3_port = free_ports(2)  # distinct: both held open while chosen
    values = {
        "EXPORTFARM_VERSION": "ci", "POSTGRES_USER": "exportfarm", "POSTGRES_DB": "exportfarm",
        "POSTGRES_PASSWORD": secrets.token_hex(12), "REDIS_PASSWORD": secrets.token_hex(12),
        "S3_ACCESS_KEY": "exportfarm", "S3_SECRET_KEY": secrets.token_hex(16), "S3_BUCKET": "exportfarm",
        "ADMIN_TOKEN": secrets.token_hex(16), "HUB_ACCESS": "false", "VALIDATE_EP": "", "LOG_LEVEL": "INFO",
        "API_PORT": str(api_port), "S3_PORT": str(s3_port), "S3_PUBLIC_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
    }
    path = tmp_path_factory.mktemp("compose") / ".env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return {"path": path, **values}


@pytest.fixture(scope="module")
def podman_conf():
    """CI's podman settings (deploy/ci/containers.conf) for every podman call of this module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONTAINERS_CONF", str(CI / "containers.conf"))
    yield
    mp.undo()


def _build_inputs() -> tuple[list[str], str]:
    """podman build volumes and TORCH_PIP_SOURCE: the local torch wheel when there is one, and this
    host's CA bundle (CI's network re-signs TLS) for pip inside the builds."""
    volumes, torch_source = [], "--index-url https://download.pytorch.org/whl/cpu"
    wheels = Path(os.environ.get("EXPORTFARM_TORCH_WHEELS", "/opt/wheels"))
    if any(wheels.glob(TORCH_WHEEL)):
        volumes.append(f"{wheels}:/wheels:ro")
        torch_source = "--no-index --find-links /wheels"
    if CA_BUNDLE.is_file():
        volumes += [f"{CA_BUNDLE}:{CA_BUNDLE}:ro", f"{CI / 'pip.conf'}:/etc/pip.conf:ro"]
    return volumes, torch_source


@pytest.fixture(scope="module")
def images(podman_conf, settings_file) -> Iterator[dict]:
    """Every image: the Debian base, the three stand-ins, api / cpu-worker, gpu-worker."""
    _require_tools()
    timings: dict = {}
    start = time.monotonic()
    base = subprocess.run([str(CI / "base-image.sh")], capture_output=True, text=True, timeout=1200, check=False)
    assert base.returncode == 0, f"deploy/ci/base-image.sh failed:\n{base.stderr[-3000:]}"
    base_image = base.stdout.strip().splitlines()[-1]
    timings["base_image_s"] = round(time.monotonic() - start, 1)

    volumes, torch_source = _build_inputs()
    stack = compose_podman.Stack(compose_podman.resolve(settings_file["path"]), project=PROJECT)
    stand_ins = {}
    for service, name in STAND_INS.items():
        image = f"localhost/{PROJECT}/{name}:{base_image.rsplit(':', 1)[-1]}"
        timings[f"{name}_s"] = stack.build_image(CI, CI / f"{name}.Containerfile", image,
                                                 {"BASE_IMAGE": base_image}, volumes, timeout=1200)
        stand_ins[service] = image

    timings["farm_images_s"] = stack.build(
        FARM, {"PYTHON_IMAGE": base_image, "TORCH_PIP_SOURCE": torch_source}, volumes)
    timings["gpu_worker_image_s"] = stack.build(
        ["gpu-worker"], {"CUDA_IMAGE": base_image, "TORCH_PIP_SOURCE": torch_source}, volumes)
    names = {s: stack.image(s) for s in IMAGES}
    yield {"base": base_image, "stand_ins": stand_ins, "names": names, "timings": timings, "stack": stack}
    if os.environ.get("EXPORTFARM_KEEP_IMAGES") != "1":
        _remove_images([*names.values(), *stand_ins.values(), base_image])


def _remove_images(images: list[str]) -> None:
    """Give back the disk the builds took (several GB: torch in three images, their build layers), so
    the tests after this module do not run on a full disk. EXPORTFARM_KEEP_IMAGES=1 keeps them."""
    removed = _podman("rmi", "--force", *images, timeout=300)
    assert removed.returncode == 0, f"podman rmi failed: {removed.stderr[-2000:]}"
    _podman("image", "prune", "--force", timeout=300)  # the untagged layers of the builds


@pytest.fixture(scope="module")
def mounted(tmp_path_factory) -> Path:
    """What the farm's containers see besides their volumes: models/ (the `models` volume) with the
    checkpoint, and failpoints/points.json (read by workers at every stage), readable by uid 10001."""
    work = tmp_path_factory.mktemp("mounted")
    make_tiny_checkpoint("qwen2", work / "models" / MODEL)
    (work / "failpoints").mkdir()
    (work / "failpoints" / "points.json").write_text("{}")
    for path in (work, *work.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return work


@pytest.fixture(scope="module")
def stack(images, mounted):
    """The compose stack up (api, cpu-worker, beat and what they depend on); down at the end."""
    stack = dataclasses.replace(  # the compose file as the images fixture resolved it
        images["stack"], images=images["stand_ins"], binds={"models": str(mounted / "models")}, env=FARM_ENV,
        mounts=[f"{mounted / 'failpoints'}:/failpoints:ro"])
    stack.down(volumes=True)  # what a crashed earlier run left
    start = time.monotonic()
    try:
        images["timings"]["services_started_s"] = stack.up(FARM, timeout=300)
        stack.wait("api", "service_healthy", timeout=300)
        images["timings"]["stack_healthy_s"] = round(time.monotonic() - start, 1)
        yield stack
    finally:
        for service in FARM:
            if stack.state(service):
                print(f"--- {service} ---\n{stack.logs(service, tail=30)}")
        stack.down(volumes=True)
        if os.environ.get("EXPORTFARM_CONTAINER_TIMINGS"):
            Path(os.environ["EXPORTFARM_CONTAINER_TIMINGS"]).write_text(json.dumps(images["timings"], indent=1))
    assert _podman("pod", "exists", PROJECT).returncode == 1, "the pod is still there after down"
    left = _podman("volume", "ls", "--quiet", "--filter", f"name={PROJECT}_").stdout.split()
    assert not left, f"volumes left after down: {left}"


def test_images_run_as_non_root_with_health_checks(images):
    for service, image in images["names"].items():
        user = _podman("image", "inspect", "--format", "{{.User}}", image)
        assert user.returncode == 0, f"{image} was not built: {user.stderr}"
        assert user.stdout.strip() == "10001:10001", f"{service} image runs as {user.stdout.strip()!r}"
        check = json.loads(_podman("image", "inspect", "--format", "{{json .HealthCheck}}", image).stdout)
        process = "api" if service == "api" else "worker"
        assert check and check["Test"][1:5] == ["python", "-m", "services.health", process], \
            f"the {service} image has no services.health {process} HEALTHCHECK: {check}"


def test_stack_finishes_an_export_through_a_killed_worker_container(stack, settings_file, mounted, images):
    for service in FARM:
        assert stack.run("exec", stack.container(service), "id", "-u").stdout.strip() == "10001", service
    # The images' own HEALTHCHECKs, beside the compose ones the stack waited for; and the worker
    # check failing where no worker runs (the API's container has no Celery node).
    for service in ("api", "cpu-worker"):
        assert stack.run("healthcheck", "run", stack.container(service), check=False).returncode == 0, service
    assert stack.healthy("beat")
    no_worker = stack.run("exec", stack.container("api"), "python", "-m", "services.health", "worker",
                          "--timeout", "2", check=False)
    assert no_worker.returncode == 1 and "celery@api did not answer" in no_worker.stderr, no_worker

    api = Api(f"http://127.0.0.1:{settings_file['API_PORT']}", settings_file["ADMIN_TOKEN"])
    (mounted / "failpoints" / "points.json").write_text(json.dumps({"*": {"point": "validate", "attempt": 1, "seconds": 3600}}))
    status, export = api.call("POST", "/exports", {"model": MODEL, "dtype": "fp32", "ep": "cpu"})
    assert status == 202, export
    job = f"/exports/{export['id']}"

    def latest() -> dict:
        status, body = api.call("GET", job)
        assert status == 200, body
        return body

    held = until(latest, lambda e: e["status"] == "running" and e["stage"] == "validate", 180,
                 "the first attempt reaching validation")
    assert held["attempts"] == 1, held
    restarts = int(stack.inspect("cpu-worker", "{{.RestartCount}}"))
    os.kill(int(stack.inspect("cpu-worker", "{{.State.Pid}}")), signal.SIGKILL)
    killed = time.monotonic()
    until(lambda: (stack.state("cpu-worker"), int(stack.inspect("cpu-worker", "{{.RestartCount}}"))),
          lambda s: s == ("running", restarts + 1), 60, "the restart policy bringing the worker back")

    done = until(latest, lambda e: e["status"] not in ("queued", "running"), 300, "the export ending", every=0.5)
    assert done["status"] == "ready", done
    images["timings"]["kill_to_ready_s"] = round(time.monotonic() - killed, 1)
    assert done["attempts"] == 2, f"the killed attempt should have been taken over by a second one: {done}"
    assert done["lost_reason"], done

    status, artifacts = api.call("GET", f"{job}/artifacts")
    assert status == 200, artifacts
    assert {"model.onnx", "manifest.json", "parity_report.json"} <= set(artifacts["files"]), artifacts["files"]
    for name, entry in artifacts["files"].items():
        url = urllib.parse.urlsplit(entry["url"])
        assert url.netloc == f"127.0.0.1:{settings_file['S3_PORT']}", f"{name} is not a link into the S3 server: {url}"
        with urllib.request.urlopen(entry["url"], timeout=60) as response:
            body = response.read()
        assert len(body) == entry["size"], name
        assert entry["sha256"] and hashlib.sha256(body).hexdigest() == entry["sha256"], f"{name}: sha256 differs"

    status, catalog = api.call("GET", f"/catalog/models/{MODEL}")
    assert status == 200, catalog
    assert export["id"] in json.dumps(catalog), catalog
