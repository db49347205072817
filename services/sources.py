"""Which checkpoint a request means, and its exact revision.

A model is either the name of a directory under MODELS_DIR (only there, never a path of the API's
or a worker's) or, when HUB_ACCESS is on, a hub id ``org/name[@revision]``. The API never goes to the
hub: a local checkpoint's revision is its fingerprint (cheap, read at request time), a hub id's is
the ref asked for until the worker downloads it and records the commit it got.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

from exporter.errors import ExportError
from exporter.packaging.resolve import local_fingerprint
from exporter.packaging.source_files import source_file_names
from services.settings import Settings

MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?(@[A-Za-z0-9][A-Za-z0-9_./-]{0,99})?")
COMMIT = re.compile(r"[0-9a-f]{40}")
UNRESOLVED_PREFIX = "ref-"


def check_model_id(model: str) -> None:
    if not MODEL_ID.fullmatch(model) or ".." in model or "//" in model:
        raise ExportError(
            f"model {model!r} is not a hub id like 'org/name[@revision]' or a model directory name; "
            "paths, '..', whitespace and special characters are not accepted"
        )


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a request's model comes from: a directory under MODELS_DIR, or the hub."""

    model: str
    directory: Path | None = None  # local
    repo_id: str | None = None  # hub
    ref: str | None = None

    @property
    def local(self) -> bool:
        return self.directory is not None


def local_model_dir(settings: Settings, model: str) -> Path | None:
    """The directory under MODELS_DIR that ``model`` names, if there is one."""
    if settings.models_dir is None or "@" in model:
        return None
    root = settings.models_dir.expanduser().absolute()
    # Lexical check: the name may not climb out; symlinks an operator put in MODELS_DIR are fine.
    candidate = Path(os.path.normpath(root / model))
    if root not in candidate.parents:
        raise ExportError(f"model {model!r} points outside the models directory")
    return candidate if (candidate / "config.json").is_file() else None


def locate_model(settings: Settings, model: str) -> ModelSource:
    """The source ``model`` names, or an ExportError saying what to change."""
    check_model_id(model)
    directory = local_model_dir(settings, model)
    if directory is not None:
        return ModelSource(model, directory=directory)
    if not settings.hub_access:
        where = f"under MODELS_DIR ({settings.models_dir})" if settings.models_dir else "(MODELS_DIR is not set)"
        raise ExportError(
            f"no model directory {model!r} {where}, and hub models are off: put the checkpoint under "
            "MODELS_DIR, or set HUB_ACCESS=true to export hub ids")
    repo_id, _, ref = model.partition("@")
    return ModelSource(model, repo_id=repo_id, ref=ref or "main")


def directory_signature(directory: Path) -> tuple:
    """Names, sizes and mtimes of the checkpoint files its revision covers (``source_file_names``:
    shards in a folder the index names too): cheap to read, changes when any of them does."""
    files = ((name, directory / name) for name in source_file_names(directory))
    return tuple((name, p.stat().st_size, p.stat().st_mtime_ns) for name, p in files if p.is_file())


@functools.lru_cache(maxsize=512)
def _fingerprint(directory: str, signature: tuple) -> str:
    return local_fingerprint(Path(directory))


def request_revision(source: ModelSource) -> str:
    """The revision a request is keyed on now: a local fingerprint, a pinned commit, or the ref asked
    for (``ref-main``), which the worker replaces with the commit it downloads."""
    if source.local:
        # Fingerprinting reads every safetensors header; do it once per version of the directory.
        return f"local-{_fingerprint(str(source.directory), directory_signature(source.directory))}"
    if COMMIT.fullmatch(source.ref):
        return source.ref
    return f"{UNRESOLVED_PREFIX}{source.ref}"
