"""Stage 1: turn a request's ``model`` (local directory or hub id[@revision]) into local files."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from exporter.errors import ExportError
from exporter.packaging.source_files import source_file_names

# Files an export needs from a hub repository (weights, config, tokenizer, chat template, generation defaults).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    """Where a checkpoint's files are, and what exact version they are."""

    path: Path
    kind: str  # "local" | "hub"
    repo_id: str | None
    revision: str  # hub commit sha, or "local-<fingerprint>" for a directory

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "repo_id": self.repo_id, "revision": self.revision}


def local_fingerprint(directory: Path) -> str:
    """A content fingerprint of a local checkpoint without reading gigabytes of weights.

    Every file the export reads or publishes (``source_file_names``: config.json, the shards
    wherever the index puts them, generation_config.json, every tokenizer file and chat template)
    by name, size and modification time, the safetensors by their headers (names, dtypes, shapes,
    offsets) and the rest in full: editing any of them changes the revision, and so the cache key.
    A checkpoint with none of the files first covered here (side files, shards in a folder) keeps
    the revision it had.
    """
    digest = hashlib.sha256()
    for name in source_file_names(directory):
        path = directory / name
        if not path.is_file():
            continue
        stat = path.stat()
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        if path.suffix != ".safetensors":
            digest.update(path.read_bytes())
        else:
            with path.open("rb") as f:
                head = f.read(8)
                digest.update(head)
                if len(head) == 8:
                    digest.update(f.read(min(int.from_bytes(head, "little"), 100 << 20)))
    return digest.hexdigest()[:16]


def resolve_source(model: str) -> ResolvedSource:
    """Local directories are used in place; hub ids are downloaded (or found in the HF cache)."""
    candidate = Path(model).expanduser()
    if candidate.exists():
        if not candidate.is_dir():
            raise ExportError(f"{model} is a file: pass the checkpoint directory that holds config.json")
        directory = candidate.resolve()
        return ResolvedSource(directory, "local", None, f"local-{local_fingerprint(directory)}")
    if model.startswith((".", "/", "~")):
        raise ExportError(f"{model!r} is neither an existing directory nor a hub id like 'org/name[@revision]'")
    return resolve_hub_source(model)


def resolve_hub_source(model: str) -> ResolvedSource:
    """A hub id ``org/name[@revision]``, downloaded (or found in the HF cache); never a local path."""
    repo_id, _, revision = model.partition("@")
    if not _HUB_ID.fullmatch(repo_id) or ".." in repo_id:
        raise ExportError(f"{model!r} is not a hub id like 'org/name[@revision]'")
    return _download(repo_id, revision or None)


def _download(repo_id: str, revision: str | None) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from exporter import checkpoints

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        path = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline,
                              tqdm_class=checkpoints.hub_progress_class())  # every chunk: a checkpoint
        )
    except RevisionNotFoundError:
        raise ExportError(f"revision {revision!r} does not exist in {repo_id}: check the @revision") from None
    except GatedRepoError:
        raise ExportError(f"{repo_id} is gated: accept its license on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ExportError(f"hub repository {repo_id} not found (or private without HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise ExportError(
            f"cannot download {repo_id}: the Hugging Face hub is unreachable and the model is not in the local "
            "cache; pass a local checkpoint directory, or run where the hub is reachable"
        ) from None
    except Exception as err:  # network stacks raise many types; a user needs one actionable line
        if checkpoints.is_stop(err):
            raise  # the caller stopped the download (a cancel, a lost lease): not a download error
        raise ExportError(
            f"cannot download {repo_id} from the Hugging Face hub ({type(err).__name__}): "
            "check the network or pass a local checkpoint directory"
        ) from None
    # The snapshot folder is named after the resolved commit sha.
    return ResolvedSource(path, "hub", repo_id, path.name)
