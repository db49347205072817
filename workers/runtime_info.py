"""What a worker runs on: onnxruntime, CUDA and GPU versions, reported to the catalog."""

from __future__ import annotations

import dataclasses
import socket


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    hostname: str
    onnxruntime: str
    cuda: str | None
    gpu: str | None
    providers: tuple[str, ...]


def _gpu_name() -> str | None:
    """The GPU this worker is bound to (exporter.runtime.device), with the driver's version."""
    try:
        import pynvml  # nvidia-ml-py, present on GPU images only
    except ImportError:
        return None
    from exporter.errors import ExportError
    from exporter.runtime.device import cuda_device, device_memory

    try:
        memory = device_memory(cuda_device())
    except ExportError:
        return None
    if memory is None:
        return None
    try:
        pynvml.nvmlInit()
        try:
            name = memory.name
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    name = name.decode() if isinstance(name, bytes) else name
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return f"{name} (driver {driver})"


def _cuda_version(providers: tuple[str, ...]) -> str | None:
    """The CUDA version the driver provides (NVML), else torch's build; None without a CUDA EP.

    Workers install a CPU build of torch, so torch alone would report no CUDA on a GPU node.
    """
    if "CUDAExecutionProvider" not in providers:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetCudaDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # no NVML (or no driver): fall back to what torch was built with
        pass
    try:
        import torch

        return torch.version.cuda or "unknown"
    except ImportError:
        return "unknown"


def runtime_info(hostname: str | None = None) -> RuntimeInfo:
    import onnxruntime

    providers = tuple(onnxruntime.get_available_providers())
    return RuntimeInfo(
        hostname=hostname or socket.gethostname(),
        onnxruntime=onnxruntime.__version__,
        cuda=_cuda_version(providers),
        gpu=_gpu_name(),
        providers=providers,
    )
