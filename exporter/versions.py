"""Versions of everything that shapes an artifact, for the manifest and the cache key."""

from __future__ import annotations

import importlib.metadata
import platform

from exporter import __version__

PACKAGES = ("onnx", "onnx-ir", "onnxruntime", "onnxruntime-gpu", "torch", "transformers", "safetensors", "numpy")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ort_version() -> str:
    """The ONNX Runtime that will run (and so validates) the export: the one that imports."""
    import onnxruntime

    return onnxruntime.__version__


def runtime_versions() -> dict[str, str | None]:
    versions = {"exporter": __version__, "python": platform.python_version()}
    versions.update({name: package_version(name) for name in PACKAGES})
    versions["onnxruntime"] = ort_version()
    return versions
