"""Streaming weights: block-wise writes equal whole-tensor math; folds type data by its data."""

from __future__ import annotations

import io

import ml_dtypes
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


def test_bf16_to_fp16_rounds_every_bit_pattern_as_torch_does():
    bits = np.arange(1 << 16, dtype=np.uint16)  # every bf16 value: normals, subnormals, zeros, infs, NaNs
    ours = ckpt.bf16_bits_to_fp16(bits)
    theirs = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float16).numpy()
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    assert ours[~nan].view(np.uint16).tolist() == theirs[~nan].view(np.uint16).tolist()  # bits, signed zeros too


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.BFLOAT16])
def test_numpy_casts_equal_torch_casts(stored, dtype, tmp_path):
    torch.manual_seed(0)
    values = torch.cat([torch.randn(4000) * scale for scale in (1e-7, 1e-5, 0.02, 1.0, 3e4, 1e6)]).to(stored)
    save_file({"w": values.reshape(40, 600)}, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint(tmp_path)
    ours = ckpt.convert(checkpoint.array("w"), checkpoint.stored_dtype("w"), dtype)
    theirs = ckpt._to_numpy(values.reshape(40, 600), dtype)
    assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()


def test_tiled_transpose_equals_numpy_transpose(monkeypatch):
    monkeypatch.setattr(ckpt, "TRANSPOSE_TILE", 7)  # tiles that do not divide either side
    array = np.arange(23 * 45, dtype=np.uint16).reshape(23, 45)
    out = ckpt.transpose(array[:, 3:40])
    assert out.flags.c_contiguous and np.array_equal(out, array[:, 3:40].T)


@pytest.mark.parametrize("add", [0.0, 1.0])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.BFLOAT16])
def test_the_weight_gates_own_conversion_equals_torchs(stored, dtype, add, tmp_path):
    """The weight gate converts the source itself (numpy / ml_dtypes) to hold the stored bytes to
    the exact answer: every conversion it makes must be torch's (the exporter's and the
    reference's), bit for bit, over normals, subnormals and overflow."""
    from exporter.validation.gates.weights import converted

    torch.manual_seed(0)
    values = torch.cat([torch.randn(4000) * scale for scale in (1e-7, 1e-5, 0.02, 1.0, 3e4, 1e6)]).to(stored)
    save_file({"w": values.reshape(40, 600)}, str(tmp_path / "model.safetensors"))
    theirs = ckpt._to_numpy(values.reshape(40, 600).float() + add if add else values.reshape(40, 600), dtype)
    ours = converted(Checkpoint(tmp_path).array("w"), theirs.dtype, add)
    assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("transposed", [False, True])
def test_the_exact_test_takes_the_conversion_only_bit_for_bit_and_finite(source, transposed, monkeypatch):
    from exporter.validation.gates import weights

    checkpoint, arrays = source
    monkeypatch.setattr(weights, "EXACT_BLOCK_ELEMS", 20)  # two rows per block: many blocks
    parts = ({"tensor": "q", "rows": None}, {"tensor": "fused", "rows": [4, 9]})
    stored = np.concatenate([arrays["q"], arrays["fused"][4:9]]).astype(np.float16)
    stored = np.ascontiguousarray(stored.T) if transposed else stored

    def exact(out, storage=np.dtype(np.float16)):
        return [weights._exact_part(out, transposed, offset, checkpoint, part, storage)
                for offset, part in ((0, parts[0]), (12, parts[1]))]

    assert exact(stored) == [True, True]
    # The right bytes for another dtype than the build stores: not exact (bf16 weights in an fp16
    # build were rounded twice as coarsely as the build's bound allows; the statistics say so).
    as_bf16 = np.concatenate([arrays["q"], arrays["fused"][4:9]]).astype(ml_dtypes.bfloat16)
    as_bf16 = np.ascontiguousarray(as_bf16.T) if transposed else as_bf16
    assert exact(as_bf16) == [False, False] and exact(as_bf16, as_bf16.dtype) == [True, True]
    nudged = stored.copy()
    element = (7, 14) if transposed else (14, 7)  # row 2 of the fused part, column 7
    nudged.view(np.uint16)[element] += 1  # one fp16 step
    assert exact(nudged) == [True, False]
    # The source's own overflow: converted faithfully (inf), which is still no weight.
    overflowing = {"tensor": "k", "rows": None}
    big = np.full((6, 10), np.inf, dtype=np.float16)
    monkeypatch.setattr(checkpoint, "array", lambda name: np.full((6, 10), 0x4780, dtype=np.uint16))  # bf16 65536
    assert not weights._exact_part(big.T.copy() if transposed else big, transposed, 0, checkpoint, overflowing,
                                   np.dtype(np.float16))
    assert weights.converted(checkpoint.array("k"), np.dtype(np.float16)).view(np.uint16)[0, 0] == 0x7C00


def test_shards_in_a_subfolder_are_read_from_where_the_index_names_them(checkpoint, tmp_path):
    """A model.safetensors.index.json naming ``sub/model-00001-of-00001.safetensors`` while another
    model's weights lie in a top-level file of that name: the export takes the sub/ weights (the gate
    holds it to the model they came from), and the gate, reading this checkpoint, fails the export of
    the top-level weights."""
    from safetensors import safe_open

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.tiny_checkpoint import shards_in_subfolder
    from exporter.validation.gates.weights import weight_integrity

    own, decoy = checkpoint("llama"), checkpoint("llama", seed=1)
    source = shards_in_subfolder(own, tmp_path / "ckpt", decoy)
    loaded = Checkpoint(source)
    with safe_open(str(source / "sub" / "model-00001-of-00001.safetensors"), framework="numpy") as handle:
        names = list(handle.keys())
        for name in names:
            np.testing.assert_array_equal(loaded.array(name), handle.get_tensor(name), err_msg=name)
    assert loaded.names() == sorted(names)

    def export(model, out):
        request = ExportRequest(model=str(model), dtype="fp32", ep="cpu", variant="attn_dynamic")
        return export_model(request, tmp_path / out, validate=False)

    def gate(result, against) -> list[str]:
        results, _ = weight_integrity(result.out_dir / "model.onnx", result.manifest.data, Checkpoint(against),
                                      "fp32", "fp32")
        return [f"{r.check}: {r.message}" for r in results if not r.passed]

    assert gate(export(source, "ours"), own) == []
    assert gate(export(decoy, "decoys"), source)  # another model's weights never pass for this checkpoint
