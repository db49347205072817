"""Which checkpoint a request means, and its exact revision (part of the cache key).

A model is either a hub id (``org/name[@revision]``) or the name of a directory under the
``MODELS_DIR`` setting. Requests never name arbitrary server paths.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from exporter.errors import ExportError
from exporter.resolve import local_fingerprint
from services.settings import Settings

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?(@[A-Za-z0-9][A-Za-z0-9_./-]{0,99})?$")


def check_model_id(model: str) -> None:
    if not MODEL_ID.match(model) or ".." in model or "//" in model:
        raise ExportError(
            f"model {model!r} is not a hub id like 'org/name[@revision]' or a model directory name; "
            "paths, '..' and special characters are not accepted"
        )


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


def directory_signature(directory: Path) -> tuple:
    """Names, sizes and mtimes of a checkpoint's files: cheap to read, changes when any file does."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir() if p.is_file()))


@functools.lru_cache(maxsize=512)
def _fingerprint(directory: str, signature: tuple) -> str:
    return local_fingerprint(Path(directory))


def resolve_revision(settings: Settings, model: str) -> str:
    """The exact revision of ``model`` now: a local fingerprint, a hub commit, or the asked ref."""
    check_model_id(model)
    local = local_model_dir(settings, model)
    if local is not None:
        # Fingerprinting reads every safetensors header; do it once per version of the directory.
        return f"local-{_fingerprint(str(local), directory_signature(local))}"
    repo_id, _, revision = model.partition("@")
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id, revision=revision or None, timeout=5).sha
    except Exception:
        # Unreachable hub: the worker resolves it; identical requests still share this key.
        return f"unresolved-{revision or 'main'}"


def source_for_worker(settings: Settings, model: str, revision: str) -> str:
    """What the exporter should load: the local directory, or the hub id pinned to its commit."""
    local = local_model_dir(settings, model)
    if local is not None:
        return str(local)
    repo_id = model.partition("@")[0]
    if revision.startswith(("unresolved-", "local-")):
        return model
    return f"{repo_id}@{revision}"
