"""model.onnx + model.onnx.data, written in one forward pass and hashed as the bytes go out.

The layout is onnx-ir's (``ir.save(..., external_data=...)``): every initializer larger than
``INLINE_MAX_BYTES`` is packed densely into one file in declaration order, with location, offset
and length in model.onnx; the rest stay inline. Writing it here instead of through ``ir.save``
lets the file be produced in order (a transposed weight is gathered row block by row block, never
seeked into) and hashed while it is written, so the manifest's sha256 costs no second read.

Reading and converting (the caller's thread) overlap with writing and hashing (one writer
thread): numpy, ``write`` and ``sha256`` release the GIL, and the blocks between them sit in a
bounded queue, so the bytes in flight stay at a few blocks whatever the model size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporter.contract import DATA_FILE, MODEL_FILE, data_file

# onnx-ir's default ``size_threshold_bytes``: tensors up to this size stay in model.onnx.
INLINE_MAX_BYTES = 256
# Blocks waiting for the writer; with blocks of at most ~BLOCK_BYTES this bounds the bytes in flight.
QUEUE_BLOCKS = 3
# The blocks an in-memory tensor is written in (views of its bytes, not copies).
WRITE_BLOCK_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """A file as the manifest records it."""

    sha256: str
    size: int

    def to_dict(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}


class _HashingWriter:
    """Appends blocks to a file and to a sha256 on its own thread, fed through a bounded queue."""

    def __init__(self, path: Path):
        self._file = path.open("wb")
        self._digest = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BLOCKS)
        self._error: BaseException | None = None
        self.size = 0
        self._thread = threading.Thread(target=self._run, name="model.onnx.data writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._file.write(block)
                    self._digest.update(block)
                except BaseException as err:  # reported to the producer on its next put / close
                    self._error = err

    def write(self, data) -> int:
        """Queue ``data`` (bytes or a C-contiguous array); the writer owns it from here on."""
        if self._error is not None:
            raise self._error
        # A uint8 view: the buffer protocol has no format for bfloat16.
        block = memoryview(data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data).cast("B")
        self._queue.put(block)
        self.size += block.nbytes
        return block.nbytes

    def close(self) -> WrittenFile:
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._error is not None:
            raise self._error
        return WrittenFile(self._digest.hexdigest(), self.size)

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        self._queue.put(None)
        self._thread.join()
        self._file.close()


class _SequentialFile:
    """What a tensor's own ``tofile`` sees: a file that only appends (no seek, no read)."""

    def __init__(self, writer: _HashingWriter):
        self._writer = writer

    def write(self, data) -> int:
        # tofile implementations may reuse their buffer after write returns: queue a copy.
        return self._writer.write(data if isinstance(data, bytes) else bytes(memoryview(data).cast("B")))


def external_values(model: ir.Model) -> list[ir.Value]:
    """The initializers that go to the data file, in the order onnx-ir would write them."""
    return [value for graph in model.graphs() for value in graph.initializers.values()
            if value.const_value is not None and value.const_value.nbytes > INLINE_MAX_BYTES]


def write_model_files(model: ir.Model, out_dir: Path, on_bytes: Callable[[int], None] | None = None,
                      model_file: str = MODEL_FILE) -> WrittenFile:
    """Write ``out_dir / model.onnx`` and ``out_dir / model.onnx.data`` (``model_file`` and its ``.data``: an
    image-text export's vision.onnx, embedding.onnx); returns the data file's sha256 and size.

    The model is left as it was (its initializers keep their lazy tensors)."""
    out_dir = Path(out_dir)
    values = external_values(model)
    data_name = DATA_FILE if model_file == MODEL_FILE else data_file(model_file)
    writer = _HashingWriter(out_dir / data_name)
    externals = []
    try:
        for value in values:
            tensor = value.const_value
            offset = writer.size
            write_tensor(tensor, writer)
            if writer.size - offset != tensor.nbytes:
                raise RuntimeError(f"{tensor.name} wrote {writer.size - offset} bytes, expected {tensor.nbytes}")
            externals.append(ir.ExternalTensor(data_name, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                               name=tensor.name, base_dir=os.fspath(out_dir)))
            if on_bytes:
                on_bytes(tensor.nbytes)
    except BaseException:
        writer.abort()
        raise
    data = writer.close()
    originals = [value.const_value for value in values]
    try:
        for value, external in zip(values, externals):
            value.const_value = external
        ir.save(model, out_dir / model_file)  # external tensors are referenced, not copied
    finally:
        for value, original in zip(values, originals):
            value.const_value = original
    return data


def write_tensor(tensor: ir.TensorProtocol, writer: _HashingWriter) -> None:
    """Stream one tensor: its blocks in order, or its own ``tofile`` onto an append-only file."""
    chunks = getattr(tensor, "chunks", None)
    if chunks is not None:  # CheckpointTensor: fresh C-contiguous blocks in output order
        for block in chunks():
            writer.write(block)
    elif (array := _in_memory_bytes(tensor)) is not None:
        # A computed array (rope tables, folded constants): views of its bytes, a block at a time.
        # ir.Tensor.tofile hands over a copy of the whole (tobytes), and the queue holds several.
        for start in range(0, array.size, WRITE_BLOCK_BYTES):
            writer.write(array[start : start + WRITE_BLOCK_BYTES])
    else:  # quantized weights: their own tofile onto an append-only file
        tensor.tofile(_SequentialFile(writer))


def _in_memory_bytes(tensor: ir.TensorProtocol) -> np.ndarray | None:
    """An in-memory tensor's bytes as a flat uint8 view, where they are its numpy array's as it is
    (C order, whole bytes per element, little-endian); else None."""
    raw = tensor.raw if isinstance(tensor, ir.Tensor) else None
    if (not isinstance(raw, np.ndarray) or raw.dtype != tensor.dtype.numpy() or tensor.dtype.bitwidth % 8
            or not raw.flags.c_contiguous or raw.dtype.byteorder == ">"):
        return None
    return raw.reshape(-1).view(np.uint8)
