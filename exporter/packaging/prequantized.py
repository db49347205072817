"""Checkpoints already quantized by GPTQ or AWQ: their packed linears, read as codes.

A GPTQ or AWQ checkpoint (transformers' ``quantization_config`` ``quant_method`` "gptq" / "awq", the
layouts AutoGPTQ, AutoAWQ and GPTQModel write) stores each quantized linear ``X`` as ``X.qweight``
(int32 words of packed codes), ``X.qzeros`` (int32 words of packed zero points, one per group and
output column), ``X.scales`` ([groups, out], fp16 or bf16) and, for GPTQ, ``X.g_idx`` (the group of each
input row). The weight is ``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``.

- GPTQ: ``qweight`` [in * bits / 32, out], codes packed along the input (word r holds rows
  32 / bits * r ..., the lowest bits first); ``qzeros`` [groups, out * bits / 32] packed along the
  output. Format "gptq" (v1) stores every zero point minus one in words that are added back with
  carries (GPTQModel's v1 -> v2 conversion, which is what transformers runs when it loads one);
  "gptq_v2" stores them as they are.
- AWQ (version "gemm"): ``qweight`` [in, out * bits / 32] packed along the output in AutoAWQ's
  order (nibble i of a word holds column ``AWQ_PACK_ORDER[i]`` of its eight), ``qzeros`` the same
  way, zero points as they are.

``Checkpoint`` shows such a linear as a float tensor ``X.weight`` ([out, in], fp32: every value
``scale * (q - z)`` of an fp16 or bf16 scale is exact in fp32) for the graph builder, the reference and float exports, and
hands its codes to the quantize pass (``codes``), which repacks them into MatMulNBits' layout
(``matmul_nbits_layout``) without dequantizing or quantizing again. What MatMulNBits cannot hold is
refused with the reason, before anything is built: bits other than 4 / 8 (AWQ: 4), per-channel
scales (group_size -1), groups that are not a power of two of at least 16, act-order (a ``g_idx``
that is not ``k // group_size``), AWQ versions other than gemm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from exporter.errors import ExportError

METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
# AutoAWQ's GEMM packing: nibble i (bits 4i..4i+3) of a word holds column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclasses.dataclass(frozen=True)
class PrequantizedFormat:
    """What a checkpoint's ``quantization_config`` says about its packed linears."""

    method: str  # gptq | awq
    layout: str  # gptq | gptq_v2 | gemm
    bits: int
    group_size: int

    @property
    def label(self) -> str:
        return f"{self.method} int{self.bits} g{self.group_size} ({self.layout})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_format(config: dict) -> PrequantizedFormat | None:
    """The pre-quantized format of config.json (None for a float checkpoint or another method),
    refused with the reason where MatMulNBits cannot take its weights as they are."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in METHODS:
        return None
    method = quant["quant_method"]
    bits = quant.get("bits", quant.get("w_bit"))
    group = quant.get("group_size", quant.get("q_group_size"))
    where = f"config.json's {method} quantization_config"
    allowed_bits = (4,) if method == "awq" else (4, 8)
    if bits not in allowed_bits:
        raise ExportError(f"{where} has bits {bits!r}: MatMulNBits imports {method} at "
                          f"{' or '.join(map(str, allowed_bits))} bits; export the float checkpoint it was made from")
    if group == -1:
        raise ExportError(f"{where} has group_size -1 (one scale per output channel): MatMulNBits keeps one scale per "
                          "block of 16 to 256 inputs; quantize the model again with group_size 32, 64 or 128")
    if not isinstance(group, int) or isinstance(group, bool) or group < 16 or group & (group - 1):
        raise ExportError(f"{where} has group_size {group!r}: MatMulNBits takes power-of-two blocks of at least 16")
    if method == "gptq":
        layout = quant.get("checkpoint_format") or quant.get("format") or "gptq"
        if layout not in GPTQ_FORMATS:
            raise ExportError(f"{where} stores its weights as {layout!r}: the exporter imports the gptq and gptq_v2 "
                              "layouts; save the model again in format gptq")
        if quant.get("desc_act") and quant.get("static_groups"):
            raise ExportError(f"{where} has desc_act with static_groups: not imported; quantize again with desc_act false")
    else:
        layout = str(quant.get("version", quant.get("format", "gemm"))).lower()
        if layout not in AWQ_VERSIONS:
            raise ExportError(f"{where} has version {layout!r}: the exporter imports AutoAWQ's gemm layout; save the model "
                              "again with version gemm")
    return PrequantizedFormat(method, layout, bits, group)


def checkpoint_format(directory: Path) -> PrequantizedFormat | None:
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_format(json.loads(path.read_text()))
    except json.JSONDecodeError:
        return None  # config.json's own reader says what is wrong with it


@dataclasses.dataclass(frozen=True)
class PackedLinear:
    """One pre-quantized linear of the checkpoint: ``prefix`` + SUFFIXES, [out, in] = (n, k)."""

    prefix: str
    n: int
    k: int

    @property
    def weight_name(self) -> str:
        return f"{self.prefix}.weight"

    def tensor(self, suffix: str) -> str:
        return f"{self.prefix}{suffix}"


def find_linears(shapes: dict[str, tuple[int, ...]], fmt: PrequantizedFormat) -> dict[str, PackedLinear]:
    """Every packed linear among the checkpoint's tensors (name -> shape), by its float name
    ``X.weight``; their shapes checked against the format."""
    per_word = 32 // fmt.bits
    linears = {}
    for name, qweight in shapes.items():
        if not name.endswith(".qweight"):
            continue
        prefix = name.removesuffix(".qweight")
        missing = [s for s in (".qzeros", ".scales") if prefix + s not in shapes]
        if missing:
            raise ExportError(f"{prefix} has a qweight but no {' or '.join(missing)}: the checkpoint is incomplete")
        if len(qweight) != 2:
            raise ExportError(f"{name} is {list(qweight)}: a packed linear's qweight is 2-D")
        if fmt.method == "gptq":
            k, n = qweight[0] * per_word, qweight[1]
        else:
            k, n = qweight[0], qweight[1] * per_word
        if k % fmt.group_size:
            raise ExportError(f"{prefix} has {k} inputs, not a whole number of groups of {fmt.group_size}")
        groups = k // fmt.group_size
        want = {".qzeros": (groups, n // per_word), ".scales": (groups, n)}
        if prefix + ".g_idx" in shapes:
            want[".g_idx"] = (k,)
        for suffix, shape in want.items():
            if tuple(shapes[prefix + suffix]) != shape:
                raise ExportError(f"{prefix}{suffix} is {list(shapes[prefix + suffix])}, expected {list(shape)} for "
                                  f"{fmt.label} with {n} outputs and {k} inputs: is config.json from this checkpoint?")
        linears[f"{prefix}.weight"] = PackedLinear(prefix, n, k)
    return linears


def check_group_index(g_idx: np.ndarray, linear: PackedLinear, fmt: PrequantizedFormat) -> None:
    """Act-order (desc_act) checkpoints give input rows to groups out of order; MatMulNBits' blocks are
    contiguous, so only the plain order is imported."""
    if not np.array_equal(g_idx, np.arange(linear.k) // fmt.group_size):
        raise ExportError(f"{linear.prefix}.g_idx puts input rows in groups out of order (act-order / desc_act): "
                          "MatMulNBits blocks are contiguous runs of inputs; quantize the model again with desc_act "
                          "false (GPTQModel's act_group_aware keeps most of act-order's gain with a plain g_idx)")


def _words(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint32)


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """[..., w] uint32 -> [..., w, 32 / bits] codes, the lowest bits first: one field at a time
    through one word-sized buffer (shifting every field at once held 8 bytes a code in uint32s)."""
    fields = np.empty((*words.shape, 32 // bits), np.uint8)
    field = np.empty(words.shape, np.uint32)
    for i in range(32 // bits):
        np.right_shift(words, np.uint32(i * bits), out=field)
        np.bitwise_and(field, np.uint32((1 << bits) - 1), out=field)
        fields[..., i] = field
    return fields


def _column_words(a: int, b: int, per_word: int) -> tuple[int, int, int]:
    """The words covering columns [a, b) and where column a falls in the first."""
    return a // per_word, -(-b // per_word), a % per_word


def codes(arrays, linear: PackedLinear, fmt: PrequantizedFormat, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output columns [a, b) of ``linear``: codes [b - a, k] (uint8), zero points [b - a, groups]
    (uint8) and scales [b - a, groups] as stored. ``arrays(name)`` gives a checkpoint tensor."""
    per_word = 32 // fmt.bits
    w0, w1, skip = _column_words(a, b, per_word)
    if fmt.method == "gptq":
        q = _unpack_words(_words(arrays(linear.tensor(".qweight"))[:, a:b]).T, fmt.bits).reshape(b - a, linear.k)
    else:
        q = _unpack_words(_words(arrays(linear.tensor(".qweight"))[:, w0:w1]), fmt.bits)
        q = q[..., _AWQ_COLUMNS].reshape(linear.k, -1)[:, skip : skip + b - a].T
    scales = np.asarray(arrays(linear.tensor(".scales"))[:, a:b]).T
    return np.ascontiguousarray(q), zero_points(arrays, linear, fmt, a, b), np.ascontiguousarray(scales)


# Column j of an AWQ word sits in nibble _AWQ_COLUMNS[j].
_AWQ_COLUMNS = np.argsort(AWQ_PACK_ORDER)


def zero_points(arrays, linear: PackedLinear, fmt: PrequantizedFormat, a: int = 0, b: int | None = None) -> np.ndarray:
    """Zero points [b - a, groups] (uint8) of output columns [a, b) of ``linear``."""
    b = linear.n if b is None else b
    w0, w1, skip = _column_words(a, b, 32 // fmt.bits)
    zeros = _words(arrays(linear.tensor(".qzeros"))[:, w0:w1])
    if fmt.layout == "gptq":  # v1: zero point - 1 in each field, added back word by word with carries
        zeros = zeros + np.uint32(sum(1 << s for s in range(0, 32, fmt.bits)))
    zeros = _unpack_words(zeros, fmt.bits)  # [groups, words, per_word]
    if fmt.method == "awq":
        zeros = zeros[..., _AWQ_COLUMNS]
    return np.ascontiguousarray(zeros.reshape(zeros.shape[0], -1)[:, skip : skip + b - a].T)


def input_codes(arrays, linear: PackedLinear, fmt: PrequantizedFormat, a: int, b: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Input columns [a, b) of ``linear`` for every output row: codes [n, b - a] (uint8), and the zero
    points and scales [n, groups] of the groups those columns fall in (a transposed read's block)."""
    per_word = 32 // fmt.bits
    g0, g1 = a // fmt.group_size, -(-b // fmt.group_size)
    if fmt.method == "gptq":  # packed along the inputs: the words of rows [a, b)
        w0, w1, skip = _column_words(a, b, per_word)
        q = _unpack_words(_words(arrays(linear.tensor(".qweight"))[w0:w1]), fmt.bits)  # [words, n, per_word]
        q = q.transpose(1, 0, 2).reshape(linear.n, -1)[:, skip : skip + b - a]
    else:
        q = _unpack_words(_words(arrays(linear.tensor(".qweight"))[a:b]), fmt.bits)[..., _AWQ_COLUMNS]
        q = q.reshape(b - a, linear.n).T
    zeros = zero_points(arrays, linear, fmt)[:, g0:g1]
    scales = np.asarray(arrays(linear.tensor(".scales"))[g0:g1]).T
    return np.ascontiguousarray(q), np.ascontiguousarray(zeros), np.ascontiguousarray(scales)


def dequantized(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group_size: int, first: int = 0) -> np.ndarray:
    """``scale * (q - z)`` per group, fp32 [n, width] (exact: an fp16 scale times a small integer) for
    codes of inputs [first, first + width) and the zero points and scales of the groups they fall in.
    In place, group by group: one fp32 array beside the codes, not one for each step of the sum."""
    width = q.shape[1]
    values = q.astype(np.float32)
    lead = first % group_size  # columns of the first group before ``first``
    for g in range(zeros.shape[1]):
        columns = slice(max(0, g * group_size - lead), min(width, (g + 1) * group_size - lead))
        values[:, columns] -= zeros[:, g : g + 1]
        values[:, columns] *= scales[:, g : g + 1].astype(np.float32)
    return values


def decode_bytes(values: int, group_size: int) -> int:
    """Host memory ``dequantized`` holds at its peak for ``values`` weights of a packed linear: each
    value's fp32 result and its uint8 code (unpacking them held less: the words, one field's buffer
    and the codes), and per group its zero point and scale (as stored, transposed and in fp32)."""
    return values * 5 + values // group_size * 16


def matmul_nbits_layout(q: np.ndarray, zeros: np.ndarray, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes [n, k] and zero points [n, groups] in MatMulNBits' layout: packed [n, groups, group_size *
    bits / 8] (two 4-bit codes a byte, the lower input first) and zero points [n, bytes] (4-bit:
    two groups a byte, the lower group first; padded to whole bytes)."""
    n, k = q.shape
    groups = k // group_size
    if bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        z = np.pad(zeros, ((0, 0), (0, groups % 2)))
        z = z[:, 0::2] | (z[:, 1::2] << 4)
    else:
        packed, z = q, zeros
    return np.ascontiguousarray(packed.reshape(n, groups, -1)), np.ascontiguousarray(z.astype(np.uint8))
