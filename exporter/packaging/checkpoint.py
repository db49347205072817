"""Lazy access to a checkpoint's safetensors, and initializers that stream from them.

Nothing here holds a whole state dict. ``Checkpoint`` maps tensor names to memory-mapped
safetensors files; ``CheckpointTensor`` is an onnx-ir lazy tensor whose data is a recipe over
checkpoint tensors (row slices, concatenation along rows, an optional transpose, a dtype cast).
``tofile`` writes that recipe in bounded blocks, so exporting a model needs memory for one block,
not for one tensor and certainly not for the model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporter.errors import ExportError

# Upper bound on the bytes one read/convert/write block holds.
BLOCK_BYTES = 32 * 1024 * 1024

_TORCH_DTYPES = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
}


class Checkpoint:
    """The safetensors of one checkpoint directory, sharded or not, opened lazily (mmap)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ExportError(f"{directory} has no *.safetensors files: export needs safetensors weights")
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map", {})
            missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
            if missing:
                raise ExportError(f"{index_path.name} names shards that are not there: {', '.join(missing)}")
            files = sorted({directory / f for f in weight_map.values()})
        self._handles = {}
        self._where: dict[str, str] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types for bad headers/sizes
                raise ExportError(f"{path.name} is not a readable safetensors file ({err}): re-download it") from None
            # safe_open checks that the header's offsets cover the file exactly (truncation).
            for name in handle.keys():
                self._where[name] = path.name
            self._handles[path.name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise ExportError(f"checkpoint has no tensor {name!r}: is config.json from this checkpoint?")
        return self._handles[self._where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None):
        """Rows [a, b) (or all) of one tensor as a torch tensor in its stored dtype."""
        sl = self._slice(name)
        try:
            return sl[rows[0] : rows[1]] if rows else sl[:]
        except Exception as err:
            raise ExportError(f"cannot read tensor {name} from {self._where[name]} ({err}): re-download it") from None


@dataclasses.dataclass(frozen=True)
class WeightPart:
    """Rows [rows[0], rows[1]) of checkpoint tensor ``name`` (all rows when ``rows`` is None),
    plus ``add`` (in fp32, before the cast): Gemma's norms scale by ``1 + weight``."""

    name: str
    rows: tuple[int, int] | None = None
    add: float = 0.0


def _to_numpy(tensor, dtype: ir.DataType) -> np.ndarray:
    import torch

    converted = tensor.to(getattr(torch, _TORCH_DTYPES[dtype])).contiguous()
    if dtype is ir.DataType.BFLOAT16:
        return converted.view(torch.int16).numpy().view(dtype.numpy())
    return converted.numpy()


class CheckpointTensor(ir.LazyTensor):
    """An initializer computed from checkpoint tensors: concat(parts, rows), maybe transposed, cast.

    The recipe is kept (``parts``, ``transposed``) so folds can compose recipes without reading
    data, and so validation can check every slice of a packed tensor against its source.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        parts: tuple[WeightPart, ...],
        dtype: ir.DataType,
        *,
        transposed: bool = False,
        name: str | None = None,
    ):
        self.checkpoint = checkpoint
        self.parts = tuple(parts)
        self.transposed = transposed
        shapes = [self._part_shape(p) for p in self.parts]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"cannot concatenate {shapes} along rows for {name}")
        logical = (sum(s[0] for s in shapes), *shapes[0][1:])
        if transposed:
            if len(logical) != 2:
                raise ValueError(f"only 2-D tensors can be transposed, {name} is {logical}")
            logical = (logical[1], logical[0])
        super().__init__(self._materialize, dtype=dtype, shape=ir.Shape(logical), name=name)

    def _part_shape(self, part: WeightPart) -> tuple[int, ...]:
        shape = self.checkpoint.shape(part.name)
        if part.rows is None:
            return shape
        return (part.rows[1] - part.rows[0], *shape[1:])

    def with_recipe(self, *, parts=None, transposed=None, name=None) -> CheckpointTensor:
        return CheckpointTensor(
            self.checkpoint,
            self.parts if parts is None else parts,
            self.dtype,
            transposed=self.transposed if transposed is None else transposed,
            name=name or self.name,
        )

    def blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, block) pairs covering the output: row offset, or column offset if transposed."""
        offset = 0
        for part in self.parts:
            shape = self._part_shape(part)
            start = part.rows[0] if part.rows else 0
            row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
            step = max(1, BLOCK_BYTES // row_bytes)
            for r0 in range(0, shape[0], step):
                r1 = min(shape[0], r0 + step)
                source = self.checkpoint.read(part.name, (start + r0, start + r1))
                if part.add:
                    source = source.float() + part.add
                block = _to_numpy(source, self.dtype)
                yield offset + r0, (block.T if self.transposed else block)
            offset += shape[0]

    def _materialize(self) -> ir.Tensor:
        out = np.empty(self.shape.numpy(), dtype=self.dtype.numpy())
        for offset, block in self.blocks():
            if self.transposed:
                out[:, offset : offset + block.shape[1]] = block
            else:
                out[offset : offset + block.shape[0]] = block
        return ir.Tensor(out, name=self.name)

    def tofile(self, file) -> None:
        if not self.transposed:
            for _, block in self.blocks():
                file.write(np.ascontiguousarray(block).tobytes())
            return
        # Transposed: each source row block is an output column block, written row by row.
        base = file.tell()
        n_rows, n_cols = self.shape.numpy()
        itemsize = int(self.dtype.itemsize)
        for offset, block in self.blocks():
            block = np.ascontiguousarray(block)
            for r in range(n_rows):
                file.seek(base + (r * n_cols + offset) * itemsize)
                file.write(block[r].tobytes())
        file.seek(base + n_rows * n_cols * itemsize)

    def source_summary(self) -> dict:
        """The recipe, for the manifest and for the weight-integrity check."""
        return {
            "parts": [{"tensor": p.name, "rows": list(p.rows) if p.rows else None, **({"add": p.add} if p.add else {})}
                      for p in self.parts],
            "transposed": self.transposed,
        }
