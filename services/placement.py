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
import functools
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from exporter.cache import Trim
from exporter.errors import ExportError
from exporter.packaging.source_files import shard_names
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
        # Sized as this machine is, not as free as it is now: a job running here must not make the
        # next request look impossible (its worker checks what is free when it takes the job).
        here = Capacity("this machine", _host_memory(settings), _gpu_total(settings), None)
        return [QueueClass("cpu", EP.CPU, dataclasses.replace(here, gpu_bytes=None)),
                QueueClass("gpu", EP.CUDA, here)]
    return [QueueClass(name, ep, Capacity(f"worker class {name}")) for name, ep in DEFAULT_QUEUES.items()]


def queue_names(settings: Settings) -> list[str]:
    return [c.name for c in queue_classes(settings)]


def current_queue(settings: Settings, queue: str | None, ep: str) -> str:
    """Where a job placed on ``queue`` is sent now: that class, or its EP's default where the class
    is gone (renamed or removed from QUEUE_CLASSES), so that no job waits on a queue nobody reads."""
    return queue if queue in queue_names(settings) else default_queue(settings, ep)


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
    """The checkpoint's safetensors on disk: its index's shards, wherever it puts them."""
    return sum((directory / name).stat().st_size for name in shard_names(directory))


@functools.lru_cache(maxsize=256)
def checkpoint_parameters(directory: str, signature: tuple) -> int:
    """The checkpoint's parameters, every tensor its safetensors headers list (an image-text checkpoint's tower
    included); read once per version of the directory (``signature``: services.sources.directory_signature), as its
    config is, since the API sizes every request."""
    import math

    from exporter.packaging.checkpoint import Checkpoint

    checkpoint = Checkpoint(Path(directory))
    return sum(math.prod(checkpoint.shape(name)) for name in checkpoint.names())


def job_estimate(settings: Settings, request: ExportRequest, source: ModelSource,
                 reference_on_gpu: bool = False, fetch_config: bool = False) -> ResourceEstimate | None:
    """The job's needs from its config.json: a local model's, or with ``fetch_config`` (a worker,
    before it claims the job) a hub model's, downloaded alone; else None (the API never calls the hub)."""
    from services.jobs import _model_config, directory_signature, traced_locally

    if traced_locally(source, request):
        return None  # the estimate is the geometry of hand-built architectures; a traced job is not sized here
    if source.local:  # an image-text one is sized with its whole fp32 reference (estimate_resources)
        from exporter.graph.language_model import image_text_type

        image_text = bool(image_text_type(source.directory))
        signature = directory_signature(source.directory)
        config = _model_config(str(source.directory), signature)
        stored = checkpoint_bytes(source.directory)
        whole = checkpoint_parameters(str(source.directory), signature) if image_text else None
    elif fetch_config and (config := _hub_config(source)) is not None:
        from exporter.resources import Geometry

        stored = Geometry.of(config).parameters * 2  # what the download takes: hub checkpoints come in bf16
    else:
        return None
    return estimate_resources(
        config, request, validate_ep=settings.validate_ep, checkpoint_bytes=stored, download=not source.local,
        local_store=not settings.s3_endpoint_url, bench_contexts=settings.bench_contexts,
        bench_batches=settings.bench_batches, reference_on_gpu=reference_on_gpu, whole_reference_parameters=whole)


def _hub_config(source: ModelSource):
    """A hub model's config.json alone (into the hub cache), read as the exporter reads it; None
    when it cannot be had (offline, no such file): the job's resolve stage then says why."""
    try:
        from huggingface_hub import hf_hub_download

        from exporter.graph.architectures import ARCHITECTURES
        from exporter.graph.config import load_model_config

        path = Path(hf_hub_download(source.repo_id, "config.json", revision=source.ref))
        return load_model_config(path.parent, ARCHITECTURES)
    except Exception as err:  # the hub's many error types; the download stage reports them properly
        log.warning("%s: config.json not read before the job (%s)", source.model, err)
        return None


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
    raise ExportError(too_big(estimate, largest.capacity, request) + "; no worker class can run it: "
                      + what_to_do(request))


def too_big(estimate: ResourceEstimate, capacity: Capacity, request: ExportRequest) -> str:
    return (f"{request.model} {request.dtype.value} on {request.ep.value} needs "
            + "; ".join(estimate.shortfalls(capacity)))


def what_to_do(request: ExportRequest) -> str:
    """The advice a refusal ends with."""
    if request.dtype.value == "int4":
        return "add a larger worker class (QUEUE_CLASSES; the Helm chart's extraWorkerClasses)"
    smaller = "int4 / int8" if request.dtype.value != "int8" else "int4"
    return f"export it in {smaller}, or add a larger worker class (QUEUE_CLASSES; the Helm chart's extraWorkerClasses)"


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


def _host_memory(settings: Settings) -> int:
    return _gib(settings.worker_memory_gb) or min(filter(None, (_cgroup_memory_limit(), _physical_memory())))


def _bound_gpu():
    """The bound GPU's memory figures (NVML), None without one (a bad binding is logged)."""
    from exporter.runtime.device import device_memory

    try:
        return device_memory()
    except ExportError as err:
        log.warning("%s", err)
        return None


def _gpu_total(settings: Settings) -> int | None:
    if settings.worker_gpu_memory_gb:
        return _gib(settings.worker_gpu_memory_gb)
    memory = _bound_gpu()
    return memory.total_bytes if memory is not None else None


def machine_capacity(settings: Settings, holder: str = "this worker", own_work: Path | None = None,
                     trims: Iterable[Trim] = ()) -> Capacity:
    """What this process can use for its next job: host memory (WORKER_MEMORY_GB, else its cgroup's
    limit, else the machine's); GPU memory (WORKER_GPU_MEMORY_GB, else its GPU's free memory from
    NVML plus what this process itself holds there, which it gives back between jobs; none on a CPU
    host); disk (WORKER_DISK_GB, else the free space under its work directory plus what this worker's
    own earlier work directories, ``own_work``, take: it prunes or resumes them before the job runs;
    and what its caches' ``trims`` free on that filesystem: the job's resolve stage deletes it
    before the job writes anything)."""
    host = _host_memory(settings)
    gpu_bytes = _gib(settings.worker_gpu_memory_gb)
    if gpu_bytes is None and (memory := _bound_gpu()) is not None:
        gpu_bytes = memory.free_bytes + memory.own_bytes
    disk = _gib(settings.worker_disk_gb)
    if disk is None:
        scratch = settings.scratch_dir
        while not scratch.exists() and scratch != scratch.parent:
            scratch = scratch.parent
        disk = (shutil.disk_usage(scratch).free + (_tree_bytes(own_work) if own_work is not None else 0)
                + sum(trim.freed_on(scratch) for trim in trims))
    return Capacity(holder, host, gpu_bytes, disk)


def _tree_bytes(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def worker_refusal(estimate: ResourceEstimate, capacity: Capacity, request: ExportRequest) -> str | None:
    """Why this worker cannot run the job (None: it can)."""
    if not estimate.shortfalls(capacity):
        return None
    return too_big(estimate, capacity, request)
