"""Lazy access to a checkpoint's safetensors, and initializers that stream from them.

Nothing here holds a whole state dict. ``Checkpoint`` maps tensor names to memory-mapped
safetensors files; ``CheckpointTensor`` is an onnx-ir lazy tensor whose data is a recipe over
checkpoint tensors (row slices, concatenation along rows, an optional transpose, a dtype cast).
``chunks`` yields that recipe in file order in bounded blocks, so exporting a model needs memory
for a few blocks, not for one tensor and certainly not for the model.

The common recipes (bf16 -> fp16, bf16 -> fp32, same dtype; any transpose) run in numpy on the
memory-mapped bytes: importing torch costs an export more than a second, and a transpose done in
cache-sized tiles is several times faster than torch's strided copy. Other casts (fp32 -> fp16,
an ``add``) go through torch, as before.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir

from exporter.errors import ExportError
from exporter.packaging import prequantized
from exporter.packaging.source_files import shard_names

# Upper bound on the bytes one read/convert/write block holds.
BLOCK_BYTES = 32 * 1024 * 1024

# Side of the square tiles a transpose copies at a time: 256 x 256 x 2 bytes stay in L2.
TRANSPOSE_TILE = 256

_TORCH_DTYPES = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
}
# safetensors dtype names -> numpy; bf16 is read as raw uint16 bits (numpy has no bfloat16).
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_STORED_IR_DTYPES = {"F32": ir.DataType.FLOAT, "F16": ir.DataType.FLOAT16, "BF16": ir.DataType.BFLOAT16}


def _read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts (8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class Checkpoint:
    """The safetensors of one checkpoint directory, sharded or not, opened lazily (mmap)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        # Each file by its path from the directory, the index's (sub/model-00001.safetensors), so that
        # a tensor's bytes are read from the file its header came from.
        files = shard_names(directory)
        if not files:
            raise ExportError(f"{directory} has no *.safetensors files: export needs safetensors weights")
        self._where: dict[str, str] = {}
        self._entries: dict[str, dict] = {}
        self._data_start: dict[str, int] = {}
        self._maps: dict[str, np.ndarray] = {}
        for file in files:
            path = directory / file
            try:
                # Only validates: safe_open checks that the header's offsets cover the file exactly
                # (truncation). The "numpy" framework reads headers without importing torch.
                with safe_open(str(path), framework="numpy") as handle:
                    names = list(handle.keys())
                header, self._data_start[file] = _read_header(path)
            except Exception as err:  # safetensors raises its own error types for bad headers/sizes
                raise ExportError(f"{file} is not a readable safetensors file ({err}): re-download it") from None
            for name in names:
                self._where[name] = file
                self._entries[name] = header[name]
        # A GPTQ / AWQ checkpoint's packed linears, shown as the float tensors they stand for
        # (prequantized.py); their own tensors are read through ``packed_codes``.
        self.prequantized = prequantized.checkpoint_format(directory)
        self.linears: dict[str, prequantized.PackedLinear] = {}
        self._packed_tensors: set[str] = set()
        if self.prequantized is not None:
            shapes = {name: tuple(entry["shape"]) for name, entry in self._entries.items()}
            self.linears = prequantized.find_linears(shapes, self.prequantized)
            if not self.linears:
                raise ExportError(f"config.json declares {self.prequantized.method} weights, but {directory.name} holds no "
                                  "packed linears (X.qweight / X.qzeros / X.scales): fix config.json's "
                                  "quantization_config or export the checkpoint the config came with")
            for linear in self.linears.values():
                if linear.tensor(".g_idx") in self._where:
                    prequantized.check_group_index(self.array(linear.tensor(".g_idx")), linear, self.prequantized)
                self._packed_tensors.update(linear.tensor(s) for s in prequantized.SUFFIXES)
            kinds = {self.stored_dtype(linear.tensor(".scales")) for linear in self.linears.values()}
            if len(kinds) > 1 or None in kinds:
                raise ExportError(f"the checkpoint's {self.prequantized.method} scales are stored as "
                                  f"{sorted(str(k) for k in kinds)}: the exporter imports one float dtype for all")
        # fp16, bf16 or fp32: what a MatMulNBits node must compute in to hold them exactly.
        self.packed_scales_dtype = next(iter(kinds)) if self.linears else None

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self.linears

    def floating_dtypes(self) -> set[ir.DataType]:
        """The dtypes the checkpoint's floating tensors are stored in (a packed linear's scales
        for a GPTQ / AWQ one)."""
        stored = {self.stored_dtype(name) for name in self.names() if name not in self.linears}
        stored |= {self.stored_dtype(linear.tensor(".scales")) for linear in self.linears.values()}
        return stored & {ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE}

    def names(self) -> list[str]:
        """Every tensor a graph can read: a packed linear as its ``X.weight``, not its parts."""
        return sorted((set(self._where) - self._packed_tensors) | set(self.linears))

    def _entry(self, name: str) -> dict:
        if name not in self._where:
            raise ExportError(f"checkpoint has no tensor {name!r}: is config.json from this checkpoint?")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.linears:
            return self.linears[name].n, self.linears[name].k
        return tuple(self._entry(name)["shape"])

    def stored_dtype(self, name: str) -> ir.DataType | None:
        """The tensor's dtype as stored (None for dtypes no initializer is made from); fp32 for a
        packed linear's values."""
        if name in self.linears:
            return ir.DataType.FLOAT
        return _STORED_IR_DTYPES.get(self._entry(name)["dtype"])

    def packed_codes(self, name: str, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Output rows [a, b) of packed linear ``name`` (``X.weight``): codes, zero points, scales."""
        q, zeros, scales = prequantized.codes(self.array, self.linears[name], self.prequantized, a, b)
        if self.packed_scales_dtype is ir.DataType.BFLOAT16:  # raw bits as read; their values for the callers
            scales = scales.view(ml_dtypes.bfloat16)
        return q, zeros, scales

    def packed_symmetric(self, name: str) -> bool:
        """Whether every zero point of packed linear ``name`` is the midpoint (2^(bits - 1)), the one
        MatMulNBits assumes when it is given none."""
        zeros = prequantized.zero_points(self.array, self.linears[name], self.prequantized)
        return bool(np.all(zeros == 1 << (self.prequantized.bits - 1)))

    def _packed(self, name: str) -> bool:
        return name in self.linears and name not in self._where

    def array(self, name: str) -> np.ndarray:
        """One tensor as a read-only view of the memory-mapped file (bf16: its raw uint16 bits); a
        packed linear's values decoded whole (fp32, 4 bytes a value: read blocks of one with ``rows``
        or ``columns``, which decode only the block)."""
        if self._packed(name):
            return self.rows(name, 0, self.linears[name].n)
        entry = self._entry(name)
        file = self._where[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ExportError(f"tensor {name} is stored as {entry['dtype']}, which the exporter does not read")
        if file not in self._maps:
            # A plain ndarray over the map (it keeps the map alive): np.memmap's slicing costs per call.
            self._maps[file] = np.memmap(self.directory / file, dtype=np.uint8, mode="r").view(np.ndarray)
        begin, end = (self._data_start[file] + o for o in entry["data_offsets"])
        return self._maps[file][begin:end].view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def rows(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of one tensor: a view of the memory-mapped file, or a packed linear's output
        rows decoded alone (decoding the whole linear to read a block of it, as ``array`` once did,
        held 18 times a block of a packed LM head's vocabulary rows)."""
        if self._packed(name):
            return prequantized.dequantized(*self.packed_codes(name, a, b), self.prequantized.group_size)
        return self.array(name)[a:b]

    def columns(self, name: str, a: int, b: int) -> np.ndarray:
        """Columns [a, b) of a 2-D tensor (a transposed read's block): a view of the memory-mapped
        file, or a packed linear's input columns decoded alone."""
        if self._packed(name):
            q, zeros, scales = prequantized.input_codes(self.array, self.linears[name], self.prequantized, a, b)
            if self.packed_scales_dtype is ir.DataType.BFLOAT16:
                scales = scales.view(ml_dtypes.bfloat16)
            return prequantized.dequantized(q, zeros, scales, self.prequantized.group_size, first=a)
        return self.array(name)[:, a:b]

    def read(self, name: str, rows: tuple[int, int] | None = None):
        """Rows [a, b) (or all) of one tensor as a torch tensor in its stored dtype."""
        return _as_torch(self.rows(name, *rows) if rows else self.array(name), self.stored_dtype(name))


@dataclasses.dataclass(frozen=True)
class WeightPart:
    """Rows [rows[0], rows[1]) of checkpoint tensor ``name`` (all rows when ``rows`` is None),
    plus ``add`` (in fp32, before the cast): Gemma's norms scale by ``1 + weight``. ``expert``
    selects one slab of a 3-D tensor first (granitemoe's ``input_linear [experts, 2I, hidden]``), which
    ``transposed`` then reads transposed (gpt-oss keeps its experts as ``[experts, in, out]``)."""

    name: str
    rows: tuple[int, int] | None = None
    add: float = 0.0
    expert: int | None = None
    transposed: bool = False
    # MXFP4 (gpt-oss's experts): ``name`` is the ``_blocks`` tensor [experts, N, K / 32, 16] of packed
    # e2m1 codes, this its ``_scales`` [experts, N, K / 32] of e8m0 exponents; read as the fp32 values.
    mxfp4_scales: str | None = None

    def _slab(self, checkpoint: Checkpoint, name: str) -> np.ndarray:
        """Tensor ``name`` as stored, cut to this part's expert where it names one."""
        array = checkpoint.array(name)
        return array if self.expert is None else array[self.expert]

    def source(self, checkpoint: Checkpoint) -> np.ndarray:
        """The part's 2-D source as ``Checkpoint.array`` gives it (a view; rows not yet taken)."""
        array = self._slab(checkpoint, self.name)
        return array.T if self.transposed else array

    def stored(self, checkpoint: Checkpoint) -> ir.DataType | None:
        """The dtype ``read_rows`` gives: the stored one, fp32 for MXFP4 (its values, decoded)."""
        return ir.DataType.FLOAT if self.mxfp4_scales else checkpoint.stored_dtype(self.name)

    def read_rows(self, checkpoint: Checkpoint, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of ``source`` (counted from the part's first row), C-contiguous: a transposed
        part's columns copied in cache-sized tiles, MXFP4 blocks decoded."""
        start = self.rows[0] if self.rows else 0
        if self.mxfp4_scales:
            blocks, scales = (self._slab(checkpoint, n) for n in (self.name, self.mxfp4_scales))
            return mxfp4_values(blocks[start + a : start + b], scales[start + a : start + b])
        if not self.transposed:
            if self.expert is None:
                return checkpoint.rows(self.name, start + a, start + b)
            return self.source(checkpoint)[start + a : start + b]
        return transpose(self._slab(checkpoint, self.name)[:, start + a : start + b])

    def read_columns(self, checkpoint: Checkpoint, a: int, b: int) -> np.ndarray:
        """Columns [a, b) of ``source``, every row (a transposed read's block; a packed linear's
        columns decoded alone)."""
        if self.expert is None and not self.transposed:
            return checkpoint.columns(self.name, a, b)
        return self.source(checkpoint)[:, a:b]

    def shape(self, checkpoint: Checkpoint) -> tuple[int, ...]:
        shape = checkpoint.shape(self.name)
        if self.mxfp4_scales:  # [(experts,) N, K / 32, 16] bytes -> [(experts,) N, K]
            shape = (*shape[:-2], shape[-2] * shape[-1] * 2)
        if self.expert is not None:
            if len(shape) != 3 or not 0 <= self.expert < shape[0]:
                raise ExportError(f"{self.name} is {list(shape)}: it has no expert {self.expert}; is config.json "
                                  "from this checkpoint?")
            shape = shape[1:]
        if self.transposed:
            shape = tuple(reversed(shape))
        return shape if self.rows is None else (self.rows[1] - self.rows[0], *shape[1:])


# The 16 values of an e2m1 (FP4) code, low nibble first in each byte (OCP MX: sign, 2 exponent bits, 1 mantissa bit).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 rows as fp32: ``blocks`` [rows, K / 32, 16] bytes (two codes each, the low nibble first),
    ``scales`` [rows, K / 32] e8m0 (2^(s - 127) per block of 32) -> [rows, K]. Every value is exact
    in fp32 (and in bf16: two significant bits times a power of two)."""
    rows, groups, width = blocks.shape
    codes = np.empty((rows, groups, width * 2), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    exponents = scales.astype(np.int32) - 127
    return np.ldexp(E2M1_VALUES[codes], exponents[..., None]).reshape(rows, groups * width * 2)


def _as_torch(array: np.ndarray, stored: ir.DataType | None):
    """A block of ``Checkpoint.array`` as a torch tensor in its stored dtype (bf16 from its raw
    bits), copied off the read-only memory map: torch wants writable memory."""
    import torch

    copy = np.array(array)
    if stored is ir.DataType.BFLOAT16:
        return torch.from_numpy(copy.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(copy)


def _to_numpy(tensor, dtype: ir.DataType) -> np.ndarray:
    import torch

    converted = tensor.to(getattr(torch, _TORCH_DTYPES[dtype])).contiguous()
    if dtype is ir.DataType.BFLOAT16:
        return converted.view(torch.int16).numpy().view(dtype.numpy())
    return converted.numpy()


def bf16_bits_to_fp16(bits: np.ndarray) -> np.ndarray:
    """bf16 (raw uint16 bits) -> fp16 through ml_dtypes' bfloat16, which rounds to nearest even as
    torch does (tested on every bf16 bit pattern) without importing torch. Beyond fp16's range the
    result is inf, as torch's cast gives; the weight gate reports such a weight, so numpy's
    overflow warning is not printed on top of it."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(bits).view(ml_dtypes.bfloat16).astype(np.float16)


def convert(block: np.ndarray, stored: ir.DataType | None, dtype: ir.DataType, add: float = 0.0) -> np.ndarray:
    """A block of a checkpoint tensor (as ``Checkpoint.array`` gives it) cast to ``dtype``.

    Same dtype, bf16 -> fp16 and bf16 -> fp32 stay in numpy (exact, or rounded as torch rounds);
    every other cast, and ``add``, goes through torch as the reference does."""
    if not add and stored is dtype:
        return np.ascontiguousarray(block).view(dtype.numpy()) if dtype is ir.DataType.BFLOAT16 else block
    if not add and stored is ir.DataType.BFLOAT16 and dtype is ir.DataType.FLOAT16:
        return bf16_bits_to_fp16(block)
    if not add and stored is ir.DataType.BFLOAT16 and dtype is ir.DataType.FLOAT:
        return (block.astype(np.uint32) << np.uint32(16)).view(np.float32)
    tensor = _as_torch(block, stored)
    if add:
        tensor = tensor.float() + add
    return _to_numpy(tensor, dtype)


def transpose(array: np.ndarray) -> np.ndarray:
    """``array.T`` as a new C-contiguous array, copied in square tiles so both sides stay in cache."""
    rows, cols = array.shape
    out = np.empty((cols, rows), dtype=array.dtype)
    tile = TRANSPOSE_TILE
    for r0 in range(0, rows, tile):
        for c0 in range(0, cols, tile):
            out[c0 : c0 + tile, r0 : r0 + tile] = array[r0 : r0 + tile, c0 : c0 + tile].T
    return out


class CheckpointTensor(ir.LazyTensor):
    """An initializer computed from checkpoint tensors: concat(parts, rows), maybe transposed, cast.

    The recipe is kept (``parts``, ``transposed``) so folds can compose recipes without reading
    data, and so validation can check every slice of a packed tensor against its source.

    Mixture-of-experts weights add two things: ``interleave`` k takes the parts k at a time and
    interleaves their rows (k = 2: gate row j at 2j, up row j at 2j + 1, the fused SwiGLU layout
    of ORT's MoE ops), and ``experts`` E gives the result a leading experts dimension
    (``[E, rows / E, cols]``, the same bytes as the 2-D concatenation).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        parts: tuple[WeightPart, ...],
        dtype: ir.DataType,
        *,
        transposed: bool = False,
        name: str | None = None,
        interleave: int = 1,
        experts: int | None = None,
    ):
        self.checkpoint = checkpoint
        self.parts = tuple(parts)
        self.transposed = transposed
        self.interleave, self.experts = interleave, experts
        shapes = [self._part_shape(p) for p in self.parts]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"cannot concatenate {shapes} along rows for {name}")
        if len(self.parts) % interleave or any(
                len({shapes[g + j][0] for j in range(interleave)}) != 1 for g in range(0, len(shapes), interleave)):
            raise ValueError(f"cannot interleave {shapes} {interleave} at a time for {name}")
        logical = (sum(s[0] for s in shapes), *shapes[0][1:])
        if transposed:
            if len(logical) != 2 or interleave != 1 or experts:
                raise ValueError(f"only plain 2-D tensors can be transposed, {name} is {logical}")
            logical = (logical[1], logical[0])
        if experts:
            if len(logical) != 2 or logical[0] % experts:
                raise ValueError(f"{name}: {logical} does not split into {experts} experts")
            logical = (experts, logical[0] // experts, logical[1])
        super().__init__(self._materialize, dtype=dtype, shape=ir.Shape(logical), name=name)

    def _part_shape(self, part: WeightPart) -> tuple[int, ...]:
        return part.shape(self.checkpoint)

    def with_recipe(self, *, parts=None, transposed=None, name=None) -> CheckpointTensor:
        if self.interleave != 1 or self.experts:
            raise ValueError(f"{self.name}: an expert tensor's recipe is not folded further")
        return CheckpointTensor(
            self.checkpoint,
            self.parts if parts is None else parts,
            self.dtype,
            transposed=self.transposed if transposed is None else transposed,
            name=name or self.name,
        )

    def rows2d(self) -> int:
        """Rows of the 2-D view (the concatenated rows; experts times rows per expert)."""
        return sum(self._part_shape(p)[0] for p in self.parts)

    def blocks(self, block_bytes: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, block) pairs covering the output in order: row offset of the 2-D view (interleaved
        groups already interleaved), or column offset if transposed."""
        for offset, read in self.block_reads(block_bytes):
            yield offset, read()

    def block_reads(self, block_bytes: int | None = None) -> list[tuple[int, Callable[[], np.ndarray]]]:
        """``blocks`` as (offset, read) pairs, each ``read()`` reading and converting its block when
        called, on any thread: a caller may compute several blocks at once. A block holds at most
        about ``block_bytes`` (default ``BLOCK_BYTES``) as fp32."""
        reads = []
        offset = 0
        k = self.interleave
        for g in range(0, len(self.parts), k):
            group = self.parts[g : g + k]
            shape = self._part_shape(group[0])
            row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4 * k)
            step = max(1, (block_bytes or BLOCK_BYTES) // row_bytes)
            for r0 in range(0, shape[0], step):
                r1 = min(shape[0], r0 + step)
                at = offset + k * r0
                reads.append((at, functools.partial(self._read_block, group, r0, r1, shape[1:])))
            offset += k * shape[0]
        return reads

    def _read_block(self, group: tuple[WeightPart, ...], r0: int, r1: int, row_shape: tuple[int, ...]) -> np.ndarray:
        """Rows [r0, r1) of one group of parts, converted (and interleaved, or viewed transposed)."""
        pieces = [convert(p.read_rows(self.checkpoint, r0, r1), p.stored(self.checkpoint), self.dtype, p.add)
                  for p in group]
        if len(group) == 1:
            return pieces[0].T if self.transposed else pieces[0]
        # row j of each part, in turn: [r, k, cols] -> [r * k, cols]
        return np.stack(pieces, axis=1).reshape(len(group) * (r1 - r0), *row_shape)

    def chunks(self) -> Iterator[np.ndarray]:
        """The tensor's bytes in file order: C-contiguous blocks of at most about BLOCK_BYTES.

        A transposed tensor is produced output rows first (source columns), each block's columns
        gathered from every part with a tiled transpose, so the file is written in one forward
        pass with no seeks and can be hashed as it is written."""
        if not self.transposed:
            for _, block in self.blocks():
                yield np.ascontiguousarray(block)
            return
        n_rows, n_cols = (int(d) for d in self.shape.numpy())
        step = max(1, BLOCK_BYTES // (n_cols * 4))
        for c0 in range(0, n_rows, step):
            c1 = min(n_rows, c0 + step)
            pieces = []
            for part in self.parts:
                rows = part.rows or (0, self._part_shape(part)[0])
                source = part.read_columns(self.checkpoint, c0, c1)[rows[0] : rows[1]]
                stored = self.checkpoint.stored_dtype(part.name)
                pieces.append(np.ascontiguousarray(convert(transpose(source), stored, self.dtype, part.add)))
            yield pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)

    def _materialize(self) -> ir.Tensor:
        out = np.empty(self.shape.numpy(), dtype=self.dtype.numpy())
        flat, at = out.reshape(-1), 0
        for chunk in self.chunks():
            flat[at : at + chunk.size] = chunk.reshape(-1)
            at += chunk.size
        return ir.Tensor(out, name=self.name)

    def tofile(self, file) -> None:
        for chunk in self.chunks():
            file.write(chunk.reshape(-1).view(np.uint8))  # bytes as they are (bfloat16 has no buffer format)

    def source_summary(self) -> dict:
        """The recipe, for the manifest and for the weight-integrity check."""
        summary = {
            "parts": [{"tensor": p.name, "rows": list(p.rows) if p.rows else None, **({"add": p.add} if p.add else {}),
                       **({"expert": p.expert} if p.expert is not None else {}),
                       **({"transposed": True} if p.transposed else {}),
                       **({"mxfp4_scales": p.mxfp4_scales} if p.mxfp4_scales else {})}
                      for p in self.parts],
            "transposed": self.transposed,
        }
        if self.interleave != 1:
            summary["interleave"] = self.interleave
        if self.experts:
            summary["experts"] = self.experts
        return summary
