"""Which worker class a job goes to, and whether a worker can hold the job it is handed.

Every job's needs are estimated from config.json and the request before anything runs
(``exporter.resources``). Worker classes are queues with a size: ``QUEUE_CLASSES`` maps a queue
name to its execution provider and what each of its workers has (the Helm chart renders it from
each class's resources). The API sends a job to the smallest class of its execution provider
that holds it and answers 422 with the figures when none can; a worker compares the job with
what it measures of itself (its cgroup's memory limit, the free memory of its GPU, the free
disk of its work directory) before claiming it, and hands a job it cannot hold to a class that
can, or fails it once with the figures: never an out-of-memory kill retried MAX_ATTEMPTS times.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from exporter.errors import ExportError
from exporter.request import EP, ExportRequest
from exporter.resources import GiB, Capacity, ResourceEstimate, estimate_resources
from services.settings import Settings
from services.sources import ModelSource

log = logging.getLogger(__name__)

DEFAULT_QUEUES = {"cpu": EP.CPU, "gpu": EP.CUDA}
DEFAULT_QUEUE_FOR_EP = {ep.value: name for name, ep in DEFAULT_QUEUES.items()}


@dataclasses.dataclass(frozen=True)
class QueueClass:
    name: str
    ep: EP
    capacity: Capacity

    @property
    def sized(self) -> bool:
        return self.capacity.host_bytes is not None


def _gib(value) -> int | None:
    return None if value is None else int(float(value) * GiB)


def queue_classes(settings: Settings) -> list[QueueClass]:
    """The worker classes jobs are placed on: QUEUE_CLASSES, else the two default queues, sized
    as this machine in embedded mode (serve's own worker runs here) and unsized otherwise."""
    if settings.queue_classes:
        return [QueueClass(name, EP(spec["ep"]), Capacity(
            f"worker class {name}", _gib(spec.get("memory_gb")), _gib(spec.get("gpu_memory_gb")),
            _gib(spec.get("disk_gb")))) for name, spec in settings.queue_classes.items()]
    if settings.embedded:
        here = machine_capacity(settings, "this machine", gpu=True)
        return [QueueClass("cpu", EP.CPU, dataclasses.replace(here, gpu_bytes=None)),
                QueueClass("gpu", EP.CUDA, here)]
    return [QueueClass(name, ep, Capacity(f"worker class {name}")) for name, ep in DEFAULT_QUEUES.items()]


def queue_names(settings: Settings) -> list[str]:
    return [c.name for c in queue_classes(settings)]


def default_queue(settings: Settings, ep: str) -> str:
    """The queue of an export placed without an estimate (a hub model, an older row)."""
    classes = [c for c in queue_classes(settings) if c.ep.value == ep]
    if not classes:
        raise ExportError(f"no worker class takes {ep} exports (QUEUE_CLASSES has "
                          f"{', '.join(queue_names(settings))}): add one with \"ep\": \"{ep}\"")
    named = [c for c in classes if c.name == DEFAULT_QUEUE_FOR_EP[ep]]
    return (named or sorted(classes, key=_size))[0].name


def _size(queue: QueueClass) -> tuple:
    c = queue.capacity
    big = float("inf")
    return (c.host_bytes or big, c.gpu_bytes or big, c.disk_bytes or big, queue.name)


# --- what a job needs -----------------------------------------------------------------------------


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def job_estimate(settings: Settings, request: ExportRequest, source: ModelSource,
                 reference_on_gpu: bool = False) -> ResourceEstimate | None:
    """The job's needs, where its config.json can be read here (a local model); None for a hub
    model, whose config only its worker downloads."""
    if not source.local:
        return None
    from services.jobs import _model_config, directory_signature

    config = _model_config(str(source.directory), directory_signature(source.directory))
    return estimate_resources(
        config, request, validate_ep=settings.validate_ep, checkpoint_bytes=checkpoint_bytes(source.directory),
        download=False, local_store=not settings.s3_endpoint_url, bench_contexts=settings.bench_contexts,
        bench_batches=settings.bench_batches, reference_on_gpu=reference_on_gpu)


def place(settings: Settings, request: ExportRequest, estimate: ResourceEstimate | None,
          exclude: tuple[str, ...] = ()) -> str:
    """The smallest worker class of the request's EP whose workers hold the job (an unsized class
    holds anything: its workers check for themselves); ExportError with the figures if none can."""
    ep = request.ep.value
    classes = sorted((c for c in queue_classes(settings) if c.ep.value == ep and c.name not in exclude), key=_size)
    if not classes:
        raise ExportError(f"no other worker class takes {ep} exports") if exclude else \
            ExportError(f"no worker class takes {ep} exports (QUEUE_CLASSES has {', '.join(queue_names(settings))})")
    if estimate is None:
        preferred = [c for c in classes if c.name == DEFAULT_QUEUE_FOR_EP[ep]]
        return (preferred or classes)[0].name
    for queue in classes:
        if not estimate.shortfalls(queue.capacity):
            return queue.name
    largest = classes[-1]
    raise ExportError(too_big(estimate, largest.capacity, request) +
                      "; no worker class can run it: pick a smaller dtype (int4 / int8), or add a larger worker class")


def too_big(estimate: ResourceEstimate, capacity: Capacity, request: ExportRequest) -> str:
    return (f"{request.model} {request.dtype.value} on {request.ep.value} needs "
            + "; ".join(estimate.shortfalls(capacity)))


# --- what a worker has ----------------------------------------------------------------------------


def _cgroup_memory_limit() -> int | None:
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # cgroup v1 says "unlimited" with a huge number
            return int(text)
    return None


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_capacity(settings: Settings, holder: str = "this worker", gpu: bool = True) -> Capacity:
    """What this process can use: host memory (WORKER_MEMORY_GB, else the cgroup's limit, else the
    machine's), free memory of its bound GPU (WORKER_GPU_MEMORY_GB, else NVML; none on a CPU host)
    and free disk under its work directory (WORKER_DISK_GB, else measured)."""
    host = _gib(settings.worker_memory_gb) or min(filter(None, (_cgroup_memory_limit(), _physical_memory())))
    gpu_bytes = _gib(settings.worker_gpu_memory_gb)
    if gpu_bytes is None and gpu:
        from exporter.runtime.device import device_memory

        try:
            memory = device_memory()
        except ExportError as err:
            log.warning("%s", err)
            memory = None
        gpu_bytes = memory.free_bytes if memory is not None else None
    disk = _gib(settings.worker_disk_gb)
    if disk is None:
        scratch = settings.scratch_dir
        while not scratch.exists() and scratch != scratch.parent:
            scratch = scratch.parent
        disk = shutil.disk_usage(scratch).free
    return Capacity(holder, host, gpu_bytes, disk)


def worker_refusal(estimate: ResourceEstimate, capacity: Capacity, request: ExportRequest) -> str | None:
    """Why this worker cannot run the job (None: it can)."""
    if not estimate.shortfalls(capacity):
        return None
    return too_big(estimate, capacity, request)
