"""Streaming weights: block-wise writes equal whole-tensor math; folds type data by its data."""

from __future__ import annotations

import io

import numpy as np
import onnx_ir as ir
import pytest
import torch
from safetensors.torch import save_file

from exporter.packaging import checkpoint as ckpt
from exporter.packaging.checkpoint import Checkpoint, CheckpointTensor, WeightPart
from exporter.graph.passes.dtype import initializer_dtype


@pytest.fixture
def source(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "q": torch.randn(12, 10, dtype=torch.bfloat16),
        "k": torch.randn(6, 10, dtype=torch.bfloat16),
        "fused": torch.randn(20, 10, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return Checkpoint(tmp_path), {k: v.float().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.BFLOAT16])
def test_block_writes_equal_whole_tensor(source, transposed, dtype, monkeypatch):
    checkpoint, arrays = source
    monkeypatch.setattr(ckpt, "BLOCK_BYTES", 3 * 10 * 4)  # three rows per block: many blocks
    parts = (WeightPart("q"), WeightPart("k"), WeightPart("fused", (4, 9)))
    tensor = CheckpointTensor(checkpoint, parts, dtype, transposed=transposed, name="w")
    expected = np.concatenate([arrays["q"], arrays["k"], arrays["fused"][4:9]])
    expected = (expected.T if transposed else expected).astype(dtype.numpy())
    assert tuple(tensor.shape.numpy()) == expected.shape
    buffer = io.BytesIO()
    buffer.write(b"prefix")  # tofile must write at the file's current position
    tensor.tofile(buffer)
    assert buffer.getvalue()[6:] == np.ascontiguousarray(expected).tobytes()
    np.testing.assert_array_equal(tensor.numpy(), expected)


def test_initializer_dtype_comes_from_the_data():
    data = ir.tensor(np.ones((2, 2), dtype=np.float16), name="w")
    value = ir.Value(name="w", const_value=data)
    value.type = ir.TensorType(ir.DataType.FLOAT)  # stale declared type, the bug class
    assert initializer_dtype(value) is ir.DataType.FLOAT16


def test_missing_tensor_names_the_tensor(source):
    from exporter.errors import ExportError

    checkpoint, _ = source
    with pytest.raises(ExportError, match="no tensor 'v'"):
        CheckpointTensor(checkpoint, (WeightPart("v"),), ir.DataType.FLOAT)
