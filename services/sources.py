"""Which checkpoint a request means, and its exact revision (part of the cache key).

A model is either a hub id (``org/name[@revision]``) or the name of a directory under the
``MODELS_DIR`` setting. Requests never name arbitrary server paths.
"""

from __future__ import annotations

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


def resolve_revision(settings: Settings, model: str) -> str:
    """The exact revision of ``model`` now: a local fingerprint, a hub commit, or the asked ref."""
    check_model_id(model)
    local = local_model_dir(settings, model)
    if local is not None:
        return f"local-{local_fingerprint(local)}"
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
