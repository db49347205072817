"""Weight integrity by value: the bytes in model.onnx.data against the checkpoint tensors.

Counts and dtypes cannot tell a zeroed or swapped weight from a good one; values can. Every
initializer made from the checkpoint is read back from the serialized file as ORT would read it
(the declared dtype over the external-data bytes) and each slice of a packed or transposed one
is compared with its source tensor, every element of it, block by block, so memory stays bounded
by one block per comparing thread whatever the model size, in numpy (no torch import); validation
runs this gate on its own thread alongside the runtime gates.

A slice is first held to the exact answer: its source rows converted to the initializer's dtype
here, by numpy / ml_dtypes (round to nearest even, the recipe's offset added in fp32; tests pin
every conversion to torch's bit for bit), not by the exporter's code, must give the stored bytes
bit for bit, and finite. That is stricter than any statistical bound (one wrong element fails it)
and costs a cast and a comparison per element. A slice that is not bit-exact is compared by
statistics, Pearson correlation and relative L2 error in float64, against its dtype's bounds
(a conversion that rounds differently still passes them; a zeroed, swapped or shifted weight
does not), and those figures are what the report lists.

A MatMulNBits weight imported from a GPTQ / AWQ checkpoint is dequantized and must equal the
checkpoint's own dequantization element for element, that decoded here from its raw tensors.
Any other MatMulNBits weight is held to the exact answer the same way: its source rows, in the activations'
dtype, quantized here by numpy following onnxruntime's blockwise algorithm (``quantize_rows``:
the block's largest-magnitude value over -2^(bits-1) as the scale, or min/max with a zero point,
round half away from zero; tested bit for bit against onnxruntime's own quantizer) must give the
stored packed bytes, scales and zero points. A bf16-activation weight skips that test: the exporter
quantized it with that same numpy code (onnxruntime's quantizer takes no bf16), so it goes the long
way, as does a weight that is not bit-exact: dequantized and held to the quantization's own error bound element by element, quantized
again by onnxruntime, and compared by statistics. (onnxruntime's quantizer holds the GIL: run for
every weight on several threads it kept the other threads of validation waiting, an 8B int4
check took 287 s on the H200's 16 cores.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from exporter import checkpoints
from exporter.cores import usable_cores
from exporter.graph.passes.quantize import quantize_rows  # noqa: F401 (the gate's exact answer; tests use it here)

from exporter.packaging.checkpoint import BLOCK_BYTES, Checkpoint
from exporter.validation.gates import GateResult

# bf16's 8-bit significand alone puts a norm weight near 1.0 with spread 0.1 at correlation ~0.9998
# (measured on H200 bf16 builds); a zeroed or swapped tensor sits near 0 either way.
CORRELATION_MIN = {"fp16": 0.9999, "bf16": 0.999}
# fp16 keeps 11 significant bits (RMS relative rounding error ~3e-4 from fp32); bf16 keeps 8
# (~2.3e-3), so a bf16 build of a higher-precision checkpoint gets a looser L2 bound.
REL_L2_MAX = {"fp16": 1e-3, "bf16": 5e-3}
# Block sizes onnxruntime's blockwise quantizer takes (the exact test quantizes with it).
ORT_BLOCK_SIZES = (16, 32, 64, 128, 256)
# A dequantized weight is within this many of its block's quantization steps of the source.
QUANT_BOUND = 1.01
# HQQ moves each block's zero point to lower an lp error (p < 1), which may clip a block's extremes by
# more than a step, and its codes depend on which rows were optimized together, so quantizing again
# cannot check them. Its weights are held to two bounds instead: every element within HQQ_STEP_BOUND
# of its block's steps (measured worst on SmolLM2's projections: 0.97 at block 32, 1.10 at block 64;
# a zeroed or scrambled block is up to 15 steps off, a scale 5x too big ~6), and each chunk of rows'
# L2 error at most HQQ_L2_VS_RTN times asymmetric round to nearest's on the same rows (measured
# 0.94-0.97x), which catches what is wrong everywhere a little. A scale a few percent off in one
# block passes both: round to nearest's exact requantization has no HQQ counterpart.
HQQ_STEP_BOUND = 2.0
HQQ_L2_VS_RTN = 1.25
# MatMulNBits weights that keep a GPTQ / AWQ checkpoint's codes: held to its dequantization exactly.
IMPORTED_METHODS = ("gptq", "awq")
# Checkpoint tensors an export legitimately leaves out (recomputed buffers).
IGNORED_SOURCES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class SliceStats:
    initializer: str
    region: str  # e.g. "[:, 64:96]" of the initializer
    source: str
    exact: bool  # bit-exact: the stored bytes are the source converted here (or, compared by value, equal to it)
    # Figures of the statistical comparison; None for a bit-exact slice, which is not compared that way.
    correlation: float | None = None  # also None for a constant source (undefined)
    rel_l2: float | None = None
    max_abs: float | None = None
    finite: bool = True
    passed: bool = True
    step_ratio: float | None = None  # quantized weights: worst |error| in quantization steps
    requantized_equal: bool | None = None  # quantized weights: the source quantized again gives these bytes
    l2_vs_rtn: float | None = None  # HQQ weights: L2 error over round-to-nearest's on the same rows

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Accumulator:
    """Streaming sums for correlation and L2 error, block by block.

    Values are held in float64 (exact for every dtype a weight comes in or is exported to: fp32,
    fp16, bf16) and products and sums taken in float64 (BLAS dot products), over sub-blocks of
    ``SUB_BLOCK`` elements so that every pass runs in cache; the L2 error is summed from the
    differences themselves, with no cancellation."""

    def __init__(self, kept: bool = False):
        self.n = 0
        self.sx = self.sy = self.sxx = self.syy = self.sxy = self.sdd = 0.0
        self.max_abs = 0.0
        # kept: each sub-block's sums kept in turn rather than summed, for ``extend`` (one span of
        # a slice's rows, the spans checked on several threads)
        self.sums: list[tuple[int, float, float, float, float, float, float]] | None = [] if kept else None

    def add(self, got: np.ndarray, want: np.ndarray) -> None:
        """``got`` and ``want``: numpy arrays of one shape, any float dtype numpy converts exactly.
        The casts, differences and extremes go ``SUB_BLOCKS_A_PASS`` sub-blocks at a time (each numpy
        call holds the GIL for its Python part: threads comparing side by side waited on it), the
        dot products sub-block by sub-block as before (the same sums, bit for bit)."""
        x_all, y_all = got.reshape(-1), want.reshape(-1)
        span = SUB_BLOCK * SUB_BLOCKS_A_PASS
        for outer in range(0, x_all.size, span):
            xs = x_all[outer : outer + span].astype(np.float64)
            ys = y_all[outer : outer + span].astype(np.float64)
            ds = xs - ys
            if ds.size:
                worst = max(float(ds.max()), -float(ds.min()))
                self.max_abs = max(self.max_abs, worst if math.isfinite(worst) else math.inf)  # NaN never passes
            for start in range(0, xs.size, SUB_BLOCK):
                x, y, d = (a[start : start + SUB_BLOCK] for a in (xs, ys, ds))
                ones = _ones(x.size)
                self._take((x.size, float(np.dot(d, d)), float(np.dot(x, ones)), float(np.dot(y, ones)),
                            float(np.dot(x, x)), float(np.dot(y, y)), float(np.dot(x, y))))

    def _take(self, sums: tuple[int, float, float, float, float, float, float]) -> None:
        if self.sums is not None:
            self.sums.append(sums)
            return
        n, sdd, sx, sy, sxx, syy, sxy = sums
        self.n += n
        self.sdd += sdd
        self.sx += sx
        self.sy += sy
        self.sxx += sxx
        self.syy += syy
        self.sxy += sxy

    def extend(self, span: _Accumulator) -> None:
        """A kept span's sums added after this one's, sub-block by sub-block: the figures of adding
        its blocks here in turn, bit for bit (float sums depend on their order)."""
        for sums in span.sums:
            self._take(sums)
        self.max_abs = max(self.max_abs, span.max_abs)

    def correlation(self) -> float | None:
        vx = self.n * self.sxx - self.sx**2
        vy = self.n * self.syy - self.sy**2
        if vy <= 1e-12 * max(1.0, self.n * self.syy):  # a constant source (e.g. ones): undefined
            return None
        return float((self.n * self.sxy - self.sx * self.sy) / math.sqrt(max(vx, 1e-300) * vy))

    def rel_l2(self) -> float:
        return math.sqrt(self.sdd) / max(math.sqrt(self.syy), 1e-30)


# Elements per pass of the accumulator: its float64 arrays stay in L1/L2, and OpenBLAS runs a
# dot product this short on the calling thread (above 10000 elements it starts threads of its
# own, which oversubscribe the cores that onnxruntime, running the other gates, already uses).
SUB_BLOCK = 8192
_ONES = np.ones(SUB_BLOCK)
# Sub-blocks whose casts, differences and extremes the accumulator takes in one numpy call each
# (float64: 4 MB an array).
SUB_BLOCKS_A_PASS = 64


def _ones(n: int) -> np.ndarray:
    return _ONES[:n]


def _as_float(array: np.ndarray) -> np.ndarray:
    """A weight block as float32 or wider numpy (bf16 exactly, through ml_dtypes: not the
    exporter's own bf16 -> fp32 shift, so a fault there cannot cancel out here)."""
    if array.dtype == np.uint16 or array.dtype.name == "bfloat16":  # raw bf16 bits (checkpoint, or ml_dtypes)
        return np.ascontiguousarray(array).view(ml_dtypes.bfloat16).astype(np.float32)
    return array


# Elements per block of the exact test: the block's cast and comparison stay in cache, and each
# numpy call is long enough that threads comparing side by side rarely wait for the GIL.
EXACT_BLOCK_ELEMS = 1 << 19
# Each comparing thread holds its blocks and their float temporaries: 80-90 MiB measured (an int4
# check of the 8B geometry, fp32 or bf16 activations); so many keep the check within the 2 GiB
# exporter.resources counts for it.
MAX_COMPARE_THREADS = 16
# Blocks of a slice one thread checks in a row: a long slice (an LM head of 525M elements) is
# checked by several threads rather than left to one at the end. Each span starts on memory the
# allocator gave back after the last one (a 4096-wide fp32 span re-faults about 4 MB), so a span
# is long enough for that to be a small part of its work.
SPAN_BLOCKS = 32
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
# Exponent bits all set: inf or NaN.
_NON_FINITE = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float32): 0x7F800000,
               np.dtype(np.float64): 0x7FF0000000000000}
# The dtype a weight that is not quantized is stored in: the build's activations dtype.
STORAGE_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}


def converted(block: np.ndarray, dtype: np.dtype, add: float | None = None) -> np.ndarray:
    """A source block (as ``Checkpoint.array`` gives it: bf16 as raw uint16 bits) in ``dtype``, cast
    by numpy / ml_dtypes (round to nearest even), ``add`` added in fp32 first: what a correct export
    stores, computed without the exporter's conversion code."""
    if block.dtype == np.uint16:
        block = np.ascontiguousarray(block).view(ml_dtypes.bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):
        if add:
            block = block.astype(np.float32) + np.float32(add)
        return block.astype(dtype, copy=False)


def _exact_part(out: np.ndarray, transposed: bool, offset: int, checkpoint: Checkpoint, part: dict,
                storage: np.dtype, stride: int = 1, span: tuple[int, int] | None = None) -> bool:
    """Whether one part's slice of ``out`` (its rows ``span`` of the part's, default all) is stored
    as ``storage`` and is its source converted to it (``converted``) bit for bit, and finite. The
    transposed case compares against the output's columns as a strided view (numpy's own transpose,
    not the exporter's tiled one). A weight in another dtype is not exact whatever its bytes: the
    statistics judge it against the build's bounds."""
    bits = _BITS.get(out.dtype.itemsize)
    if bits is None or out.dtype != storage:
        return False
    non_finite = _NON_FINITE.get(out.dtype)
    for source, got in _part_blocks(out, transposed, offset, checkpoint, part, EXACT_BLOCK_ELEMS, stride, span):
        want = converted(source, out.dtype, part.get("add")).view(bits)
        got = got.view(bits)
        if want.shape != got.shape or not np.array_equal(want, got):
            return False
        if non_finite is not None and (np.bitwise_and(want, non_finite) == non_finite).any():
            return False  # an overflow (bf16 -> fp16) is converted faithfully but is no weight: the statistics report it
    return True


def _external_arrays(model: onnx.ModelProto, base: Path) -> dict[str, np.ndarray]:
    """Each external initializer as a read-only memmap with its declared dtype and shape."""
    from onnx.helper import tensor_dtype_to_np_dtype

    arrays = {}
    for init in model.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if init.data_location != onnx.TensorProto.EXTERNAL:
            arrays[init.name] = onnx.numpy_helper.to_array(init)
            continue
        if init.data_type == onnx.TensorProto.BFLOAT16:
            import ml_dtypes

            dtype = np.dtype(ml_dtypes.bfloat16)
        else:
            dtype = np.dtype(tensor_dtype_to_np_dtype(init.data_type))
        shape = tuple(init.dims)
        count = int(np.prod(shape, dtype=np.int64))
        offset, length = int(info.get("offset", 0)), int(info.get("length", count * dtype.itemsize))
        if length != count * dtype.itemsize:
            # The declared type does not match the stored byte count (e.g. fp16 bytes under FLOAT).
            arrays[init.name] = ValueError(f"{length} bytes stored for {count} x {dtype} ({init.name})")
            continue
        # A plain ndarray over the map (it keeps the map alive): np.memmap's slicing costs per call.
        arrays[init.name] = np.memmap(base / info["location"], dtype=dtype, mode="r", offset=offset,
                                      shape=shape).view(np.ndarray)
    return arrays


class _Mxfp4Rows:
    """An MXFP4 part's source as rows of fp32 values, decoded when sliced: the OCP MX rule (two e2m1
    codes a byte, the low one first; each 32 scaled by 2^(e8m0 - 127)), written here apart from the
    exporter's decoder (``checkpoint.mxfp4_values``) so that a fault in one is not the other's."""

    _E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

    def __init__(self, blocks: np.ndarray, scales: np.ndarray):
        self.blocks, self.scales = blocks, scales
        self.shape = (blocks.shape[0], blocks.shape[1] * blocks.shape[2] * 2)

    def __getitem__(self, rows: slice) -> np.ndarray:
        blocks, scales = self.blocks[rows], self.scales[rows].astype(np.float64)
        magnitude = np.array(self._E2M1 * 2)[np.stack([blocks % 16, blocks // 16], axis=-1)]  # [r, groups, 16, 2]
        sign = np.where(np.stack([blocks % 16, blocks // 16], axis=-1) >= 8, -1.0, 1.0)
        values = sign * magnitude * np.power(2.0, scales - 127)[..., None, None]
        return values.reshape(values.shape[0], -1).astype(np.float32)


class _PackedRows:
    """A GPTQ / AWQ linear's values as rows, decoded when sliced (``Checkpoint.rows``): decoding the
    whole linear for each part compared would hold 5 bytes a value of it in every comparing thread."""

    def __init__(self, checkpoint: Checkpoint, name: str):
        self.checkpoint, self.name = checkpoint, name
        self.shape = checkpoint.shape(name)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.checkpoint.rows(self.name, rows.start, rows.stop)


def _source(checkpoint: Checkpoint, part: dict) -> np.ndarray:
    """A part's source tensor as stored (one expert's slab of a 3-D tensor where the part names one)."""
    if part["tensor"] in checkpoint.linears:
        return _PackedRows(checkpoint, part["tensor"])
    if part.get("mxfp4_scales"):
        blocks, scales = checkpoint.array(part["tensor"]), checkpoint.array(part["mxfp4_scales"])
        if part.get("expert") is not None:
            blocks, scales = blocks[part["expert"]], scales[part["expert"]]
        return _Mxfp4Rows(blocks, scales)
    array = checkpoint.array(part["tensor"])
    array = array if part.get("expert") is None else array[part["expert"]]
    return array.T if part.get("transposed") else array  # numpy's own view, not the exporter's tiled copy


def _part_range(checkpoint: Checkpoint, part: dict) -> tuple[int, int]:
    """The source rows [a, b) one part takes."""
    shape = checkpoint.shape(part["tensor"])
    if part.get("expert") is not None:
        shape = shape[1:]
    rows = part["rows"] or [0, shape[-1] if part.get("transposed") else shape[0]]
    return rows[0], rows[1]


def _placements(checkpoint: Checkpoint, recipe: dict) -> list[tuple[dict, int, int]]:
    """(part, first row, row stride) of each part in the initializer's 2-D row view: parts one after
    another, or ``interleave`` k at a time with their rows alternating (an expert's gate row j at
    2j, its up row j at 2j + 1)."""
    k = recipe.get("interleave", 1)
    parts, placed, base = recipe["parts"], [], 0
    for g in range(0, len(parts), k):
        group = parts[g : g + k]
        for j, part in enumerate(group):
            placed.append((part, base + j, k))
        base += k * _part_rows(checkpoint, group[0])
    return placed


def _part_rows(checkpoint: Checkpoint, part: dict) -> int:
    a, b = _part_range(checkpoint, part)
    return b - a


def _part_blocks(out: np.ndarray, transposed: bool, offset: int, checkpoint: Checkpoint, part: dict,
                 block_elems: int, stride: int = 1, span: tuple[int, int] | None = None):
    """One part (its rows ``span`` of the part's, default all), block by block of about
    ``block_elems`` elements: (source rows as ``Checkpoint.array`` gives them, the slice of ``out``
    made from them in the source's row order). A transposed initializer's columns come as numpy's
    transposed view, not through the exporter's own tiled transpose, so a fault in that code cannot
    cancel out here."""
    a, b = _part_range(checkpoint, part)
    first, end = span or (0, b - a)
    source = _source(checkpoint, part)
    row_elems = max(1, int(np.prod(source.shape[1:], dtype=np.int64)))
    step = max(1, block_elems // row_elems)
    for r0 in range(first, end, step):
        r1 = min(end, r0 + step)
        got = out[:, offset + r0 : offset + r1].T if transposed else out[offset + r0 * stride : offset + r1 * stride : stride]
        yield source[a + r0 : a + r1], got


def _compare_part(out: np.ndarray, transposed: bool, offset: int, checkpoint: Checkpoint, part: dict,
                  stride: int = 1, span: tuple[int, int] | None = None) -> _Accumulator:
    """Every element of one part (its rows ``span`` of the part's, default all; then its sums
    kept) against its source, in the source's row order."""
    acc = _Accumulator(kept=span is not None)
    for source, got in _part_blocks(out, transposed, offset, checkpoint, part, BLOCK_BYTES // 8, stride, span):
        want = _as_float(source)
        if part.get("add"):
            want = want.astype(np.float32) + np.float32(part["add"])  # the recipe's offset, in fp32 as it was built
        acc.add(_as_float(np.ascontiguousarray(got) if transposed or stride != 1 else got), want)
    return acc


def _compare_quantized(arrays, name: str, quant: dict, offset: int, checkpoint: Checkpoint, part: dict,
                       activations: str, stride: int = 1, span: tuple[int, int] | None = None) -> _Accumulator:
    """Dequantize output columns [offset, offset + rows) of a MatMulNBits weight (one checkpoint
    part's rows; its rows ``span`` of the part's, then its sums kept) and compare them with the
    source as it was quantized (cast to the activations by numpy / ml_dtypes, ``converted``: torch's
    rounding, bit for bit, without torch's threads, which every comparing thread's casts set going
    on every core)."""
    from exporter.graph.passes.quantize import QuantScheme, dequantize, quantize_block, quantize_rows

    scheme = QuantScheme.of(quant)
    hqq = scheme.method == "hqq"
    k, n_total = quant["K"], quant["N"]
    k_blocks, _, zp_bytes = scheme.layout(k)
    stem = name[: -len(".packed")]
    packed = arrays[name].reshape(n_total, k_blocks, -1)  # QMoE's [experts, N, K / pack]: the same bytes
    scales = np.asarray(arrays[f"{stem}.scales"]).reshape(n_total, k_blocks)
    zero_points = None if scheme.symmetric else np.asarray(arrays[f"{stem}.zero_points"]).reshape(n_total, zp_bytes)
    acc = _Accumulator(kept=span is not None)
    acc.bound_ratio, acc.requantized_equal = 0.0, None if hqq else True
    acc.l2_vs_rtn = 0.0 if hqq else None
    first, end = _part_range(checkpoint, part)
    step = _stats_block_rows(checkpoint, part, quant)
    source = _source(checkpoint, part)
    span = span or (0, end - first)
    for r0 in range(span[0], span[1], step):
        r1 = min(span[1], r0 + step)
        rows = converted(source[first + r0 : first + r1], STORAGE_DTYPES[activations], part.get("add"))
        want = rows.astype(np.float32)
        cols = slice(offset + r0 * stride, offset + r1 * stride, stride)
        got_packed, got_scales = np.asarray(packed[cols]), scales[cols]
        got_zero = None if zero_points is None else zero_points[cols]
        got = dequantize(got_packed, got_scales, got_zero, scheme, k)
        err = np.abs(got - want)
        # each block's worst error over its step (the division is monotonic: the worst element's own
        # ratio), with no step repeated over the block's elements
        worst = np.pad(err, ((0, 0), (0, k_blocks * scheme.block_size - k))).reshape(-1, k_blocks, scheme.block_size)
        step_size = np.maximum(np.abs(got_scales.astype(np.float32)), 1e-30)
        ratio = float((worst.max(axis=-1) / step_size).max()) if err.size else 0.0
        if hqq:
            rtn = QuantScheme(scheme.bits, scheme.block_size, False)
            back = dequantize(*quantize_rows(want, rtn.bits, rtn.block_size, False), rtn, k)
            rtn_l2 = float(np.linalg.norm(back - want))
            ratio_l2 = float(np.linalg.norm(got - want)) / max(rtn_l2, 1e-30)
            acc.l2_vs_rtn = max(acc.l2_vs_rtn, ratio_l2 if math.isfinite(ratio_l2) else math.inf)
            acc.bound_ratio = max(acc.bound_ratio, ratio if math.isfinite(ratio) else math.inf)
            acc.add(got, want)
            continue
        # The bound alone trusts the file's own scales (a scale 5% off still bounds its block), so
        # the source is quantized again the same deterministic way and must give the same bytes.
        again = quantize_block(rows.T, scheme)  # [K, n] as a view of the rows it quantizes
        same = np.array_equal(again[0], got_packed) and np.array_equal(again[1].reshape(got_scales.shape), got_scales) \
            and (got_zero is None or np.array_equal(again[2].reshape(got_zero.shape), got_zero))
        if not same:
            acc.requantized_equal = False
        acc.bound_ratio = max(acc.bound_ratio, ratio if math.isfinite(ratio) and same else math.inf)
        acc.add(got, want)
    return acc


# AutoAWQ's GEMM packing order (its order_map): the i-th 4-bit field of a word holds column _AWQ_ORDER[i] of its eight.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _fields(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [..., w] as their fields [..., w * 32 / bits], the lowest first: read here as the
    words' four little-endian bytes (the exporter shifts whole words), so a fault in one reading is
    not the other's."""
    octets = np.ascontiguousarray(words).view(np.uint8).reshape(*words.shape, 4)
    if bits == 8:
        return octets.reshape(*words.shape[:-1], -1)
    return np.stack([octets & 0x0F, octets >> 4], axis=-1).reshape(*words.shape[:-1], -1)


def _packed_linear_rows(checkpoint: Checkpoint, tensor: str, a: int, b: int) -> np.ndarray:
    """Output rows [a, b) of a GPTQ / AWQ linear (``X.weight``) as fp32 ``scale * (q - z)``, decoded
    here from its raw tensors (GPTQ v1's zero points are stored minus one, added back word-wise)."""
    fmt, prefix = checkpoint.prequantized, tensor.removesuffix(".weight")
    per_word = 32 // fmt.bits
    w0, w1, skip = a // per_word, -(-b // per_word), a % per_word  # the words holding columns [a, b)
    qzeros = checkpoint.array(prefix + ".qzeros")[:, w0:w1]
    if fmt.layout == "gptq":
        ones = int(("0" * (fmt.bits - 1) + "1") * per_word, 2)
        qzeros = (((qzeros.astype(np.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF).astype(np.uint32)
    zeros = _fields(qzeros, fmt.bits)  # [groups, columns of those words] in field order
    if fmt.method == "gptq":
        codes = _fields(np.ascontiguousarray(checkpoint.array(prefix + ".qweight")[:, a:b].T), fmt.bits)
    else:
        columns = np.empty(8, np.int64)
        columns[list(_AWQ_ORDER)] = np.arange(8)  # the field holding column j
        words = checkpoint.array(prefix + ".qweight")[:, w0:w1]
        k = words.shape[0]
        codes = _fields(words, fmt.bits).reshape(k, -1, 8)[..., columns].reshape(k, -1)[:, skip : skip + b - a].T
        zeros = zeros.reshape(zeros.shape[0], -1, 8)[..., columns].reshape(zeros.shape[0], -1)
    zeros = zeros[:, skip : skip + b - a].T.astype(np.float32)
    scales = checkpoint.array(prefix + ".scales")[:, a:b]
    if checkpoint.stored_dtype(prefix + ".scales") is ir.DataType.BFLOAT16:  # raw bits: the high half of an fp32
        scales = (scales.astype(np.uint32) << np.uint32(16)).view(np.float32)
    scales = np.asarray(scales, np.float32).T
    group = np.arange(codes.shape[1]) // fmt.group_size
    return (codes.astype(np.float32) - zeros[:, group]) * scales[:, group]


def _compare_imported(arrays, name: str, quant: dict, offset: int, checkpoint: Checkpoint, part: dict,
                      stride: int = 1) -> _Accumulator | None:
    """A MatMulNBits weight imported from a GPTQ / AWQ linear, dequantized, against the checkpoint's
    own dequantization (``_packed_linear_rows``): equal element for element (None), or its figures
    with an infinite bound ratio (failed)."""
    from exporter.graph.passes.quantize import QuantScheme, dequantize

    scheme = QuantScheme.of(quant)
    k, n_total = quant["K"], quant["N"]
    k_blocks, _, zp_bytes = scheme.layout(k)
    stem = name[: -len(".packed")]
    packed = arrays[name].reshape(n_total, k_blocks, -1)
    scales = np.asarray(arrays[f"{stem}.scales"]).reshape(n_total, k_blocks)
    zero_points = None if scheme.symmetric else np.asarray(arrays[f"{stem}.zero_points"]).reshape(n_total, zp_bytes)
    first, end = _part_range(checkpoint, part)
    acc, exact = _Accumulator(), True
    step = max(1, BLOCK_BYTES // (k * 16))
    for r0 in range(0, end - first, step):
        r1 = min(end - first, r0 + step)
        want = _packed_linear_rows(checkpoint, part["tensor"], first + r0, first + r1)
        cols = slice(offset + r0 * stride, offset + r1 * stride, stride)
        got = dequantize(np.asarray(packed[cols]), scales[cols], None if zero_points is None else zero_points[cols],
                         scheme, k)
        exact = exact and np.array_equal(got, want)
        acc.add(got, want)
    if exact:
        return None
    acc.bound_ratio, acc.requantized_equal, acc.l2_vs_rtn = math.inf, False, None
    return acc


def _exact_quantized(arrays, name: str, quant: dict, offset: int, checkpoint: Checkpoint, part: dict,
                     activations: str, stride: int = 1, span: tuple[int, int] | None = None) -> bool:
    """Whether the weight's columns for one checkpoint part (its rows ``span`` of the part's, default
    all) are exactly ``quantize_rows`` of their source (cast to the activations by numpy /
    ml_dtypes), block of rows by block of rows."""
    if activations not in ("fp32", "fp16"):
        return False
    k, n_total, bits = quant["K"], quant["N"], quant["bits"]
    block_size, symmetric = quant["block_size"], quant["symmetric"]
    k_blocks = -(-k // block_size)
    stem = name[: -len(".packed")]
    packed = arrays[name].reshape(n_total, k_blocks, -1)
    scales = np.asarray(arrays[f"{stem}.scales"]).reshape(n_total, k_blocks)
    zero_points = None if symmetric else np.asarray(arrays[f"{stem}.zero_points"]).reshape(n_total, -1)
    first, end = _part_range(checkpoint, part)
    source = _source(checkpoint, part)
    step = max(1, BLOCK_BYTES // (k * 8))
    span = span or (0, end - first)
    for r0 in range(span[0], span[1], step):
        r1 = min(span[1], r0 + step)
        rows = np.ascontiguousarray(converted(source[first + r0 : first + r1], STORAGE_DTYPES[activations], part.get("add")))
        if not np.all(np.isfinite(rows)):
            return False
        got_packed, got_scales, got_zero = quantize_rows(rows, bits, block_size, symmetric)
        cols = slice(offset + r0 * stride, offset + r1 * stride, stride)
        if not (np.array_equal(np.asarray(packed[cols]).reshape(got_packed.shape), got_packed)
                and np.array_equal(scales[cols].view(np.uint8), got_scales.view(np.uint8))
                and (zero_points is None or np.array_equal(zero_points[cols], got_zero))):
            return False
    return True


def compare_threads() -> int:
    """Threads for the comparison: the cores this process may use but one (at least one), which
    the gates that run the export beside it keep, and at most ``MAX_COMPARE_THREADS``. One on a
    2-core machine (alone, two threads take a 0.5B check from 4.6 to 2.7 s there, but they then
    slow the onnxruntime session beside them by as much); on a larger host the check of a big
    quantized export is what validation waits for once the other gates are done (an 8B int4 check:
    110 of a 114 s validation on 16 cores)."""
    return max(1, min(MAX_COMPARE_THREADS, usable_cores() - 1))


def _row_elems(checkpoint: Checkpoint, part: dict) -> int:
    return max(1, int(np.prod(_source(checkpoint, part).shape[1:], dtype=np.int64)))


def _exact_block_rows(checkpoint: Checkpoint, part: dict, quant: dict | None) -> int:
    """Rows of a block of the exact test (``_exact_quantized``, ``_exact_part``)."""
    if quant:
        return max(1, BLOCK_BYTES // (quant["K"] * 8))
    return max(1, EXACT_BLOCK_ELEMS // _row_elems(checkpoint, part))


def _stats_block_rows(checkpoint: Checkpoint, part: dict, quant: dict | None) -> int:
    """Rows of a block of the statistics (``_compare_quantized``, ``_compare_part``)."""
    if quant:
        return max(1, BLOCK_BYTES // (quant["K"] * 16))
    return max(1, BLOCK_BYTES // 8 // _row_elems(checkpoint, part))


def _spans(checkpoint: Checkpoint, part: dict, block_rows: int) -> list[tuple[int, int]]:
    """A part's rows in spans of ``SPAN_BLOCKS`` blocks of ``block_rows`` (one span at least): the
    blocks of a span are those a pass over all the part's rows reads."""
    rows = _part_rows(checkpoint, part)
    step = block_rows * SPAN_BLOCKS
    return [(r0, min(rows, r0 + step)) for r0 in range(0, max(rows, 1), step)]


def _joined(spans: list[_Accumulator | None]) -> _Accumulator | None:
    """A slice's figures from those of its spans of rows, in order, as one pass over them all gives
    them: the sums added in turn, the worst figures the worst of the spans'. An imported slice's
    one comparison stands as it is (None: equal to the checkpoint's own)."""
    if len(spans) == 1 and (spans[0] is None or spans[0].sums is None):
        return spans[0]
    acc = _Accumulator()
    first = spans[0]
    if hasattr(first, "bound_ratio"):  # a quantized weight's
        acc.bound_ratio = max(s.bound_ratio for s in spans)
        acc.requantized_equal = None if first.requantized_equal is None else all(s.requantized_equal for s in spans)
        acc.l2_vs_rtn = None if first.l2_vs_rtn is None else max(s.l2_vs_rtn for s in spans)
    for span in spans:
        acc.extend(span)
    return acc


def weight_integrity(model_path: Path, manifest: dict, checkpoint: Checkpoint, dtype: str,
                     activations: str | None = None, traced: bool = False,
                     exported_elsewhere: frozenset[str] = frozenset()) -> tuple[list[GateResult], list[SliceStats]]:
    """Compare every checkpoint-derived slice; returns gate results and per-slice figures.

    A weight quantized to MatMulNBits is dequantized and held to the quantization's own error
    bound element by element (``QUANT_BOUND`` quantization steps); the rest to their dtype's.
    ``traced``: a graph traced by transformers.exporters holds what the model's forward reads, some of
    it folded into computed constants; a checkpoint tensor found nowhere as stored is then reported, not
    failed (parity judges what the model computes from it). ``exported_elsewhere``: checkpoint tensors another
    graph of the export holds (an image-text export's vision and embedding graphs), not missing from this one."""
    activations = activations or dtype
    model = onnx.load(str(model_path), load_external_data=False)
    arrays = _external_arrays(model, model_path.parent)
    sources = manifest.get("initializers", {})
    stats: list[SliceStats] = []
    problems: list[str] = []
    used_sources: set[str] = set()
    jobs = []
    for name, data in arrays.items():
        recipe = sources.get(name)
        if recipe is None:
            problems.append(f"{name} is in model.onnx but not in the manifest")
            continue
        if recipe.get("computed"):
            continue  # rope tables, shape vectors; a quantized weight's scales are read with its packed data
        if isinstance(data, ValueError):
            problems.append(str(data))
            continue
        if recipe.get("experts") and not recipe.get("quantization"):
            data = data.reshape(-1, data.shape[-1])  # [experts, rows, cols] -> the 2-D row view
        for part, offset, stride in _placements(checkpoint, recipe):
            jobs.append((name, data, recipe["transposed"], offset, part, stride))
            used_sources.add(part["tensor"])
            if part.get("mxfp4_scales"):
                used_sources.add(part["mxfp4_scales"])

    def exact_rows(job, span) -> bool:
        """Whether rows ``span`` of the slice are bit-exact (False where the slice has no exact test)."""
        checkpoints.checkpoint()
        name, data, transposed, offset, part, stride = job
        quant = sources[name].get("quantization")
        if quant and quant.get("method") in IMPORTED_METHODS:
            return False  # held to the checkpoint's own dequantization instead
        if quant:
            # a bf16 weight, or a block onnxruntime's quantizer does not take (an expert's int8 rows,
            # one block per row), was quantized by quantize_rows itself: the exact answer would be the
            # exporter's own, so it is bounded by value instead
            exact_possible = activations != "bf16" and quant["block_size"] in ORT_BLOCK_SIZES \
                and quant.get("method", "rtn") == "rtn"  # HQQ's codes are not reproducible this way
            return exact_possible and _exact_quantized(arrays, name, quant, offset, checkpoint, part, activations,
                                                       stride, span)
        return _exact_part(data, transposed, offset, checkpoint, part, STORAGE_DTYPES[activations], stride, span)

    def compare(job, span) -> _Accumulator | None:
        """The figures of rows ``span`` of a slice that is not bit-exact (None: imported, and equal
        to the checkpoint's own; an imported slice is compared whole, ``span`` None)."""
        checkpoints.checkpoint()
        name, data, transposed, offset, part, stride = job
        quant = sources[name].get("quantization")
        if quant and quant.get("method") in IMPORTED_METHODS:
            return _compare_imported(arrays, name, quant, offset, checkpoint, part, stride)
        if quant:
            return _compare_quantized(arrays, name, quant, offset, checkpoint, part, activations, stride, span)
        return _compare_part(data, transposed, offset, checkpoint, part, stride, span)

    def in_spans(selected, block_rows) -> list[tuple[int, tuple[int, int] | None]]:
        """(job, span of its rows) for each span of the jobs ``selected`` in blocks of ``block_rows(job)``
        rows (span None: the slice compared whole, where ``block_rows`` gives None)."""
        spans = []
        for j in selected:
            rows = block_rows(jobs[j])
            spans += [(j, span) for span in (_spans(checkpoint, jobs[j][4], rows) if rows else [None])]
        return spans

    def quant_of(job) -> dict | None:
        return sources[job[0]].get("quantization")

    # Slices and spans of their rows are independent, and numpy releases the GIL inside each pass
    # over a block: the exact test runs span by span on every thread; then the slices it did not
    # find bit-exact (in a sound export only those it has no exact answer for: GPTQ / AWQ codes,
    # HQQ and bf16 quantized weights) are compared by statistics, span by span too, each slice's
    # spans summed in their order (the figures one pass over the slice gives).
    exact_spans = in_spans(range(len(jobs)), lambda job: _exact_block_rows(checkpoint, job[4], quant_of(job)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=compare_threads(), thread_name_prefix="weights") as pool:
        bit_exact = [True] * len(jobs)
        for (j, _), ok in zip(exact_spans, pool.map(lambda item: exact_rows(jobs[item[0]], item[1]), exact_spans)):
            bit_exact[j] = bit_exact[j] and ok
        stats_spans = in_spans([j for j, ok in enumerate(bit_exact) if not ok], lambda job: (
            None if (quant_of(job) or {}).get("method") in IMPORTED_METHODS
            else _stats_block_rows(checkpoint, job[4], quant_of(job))))
        figures: dict[int, list] = {}
        for (j, _), acc in zip(stats_spans, pool.map(lambda item: compare(jobs[item[0]], item[1]), stats_spans)):
            figures.setdefault(j, []).append(acc)
    accumulators = [_joined(figures[j]) if j in figures else None for j in range(len(jobs))]
    for (name, _, transposed, offset, part, stride), acc in zip(jobs, accumulators):
        n = _part_rows(checkpoint, part)
        quant = sources[name].get("quantization")
        region = (f"[{offset}:{offset + n * stride}:{stride}]" if stride != 1 else
                  f"[:, {offset}:{offset + n}]" if transposed and not quant else f"[{offset}:{offset + n}]")
        rows = (f" expert {part['expert']}" if part.get("expert") is not None else "") + (
            f" rows {part['rows'][0]}:{part['rows'][1]}" if part["rows"] else "")
        if acc is None:
            stats.append(SliceStats(name, region, part["tensor"] + rows, exact=True))
            continue
        corr, rel = acc.correlation(), acc.rel_l2()
        exact = acc.max_abs == 0.0
        if quant:
            # Round to nearest moves an element by at most half a step, a whole one where the
            # symmetric grid clips the block's extreme; any more is a wrong weight, not rounding.
            passed = (acc.l2_vs_rtn <= HQQ_L2_VS_RTN and acc.bound_ratio <= HQQ_STEP_BOUND
                      if acc.l2_vs_rtn is not None else acc.bound_ratio <= QUANT_BOUND)
        elif activations == "fp32":
            passed = exact
        else:
            passed = rel <= REL_L2_MAX[activations] and (corr is None or corr >= CORRELATION_MIN[activations])
        ratio = getattr(acc, "bound_ratio", None)
        finite = math.isfinite(acc.max_abs)
        stats.append(SliceStats(name, region, part["tensor"] + rows, exact, corr, rel,
                                acc.max_abs if finite else None, finite, passed,
                                ratio if ratio is None or math.isfinite(ratio) else None,
                                getattr(acc, "requantized_equal", None), getattr(acc, "l2_vs_rtn", None)))
    missing = [s for s in checkpoint.names() if s not in used_sources and s not in exported_elsewhere
               and not s.endswith(IGNORED_SOURCES)]
    failed = [s for s in stats if not s.passed]
    measured = [s for s in stats if s.rel_l2 is not None]  # the bit-exact ones carry no figures
    worst = sorted(measured, key=lambda s: (s.passed, s.correlation if s.correlation is not None else 2.0, -s.rel_l2))
    bit_exact = len(stats) - len(measured)
    # Within bounds, but not what this file's own conversion gives: said, not failed.
    inexact = [s for s in worst if s.passed and not s.exact and s.step_ratio is None]
    if dtype in ("int4", "int8"):
        threshold = (f"quantized: |dequantized - source| <= {QUANT_BOUND} x block step (HQQ: {HQQ_STEP_BOUND} x, and "
                     f"L2 error <= {HQQ_L2_VS_RTN} x round to nearest's); others: ") + (
            "exact" if activations == "fp32" else f"corr >= {CORRELATION_MIN[activations]}, rel L2 <= {REL_L2_MAX[activations]}")
    else:
        threshold = "exact" if dtype == "fp32" else f"corr >= {CORRELATION_MIN[dtype]}, rel L2 <= {REL_L2_MAX[dtype]}"
    threshold = f"bit-exact conversion of the source, else {threshold}"
    results = [
        GateResult(
            "weights", "every checkpoint slice matches its source by value", not failed and not problems,
            f"{len(stats) - len(failed)}/{len(stats)} slices ok ({bit_exact} bit-exact)", threshold,
            "; ".join(problems[:5] + [f"{s.initializer}{s.region} vs {s.source}: corr {_fmt(s.correlation)}, rel L2 {s.rel_l2:.3g}"
                                 + (f", L2 error {s.l2_vs_rtn:.3g} x round to nearest's, "
                                    f"{s.step_ratio if s.step_ratio is not None else float('inf'):.3g} quantization steps off"
                                    if s.l2_vs_rtn is not None else
                                    ", not the quantization of its source" if s.requantized_equal is False else
                                    f", {s.step_ratio:.3g} quantization steps off" if s.step_ratio is not None else
                                    ", non-finite values" if not s.finite else "")
                                 for s in failed[:5]])
            or (f"{len(inexact)} slices within bounds but not the exact conversion of their source, e.g. "
                + ", ".join(f"{s.initializer}{s.region} (rel L2 {s.rel_l2:.3g})" for s in inexact[:3])
                if inexact else ""),
            details={"bit_exact": bit_exact, "compared_by_statistics": len(measured),
                     "worst": [s.to_dict() for s in worst[:10]]},
        ),
        GateResult(
            "weights", "every checkpoint tensor is exported", not missing, len(missing), 0,
            "" if not missing else (f"{len(missing)} checkpoint tensors are not in the traced graph as stored: the "
                                    "model's forward does not read them (a decoder's cross-attention without an "
                                    "encoder) or transformers.exporters folded them into computed constants; parity "
                                    "checks what the model computes from them: " if traced else "not exported: ")
            + ", ".join(missing[:10]), informational=traced,
        ),
    ]
    return results, stats


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6f}"
