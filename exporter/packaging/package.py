"""Stage 4: write model.onnx + model.onnx.data (streamed) and the manifest that vouches for them."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import uuid
from pathlib import Path

import onnx_ir as ir

from exporter.packaging.checkpoint import CheckpointTensor
from exporter.packaging.external_data import write_model_files
from exporter.graph.passes.quantize import QuantizedPart
from exporter.request import ExportRequest, Variant, cache_key
from exporter.packaging.resolve import ResolvedSource
from exporter.versions import runtime_versions

from exporter.contract import BUILDER_HAND, DATA_FILE, MANIFEST_FILE, MODEL_FILE, PADDING  # noqa: F401  (the files this writes)
from exporter.contract import MANIFEST_CACHE, META_CONFIG, VALUE_HEAD_DIM, split_cache, value_head_dim
MANIFEST_SCHEMA = 1


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


def write_model(model: ir.Model, out_dir: Path, on_bytes=None) -> dict[str, dict]:
    """Save with all weights in one external file (onnx-ir's layout), streamed in one forward pass.

    Returns the manifest entry of model.onnx.data, hashed while it was written, so that
    ``build_manifest`` need not read a gigabyte back to vouch for it.
    """
    return {DATA_FILE: write_model_files(model, out_dir, on_bytes).to_dict()}


def _value_io(value: ir.Value) -> dict:
    dims = [d if isinstance(d, int) else str(d) for d in value.shape] if value.shape is not None else None
    return {"name": value.name, "dtype": value.dtype.name if value.dtype else None, "shape": dims}


def op_census(model: ir.Model) -> dict[str, int]:
    census = collections.Counter(
        f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)
    )
    return dict(sorted(census.items()))


def initializer_sources(model: ir.Model) -> dict[str, dict]:
    """Where each weight came from: checkpoint tensors, row ranges, transposition (for validation)."""
    sources = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        entry = {"dtype": tensor.dtype.name, "shape": list(tensor.shape.numpy())}
        if isinstance(tensor, (CheckpointTensor, QuantizedPart)):
            entry.update(tensor.source_summary())
        else:
            entry["computed"] = True
        sources[name] = entry
    return sources


@dataclasses.dataclass
class Manifest:
    data: dict

    def add_files(self, out_dir: Path, names: list[str]) -> None:
        """Record files written after packaging (reports, benchmark, diff) with their sha256 and size."""
        for name in names:
            self.data["files"][name] = file_entry(Path(out_dir) / name)

    def write(self, out_dir: Path) -> Path:
        path = out_dir / MANIFEST_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(path)  # a manifest is either whole or absent
        return path


def build_manifest(
    model: ir.Model,
    out_dir: Path,
    request: ExportRequest,
    variant: Variant,
    source: ResolvedSource,
    timings: dict[str, float],
    extra_files: list[str] = (),
    export_id: str | None = None,
    written: dict[str, dict] | None = None,
    builder: dict | None = None,
) -> Manifest:
    """The manifest of a packaged export; ``written`` holds entries of files hashed as they were written;
    ``builder``: who built the graph and its version (exportfarm's own graphs where None)."""
    versions = runtime_versions()
    written = written or {}
    files = {name: written.get(name) or file_entry(out_dir / name) for name in (MODEL_FILE, DATA_FILE, *extra_files)}
    data = {
        "schema": MANIFEST_SCHEMA,
        "export_id": export_id or uuid.uuid4().hex,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "request": request.to_dict(),
        "variant": variant.value,
        "builder": builder or {"name": BUILDER_HAND, "version": versions["exporter"]},
        "padding": dict(PADDING[variant.value]),
        "source": source.to_dict(),
        "cache_key": cache_key(request, source.revision, versions["exporter"], versions["onnxruntime"]),
        "versions": versions,
        "opset_imports": dict(model.opset_imports),
        "op_census": op_census(model),
        "node_count": sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph)),
        "graph": {
            "inputs": [_value_io(v) for v in model.graph.inputs],
            "outputs": [_value_io(v) for v in model.graph.outputs],
        },
        "initializers": initializer_sources(model),
        "weight_bytes": sum(v.const_value.nbytes for v in model.graph.initializers.values()),
        "files": files,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    config = json.loads(model.metadata_props.get(META_CONFIG) or "{}")
    if split_cache(config):  # keys and values of two head sizes: what a runtime must allocate, said where it reads
        data[MANIFEST_CACHE] = {"num_kv_heads": config["num_kv_heads"], "head_dim": config["head_dim"],
                                VALUE_HEAD_DIM: value_head_dim(config)}
    return Manifest(data)


def add_files_to_manifest(out_dir: Path, names: list[str], extra: dict | None = None) -> Manifest:
    """Record files written after packaging (benchmark, ...) in the manifest, rewriting it whole."""
    path = out_dir / MANIFEST_FILE
    data = json.loads(path.read_text())
    for name in names:
        data["files"][name] = file_entry(out_dir / name)
    data.update(extra or {})
    manifest = Manifest(data)
    manifest.write(out_dir)
    return manifest
