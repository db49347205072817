"""Which GPU this process works on: one worker per GPU, each bound to its device.

A worker process is bound to one CUDA device index (the farm's ``GPU_DEVICE`` setting, the CLI's
``--gpu``), kept in the process environment as ``EXPORTFARM_GPU_DEVICE`` so that every session this
process and its children make lands there: the export's validation and benchmark sessions, the
runtime probe, the streamed reference's tensors, and the device-memory figure the resource estimate
reads. The index counts the devices this process can see (``CUDA_VISIBLE_DEVICES``, or what a
Kubernetes device plugin gives a pod: there a pod's one GPU is index 0).

``claim_device`` makes the binding exclusive on a host: a second worker bound to the same device
is refused at start instead of sharing the GPU's memory and kernels with the first.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from exporter.errors import ExportError

DEVICE_ENV = "EXPORTFARM_GPU_DEVICE"


def cuda_device() -> int:
    """The CUDA device index this process is bound to (0 when unbound)."""
    value = os.environ.get(DEVICE_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ExportError(f"{DEVICE_ENV}={value!r} is not a device index: set it to 0, 1, ... (or leave it unset)")
    return int(value)


def bind_cuda_device(index: int | None) -> None:
    """Bind this process (and the processes it starts) to device ``index``; None unbinds."""
    if index is None:
        os.environ.pop(DEVICE_ENV, None)
        return
    if index < 0:
        raise ExportError(f"a GPU device index is 0 or more, not {index}")
    os.environ[DEVICE_ENV] = str(index)
    # CUDA numbers devices fastest first by default, NVML by PCI bus: one order for both, so the
    # device whose memory the estimate reads is the one the sessions run on.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def cuda_provider(**options: str) -> tuple[str, dict[str, str]]:
    """ONNX Runtime's CUDA execution provider on the bound device, with ``options``."""
    return "CUDAExecutionProvider", {"device_id": str(cuda_device()), **options}


def _visible_entry(index: int) -> str:
    """How NVML names the ``index``-th visible device: a physical index or a GPU UUID (NVML itself
    ignores CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ExportError(f"GPU {index} is bound, but CUDA_VISIBLE_DEVICES={visible!r} shows {len(entries)} device(s)")
    return entries[index]


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    own_bytes: int = 0  # what this process holds on it (NVML's per-process figure, where it has one)


def device_memory(index: int | None = None) -> DeviceMemory | None:
    """Total and free memory of the bound (or ``index``-th visible) GPU from NVML; None where there
    is no NVML (no nvidia-ml-py, no driver): a CPU host."""
    try:
        import pynvml
    except ImportError:
        return None
    index = cuda_device() if index is None else index
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        entry = _visible_entry(index)
        handle = (pynvml.nvmlDeviceGetHandleByUUID(entry) if entry.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(entry)))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
        own = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                  if p.pid == os.getpid())
    except pynvml.NVMLError as err:
        raise ExportError(f"GPU {index} cannot be read through NVML ({err}): is it present on this host?") from None
    finally:
        pynvml.nvmlShutdown()
    text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731 (older bindings return bytes)
    return DeviceMemory(index, text(name), text(uuid), int(memory.total), int(memory.free), int(own))


class DeviceClaim:
    """An exclusive, host-wide hold on one GPU for this process's life (an flock on a file named
    after the device: its UUID where NVML can read one, else its index), released when the process
    ends however it ends."""

    def __init__(self, key: str, path: Path, handle):
        self.key, self.path, self._handle = key, path, handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def claim_device(index: int, lock_dir: Path | None = None) -> DeviceClaim:
    """Hold device ``index`` for this process; a second holder on the host is refused, naming the first."""
    from exporter.locks import Held, hold

    memory = device_memory(index)
    key = memory.uuid if memory is not None else f"index-{index}"
    directory = Path(lock_dir or os.environ.get("EXPORTFARM_LOCK_DIR") or
                     Path(tempfile.gettempdir()) / f"exportfarm-locks-{os.getuid()}")
    path = directory / f"exportfarm-gpu-{key}.lock"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = hold(path, f"pid {os.getpid()}")
    except Held as held:
        raise ExportError(f"GPU {index} ({key}) is already bound to {held.holder}: give each worker its own "
                          "GPU_DEVICE (one worker per GPU)") from None
    except OSError as err:
        raise ExportError(f"cannot lock GPU {index} at {path} ({err}): set EXPORTFARM_LOCK_DIR to a directory "
                          "this user owns") from None
    return DeviceClaim(key, path, handle)
