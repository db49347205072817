"""The files of a checkpoint directory an export reads, and the one guard every read goes through.

An export reads config.json and the safetensors shards, and publishes the generation defaults and
the tokenizer files beside the model (the genai package, the hf layout). Each is opened through
``checkpoint_file``: a name that climbs out of the checkpoint, or a link that leads out of it (a
generation_config.json linked to /proc/self/environ would publish the worker's environment), is
refused. A shard is found where the index names it, relative to the checkpoint (``shard_names``),
by everything that reads one. The same lists say what a local checkpoint's revision covers
(``source_file_names``), so no file an export reads or publishes is left out of its cache key.

Standard library only: the API fingerprints a local checkpoint on every request.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from exporter.errors import ExportError

SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Tokenizer files a checkpoint may carry; copied (their sha256 lands in the manifest), a genai
# package's tokenizer_config.json then given the special-token flags genai reads (align_special_tokens).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
TOKENIZER_GLOBS = ("*.tiktoken",)


def confinement(directory: Path) -> Path:
    """The directory a checkpoint's files must really be in: the checkpoint's own, or for a
    Hugging Face cache snapshot (``models--org--name/snapshots/<sha>``, whose files are links to
    ``../../blobs``) the repository's cache folder."""
    real = Path(directory).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def checkpoint_file(directory: Path, name: str, required: bool = True) -> Path | None:
    """``directory / name`` where it is a regular file really inside the checkpoint (``confinement``):
    a name that climbs out (``..``, an absolute path) or a link that leads out of it (a tokenizer.json
    linked to /proc/self/environ would be published with the export) is refused. None where the
    file is absent and not ``required``."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ExportError(f"{name!r} is not a file name inside the checkpoint: a checkpoint names its own files only")
    path = Path(directory) / relative
    if not path.exists() and not path.is_symlink():
        if required:
            raise ExportError(f"{Path(directory).name} has no {name}")
        return None
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise ExportError(f"{name} in {Path(directory).name} is a broken or looping link: replace it with the file")
    if not real.is_relative_to(confinement(directory)):
        raise ExportError(f"{name} in {Path(directory).name} leads outside the checkpoint (to {real.parent}): a "
                          "checkpoint's files must be inside its directory; copy the file in instead of linking it")
    if not real.is_file():
        raise ExportError(f"{name} in {Path(directory).name} is not a regular file")
    return path


def shard_names(directory: Path) -> list[str]:
    """The checkpoint's safetensors files as paths relative to ``directory`` (sorted): those
    model.safetensors.index.json maps tensors to, else every top-level ``*.safetensors``. An index's
    name is a path from the checkpoint directory (hub repositories ship ``sub/model-00001.safetensors``),
    read whole, never by its base name, and passes ``checkpoint_file``; a shard it names that is not
    there is refused."""
    directory = Path(directory)
    index = checkpoint_file(directory, SAFETENSORS_INDEX, required=False)
    if index is None:
        return [path.name for path in sorted(directory.glob("*.safetensors"))]
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ExportError(f"{SAFETENSORS_INDEX} has no weight_map of tensor names to shard files: re-download it")
    # "./sub//x" and "sub/x" are one file; ".." is kept, for checkpoint_file to refuse
    names = sorted({str(PurePosixPath(name)) for name in weight_map.values()})
    missing = [name for name in names if checkpoint_file(directory, name, required=False) is None]
    if missing:
        raise ExportError(f"{SAFETENSORS_INDEX} names shards that are not there: {', '.join(missing)}")
    return names


def tokenizer_file_names(directory: Path) -> list[str]:
    """The tokenizer files in ``directory`` (sorted). A name counts where anything is there, a
    dangling link or a pipe included, so that ``checkpoint_file`` refuses it by name instead of a
    test for a regular file passing it over in silence."""
    directory = Path(directory)
    names = {name for name in TOKENIZER_FILES if (directory / name).exists() or (directory / name).is_symlink()}
    for pattern in TOKENIZER_GLOBS:
        names.update(path.name for path in directory.glob(pattern))
    return sorted(names)


def side_file_names(directory: Path) -> list[str]:
    """What packaging publishes from the checkpoint beside the model: generation_config.json (where
    there) and the tokenizer files (sorted)."""
    directory = Path(directory)
    generation = (directory / GENERATION_CONFIG_FILE).exists() or (directory / GENERATION_CONFIG_FILE).is_symlink()
    return sorted({*tokenizer_file_names(directory), *([GENERATION_CONFIG_FILE] if generation else [])})


def source_file_names(directory: Path) -> list[str]:
    """Every file of ``directory`` an export reads or publishes, relative to it (sorted): the
    top-level JSON files (config.json, the index, the tokenizer's), every top-level safetensors and
    the shards the index names, and the side files. What a local checkpoint's revision covers."""
    directory = Path(directory)
    top = {path.name for path in directory.iterdir() if path.suffix in (".json", ".safetensors")}
    return sorted(top | set(shard_names(directory)) | set(side_file_names(directory)))
