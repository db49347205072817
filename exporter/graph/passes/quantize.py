"""Weight-only quantization: ``MatMul(x, W_T)`` -> ``com.microsoft::MatMulNBits`` with lazy blocks.

The quantization itself is onnxruntime's own block quantizer (``quantize_matmul_4bits`` /
``quantize_matmul_8bits``, the kernels behind ``onnxruntime.quantization.MatMulNBitsQuantizer``),
called on one bounded block of output columns at a time: MatMulNBits quantizes along K per output
column, so the columns of ``W_T`` (the rows of the checkpoint's ``[out, in]`` weight) quantize
independently and the tensor never has to be whole in memory. Packed Q/K/V and gate/up stay one
node each: the pass runs after the concat and transpose folds and sees one initializer per MatMul.

``method`` "hqq" replaces round to nearest for the 4-bit weights with onnxruntime's Half-Quadratic
Quantization (``HQQWeightOnlyQuantizer.quantize_internal``, torch), called on the same bounded blocks.
Its zero points are floats, one per block in the scales' dtype, as onnxruntime's own HQQ path gives
them to MatMulNBits: rounded to uint8 they land back on round to nearest's grid (measured: the same
reconstruction error as asymmetric RTN), so they are not rounded. The price is onnxruntime's CPU
kernel, which has no fast path for float zero points, and GatherBlockQuantized, which takes none (a
tied embedding then stays float unless the LM head is 8-bit, which stays round to nearest).
"""

from __future__ import annotations

import dataclasses
import re
import threading

import numpy as np
import onnx_ir as ir

from exporter.errors import ExportError
from exporter.request import QUANT_METHODS
from exporter.packaging import prequantized
from exporter.cores import in_order, usable_cores
from exporter.packaging.checkpoint import BLOCK_BYTES, CheckpointTensor, transpose
from exporter.graph.passes.dtype import make_initializer

MS_DOMAIN = "com.microsoft"
# Block sizes onnxruntime's blockwise quantizer (MLAS) takes.
ORT_BLOCK_SIZES = (16, 32, 64, 128, 256)
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's weight, and its index
# What each of QUANT_METHODS does. HQQ quantizes 4-bit weights only: at 8 bits round to nearest is
# already within 0.01 nats of KL (benchmarks/results/quant_quality.json) and keeps integer zero points.
METHOD_DESCRIPTIONS = {
    "rtn": "onnxruntime block quantizer (quantize_matmul_4bits / _8bits), round to nearest",
    "hqq": "onnxruntime HQQ (HQQWeightOnlyQuantizer.quantize_internal: half-quadratic zero-point optimization, "
           "float zero points) for 4-bit weights; 8-bit ones round to nearest",
}
# A GPTQ / AWQ checkpoint's linears keep the codes, zero points and scales it ships (``method`` of
# their QuantScheme): repacked, never quantized here.
IMPORTED_DESCRIPTION = "imported from the checkpoint's {label} codes, zero points and scales, repacked (not re-quantized)"


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    bits: int
    block_size: int
    symmetric: bool
    method: str = "rtn"  # QUANT_METHODS

    @classmethod
    def of(cls, summary: dict) -> QuantScheme:
        """The scheme a quantized initializer's manifest summary (``QuantizedPart.source_summary``) names."""
        return cls(summary["bits"], summary["block_size"], summary["symmetric"], summary.get("method", "rtn"))

    @property
    def float_zero_points(self) -> bool:
        """HQQ's zero points: one float per block in the scales' dtype, unpacked (MatMulNBits' T1)."""
        return self.method == "hqq"

    def layout(self, k: int) -> tuple[int, int, int]:
        """(k_blocks, blob bytes per block, zero-point entries per column: packed bytes, or one float
        per block)."""
        k_blocks = -(-k // self.block_size)
        per_byte = 8 // self.bits
        return k_blocks, self.block_size // per_byte, k_blocks if self.float_zero_points else -(-k_blocks // per_byte)

    def default_zero_point(self) -> int:
        return 1 << (self.bits - 1)


def quantize_block(weight_kn: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """onnxruntime's block quantizer on one ``[K, n]`` block: packed ``[n, k_blocks, blob]``,
    scales ``[n, k_blocks]`` (the block's dtype), zero points ``[n, zp bytes]`` (HQQ: ``[n, k_blocks]``
    floats)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if scheme.method == "hqq":
        return quantize_hqq(np.ascontiguousarray(weight_kn.T), scheme.bits, scheme.block_size)
    k, n = weight_kn.shape
    k_blocks, blob, zp_bytes = scheme.layout(k)
    if weight_kn.dtype.name == "bfloat16" or scheme.block_size not in ORT_BLOCK_SIZES:
        # onnxruntime's quantizer takes fp32 or fp16 only (a bf16 array is converted to a copy, and
        # the scales it writes there are lost), and blocks of 16 to 256 only (an expert's int8 rows
        # are one block each). Its algorithm, as for fp16: the scale rounded to the stored dtype,
        # each element quantized by that stored scale.
        packed, scales, zero_points = quantize_rows(np.ascontiguousarray(weight_kn.T), scheme.bits,
                                                    scheme.block_size, scheme.symmetric)
        if scheme.symmetric:
            zero_points = np.zeros((n, zp_bytes), np.uint8)
        return packed, scales, zero_points
    if k_blocks * scheme.block_size != k:  # ORT's tool pads K the same way
        weight_kn = np.pad(weight_kn, ((0, k_blocks * scheme.block_size - k), (0, 0)))
    if not weight_kn.flags.c_contiguous and weight_kn.T.flags.c_contiguous:
        # a block of the checkpoint's [n, K] rows, viewed as [K, n]: copied in cache-sized tiles
        # (2048 x 4096 fp16: 41 ms of CPU against 73 ms for numpy's element-strided copy, which
        # took 24 of the 58 s an int4 export of 4 layers of the 8B geometry spent quantizing)
        weight_kn = transpose(weight_kn.T)
    weight_kn = np.ascontiguousarray(weight_kn)
    packed = np.zeros((n, k_blocks, blob), np.uint8)
    scales = np.zeros((n, k_blocks), weight_kn.dtype)
    zero_points = np.zeros((n, zp_bytes), np.uint8)
    quantize = quantize_matmul_4bits if scheme.bits == 4 else quantize_matmul_8bits
    quantize(packed, weight_kn, scales, zero_points, scheme.block_size, n, k_blocks * scheme.block_size, scheme.symmetric)
    return packed, scales, zero_points


def quantize_rows(rows: np.ndarray, bits: int, block_size: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' packed ``[n, k_blocks, blob]``, scales ``[n, k_blocks]`` (the rows' dtype) and zero
    points ``[n, zero-point bytes]`` of ``rows`` (``[n, K]``, fp32, fp16 or bf16: the weight's output columns),
    computed in numpy as onnxruntime's blockwise quantizer computes them: per block of ``block_size``
    along K (zero-padded), the symmetric scale is -(the value of largest magnitude) / 2^(bits-1) with
    the zero point at 2^(bits-1), the asymmetric one (max(max, 0) - min(min, 0)) / (2^bits - 1) with
    the zero point -min / scale rounded; each element q = clamp(round(v / scale + zp), 0, 2^bits - 1)
    (as v times the float32 reciprocal of the stored scale), rounding half away from zero."""
    n, k = rows.shape
    k_blocks = -(-k // block_size)
    if k_blocks * block_size != k:
        rows = np.pad(rows, ((0, 0), (0, k_blocks * block_size - k)))
    values = rows.reshape(n, k_blocks, block_size).astype(np.float32)
    low, high = values.min(axis=-1), values.max(axis=-1)
    top = np.float32((1 << bits) - 1)
    if symmetric:
        half = np.float32(1 << (bits - 1))
        scale = (-np.where(np.abs(high) > np.abs(low), high, low) / half).astype(rows.dtype)
        zero = np.full((n, k_blocks), half, np.float32)
    else:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
        scale32 = (high - low) / top
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(scale32 != 0, np.float32(0) - low / scale32, low)
        zero = np.clip(_round_half_away(zero), 0, top)
        scale = scale32.astype(rows.dtype)
    stored = scale.astype(np.float32)
    with np.errstate(divide="ignore"):
        reciprocal = np.where(stored != 0, np.float32(1) / stored, np.float32(0)).astype(np.float32)
    # in place, on this function's own float32 copy: the same products and sums, two fewer block-sized
    # temporaries (each a fresh mapping the kernel zero-fills, on every thread quantizing)
    values *= reciprocal[..., None]
    values += zero[..., None]
    q = _round_half_away(values)
    np.clip(q, 0, top, out=q)
    q = q.astype(np.uint8).reshape(n, k_blocks * block_size)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else q
    zero_points = np.zeros((n, 0), np.uint8)
    if not symmetric:
        z = zero.astype(np.uint8)
        if bits == 4:
            z = np.pad(z, ((0, 0), (0, k_blocks % 2)))
            z = z[:, 0::2] | (z[:, 1::2] << 4)
        zero_points = z
    return packed.reshape(n, k_blocks, -1), scale, zero_points


def quantize_hqq(rows: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """onnxruntime's HQQ on ``rows`` (``[n, K]``, fp32, fp16 or bf16): packed ``[n, k_blocks, blob]``,
    scales and float zero points ``[n, k_blocks]`` in the rows' dtype, MatMulNBits' layout.

    ``HQQWeightOnlyQuantizer.quantize_internal`` as onnxruntime's HQQ path calls it for a MatMul (axis
    1, zero rounded before the optimization, K zero-padded to whole blocks), in fp32; its codes are
    packed as its ``pack_on_row_fast_248bit`` packs them (low nibble first). Its optimizer stops when
    the mean error over what it is given stops falling, so the codes depend on the rows given
    together: the export gives one checkpoint block of rows (``BLOCK_BYTES``) at a time."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    n, k = rows.shape
    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits))
    with torch.no_grad():
        codes, scales, zeros = quantizer.quantize_internal(torch.from_numpy(np.array(rows, np.float32)),
                                                           bits=bits, group_size=block_size)
    q = codes.numpy().astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else q
    k_blocks = q.shape[1] // block_size
    return (packed.reshape(n, k_blocks, -1), scales.numpy().reshape(n, k_blocks).astype(rows.dtype),
            zeros.numpy().reshape(n, k_blocks).astype(rows.dtype))


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf on float32, exactly: numpy's rint rounds ties to even, so the (rare) ties are
    moved away from zero afterwards (x - rint(x) is exact in float32)."""
    rounded = np.rint(x)
    off = np.subtract(x, rounded)
    ties = np.abs(off, out=off) == np.float32(0.5)
    if ties.any():
        whole = np.trunc(x[ties])
        rounded[ties] = whole + np.sign(x[ties])
    return rounded


def dequantize(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, scheme: QuantScheme, k: int) -> np.ndarray:
    """``[n, K]`` float32 from MatMulNBits' packed layout (the inverse the kernels apply)."""
    n = packed.shape[0]
    k_blocks = packed.shape[1]
    if scheme.bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k_blocks, scheme.block_size)
    else:
        q = packed.reshape(n, k_blocks, scheme.block_size)
    if zero_points is None:
        zp = np.full((n, k_blocks), scheme.default_zero_point(), np.float32)
    elif zero_points.dtype != np.uint8:  # HQQ's float zero points, one per block
        zp = zero_points.reshape(n, k_blocks).astype(np.float32)
    elif scheme.bits == 4:
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :k_blocks].astype(np.float32)
    else:
        zp = zero_points.reshape(n, k_blocks).astype(np.float32)
    values = (q.astype(np.float32) - zp[..., None]) * scales.reshape(n, k_blocks).astype(np.float32)[..., None]
    return values.reshape(n, -1)[:, :k]


class _Quantization:
    """One weight's quantization, shared by its packed / scales / zero-point initializers.

    The packed tensor streams to the file block by block and keeps the (small) scales and zero
    points it computed; whichever initializer is written first triggers the pass. Thread-safe:
    ``ir.save`` may write several tensors at once.
    """

    def __init__(self, source: CheckpointTensor, scheme: QuantScheme, per_row: bool = False):
        self.source, self.scheme, self.per_row = source, scheme, per_row  # per_row: one block per row (QMoE int8)
        if source.transposed:  # a MatMul's W_T: [K, N], quantized by output column
            self.k, self.n = (int(d) for d in source.shape.numpy())
        else:  # experts' rows, [experts, N, K] as [experts * N, K]: quantized by row
            self.k, self.n = int(source.shape[-1]), source.rows2d()
        self.experts = source.experts
        self._lock = threading.Lock()
        self._small: tuple[np.ndarray, np.ndarray] | None = None

    def blocks(self, workers: int | None = None):
        """(column offset, packed, scales, zero points) per source block, in order.

        Round to nearest quantizes every output column on its own, so the blocks are independent
        and ``workers`` threads (default: the cores this process may use) read, convert, transpose
        and quantize several at once, in blocks the smaller the more workers there are, so that what
        they hold together stays about two serial blocks (up to 32 workers); the bytes are the same
        whatever the blocks. onnxruntime's quantizer holds the GIL but spreads each call over the
        cores itself; the reading, the casts and the transposes around it are numpy, which releases
        it. HQQ's codes depend on the rows optimized together, and its torch ops use every core
        already: it keeps one block of ``BLOCK_BYTES`` at a time."""
        if self.scheme.method == "hqq":
            workers, block_bytes = 1, BLOCK_BYTES
        else:
            workers = usable_cores() if workers is None else workers
            block_bytes = max(BLOCK_BYTES // 16, min(BLOCK_BYTES, 2 * BLOCK_BYTES // workers))

        def quantized(item):
            offset, read = item
            block = read()  # transposed: [K, n] of output columns; else [n, K] rows
            return (offset, *quantize_block(block if self.source.transposed else block.T, self.scheme))

        yield from in_order(quantized, self.source.block_reads(block_bytes), workers, name="quantize")

    def run(self, packed_file=None) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._small is not None and packed_file is None:
                return self._small
            k_blocks, _, zp_bytes = self.scheme.layout(self.k)
            scales = np.empty((self.n, k_blocks), self.source.dtype.numpy())
            zero_points = np.empty((self.n, zp_bytes), scales.dtype if self.scheme.float_zero_points else np.uint8)
            for offset, packed, s, zp in self.blocks():
                if packed_file is not None:
                    packed_file.write(packed.tobytes())
                scales[offset : offset + s.shape[0]] = s
                zero_points[offset : offset + zp.shape[0]] = zp
            self._small = (scales, zero_points)
            return self._small


class _ImportedQuantization(_Quantization):
    """A GPTQ / AWQ checkpoint's own codes, zero points and scales for one MatMul's weight (its parts
    one after another along N), repacked into MatMulNBits' layout block of columns by block."""

    def blocks(self):
        checkpoint, offset = self.source.checkpoint, 0
        step = max(1, BLOCK_BYTES // (self.k * 4))
        for part in self.source.parts:
            first, end = part.rows or (0, checkpoint.shape(part.name)[0])
            for r0 in range(first, end, step):
                r1 = min(end, r0 + step)
                q, zeros, scales = checkpoint.packed_codes(part.name, r0, r1)
                packed, zero_points = prequantized.matmul_nbits_layout(q, zeros, self.scheme.bits, self.scheme.block_size)
                yield offset + r0 - first, packed, scales.astype(self.source.dtype.numpy()), zero_points
            offset += end - first


def imported_scheme(source: CheckpointTensor, name: str, bits: int) -> QuantScheme | None:
    """The scheme of a weight whose every part is a GPTQ / AWQ linear of the checkpoint (None for a
    float weight), refused where its codes cannot be taken as they are."""
    checkpoint = source.checkpoint
    packed = [p.name in checkpoint.linears for p in source.parts]
    if not any(packed):
        return None
    fmt = checkpoint.prequantized
    if not all(packed) or any(p.add or p.expert is not None or p.transposed for p in source.parts):
        raise ExportError(f"{name} joins {fmt.method} codes with float weights or transforms them: the exporter "
                          "imports a packed linear only as the checkpoint stores it")
    if bits != fmt.bits:
        raise ExportError(f"{name} is stored as {fmt.label} but this export gives it {bits} bits: export "
                          f"int{fmt.bits} to keep the checkpoint's codes, or a float dtype to dequantize them")
    symmetric = all(checkpoint.packed_symmetric(p.name) for p in source.parts)
    return QuantScheme(fmt.bits, fmt.group_size, symmetric, fmt.method)


class QuantizedPart(ir.LazyTensor):
    """One of a quantized weight's three initializers: ``packed``, ``scales`` or ``zero_points``."""

    def __init__(self, quantization: _Quantization, role: str, name: str):
        self.quantization, self.role = quantization, role
        k_blocks, blob, zp_bytes = quantization.scheme.layout(quantization.k)
        n, experts = quantization.n, quantization.experts
        if experts:  # QMoE: [experts, N, K / pack], scales [experts, N(, blocks)], zero points likewise
            rows = (experts, n // experts)
            per_block = () if quantization.per_row else (k_blocks,)
            shapes = {"packed": (*rows, k_blocks * blob), "scales": (*rows, *per_block),
                      "zero_points": (*rows, *(() if quantization.per_row else (zp_bytes,)))}
        else:
            shapes = {"packed": (n, k_blocks, blob), "scales": (n * k_blocks,), "zero_points": (n * zp_bytes,)}
        floats = role == "scales" or (role == "zero_points" and quantization.scheme.float_zero_points)
        dtype = quantization.source.dtype if floats else ir.DataType.UINT8
        shape = shapes[role]
        super().__init__(self._materialize, dtype=dtype, shape=ir.Shape(shape), name=name)

    def _materialize(self) -> ir.Tensor:
        shape = tuple(int(d) for d in self.shape.numpy())
        if self.role == "packed":
            packed = np.concatenate([p for _, p, _, _ in self.quantization.blocks()])
            return ir.Tensor(packed.reshape(shape), name=self.name)
        scales, zero_points = self.quantization.run()
        array = scales if self.role == "scales" else zero_points
        return ir.Tensor(array.reshape(shape), name=self.name)

    def tofile(self, file) -> None:
        if self.role == "packed":
            self.quantization.run(packed_file=file)
        else:
            file.write(self._materialize().numpy().tobytes())

    def source_summary(self) -> dict:
        q = self.quantization
        summary = {"quantization": {"role": self.role, "bits": q.scheme.bits, "block_size": q.scheme.block_size,
                                    "symmetric": q.scheme.symmetric, "K": q.k, "N": q.n,
                                    "of": q.source.name}}
        if q.scheme.method != "rtn":  # absent for round to nearest: earlier manifests read the same
            summary["quantization"]["method"] = q.scheme.method
        if self.role == "packed":
            summary.update(q.source.source_summary())
        else:
            summary["computed"] = True
        return summary


def _replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """``new`` in ``old``'s place: inserted before it, given its output's name, type and shape (a graph
    output keeps its name), every use moved over, ``old`` removed."""
    graph.insert_before(old, new)
    name = old.outputs[0].name
    old.outputs[0].name = None
    new.outputs[0].name = name
    new.outputs[0].shape, new.outputs[0].type = old.outputs[0].shape, old.outputs[0].type
    old.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(old, safe=True)


# Gated DeltaNet's beta / decay projection (components/gated_deltanet.py DELTANET_GATES): kept in float.
RECURRENT_GATES = ".linear_attn.in_proj_ba.weight"


def tensor_role(weight_name: str, num_layers: int, is_lm_head: bool) -> set[str]:
    roles = set()
    if is_lm_head:
        roles.add("lm_head")
    match = LAYER_NAME.search(weight_name)
    if match:
        layer = int(match.group(1))
        if layer == 0:
            roles.add("first_layer")
        if layer == num_layers - 1:
            roles.add("last_layer")
    return roles


class QuantizeMatMulPass(ir.passes.InPlacePass):
    """Every ``MatMul`` on a pre-transposed checkpoint weight becomes ``MatMulNBits`` unless the
    policy keeps its role; ``decisions`` records what happened to each weight (for the manifest).
    ``accuracy_level``: one for every node, or one per weight width (an int8 LM head of an int4 export
    gets the 8-bit one). ``method``: QUANT_METHODS, for the 4-bit weights (8-bit ones round to nearest)."""

    def __init__(self, bits: int, block_size: int, symmetric: bool, *, num_layers: int, logits: str,
                 lm_head_bits: int | None = None, keep: tuple[str, ...] = (), accuracy_level: int | dict[int, int] = 0,
                 method: str = "rtn", int8_layers: tuple[int, ...] = ()):
        super().__init__()
        if method not in QUANT_METHODS or (method == "hqq" and symmetric):
            raise ExportError(f"quant method must be one of {', '.join(QUANT_METHODS)} (hqq with symmetric false), "
                              f"got {method!r} (symmetric {symmetric})")
        self.bits, self.block_size, self.symmetric, self.method = bits, block_size, symmetric, method
        self.num_layers, self.logits = num_layers, logits
        self.lm_head_bits, self.keep, self.accuracy_level = lm_head_bits, set(keep), accuracy_level
        self.int8_layers = set(int8_layers)
        self.decisions: dict[str, dict] = {}

    def _bits(self, weight_name: str, roles: set[str]) -> tuple[int, str | None]:
        """A weight's width and, where it is not the export's, why."""
        if "lm_head" in roles and self.lm_head_bits:
            return self.lm_head_bits, None  # its role says why
        match = LAYER_NAME.search(weight_name)
        if self.bits == 4 and match and int(match.group(1)) in self.int8_layers:
            return 8, "int8_layers"
        return self.bits, None

    def _feeds_router(self, node: ir.Node, weight: ir.Value) -> bool:
        """A mixture of experts' router (its logits reach a MoE / QMoE op's routing inputs, or the TopK that
        picks experts where the graph runs them itself: gemma4 on the CPU) or a shared expert's gate: few rows that
        decide where every token goes, kept in float."""
        if weight.name and "shared_expert_gate" in weight.name:
            return True
        # Forward through the routing arithmetic (a bias, a reshape, phimoe's sparsemixer), never
        # through another projection or the ops that end a branch.
        stops = {"MatMul", "MatMulNBits", "MoE", "QMoE", "Attention", "GroupQueryAttention"}
        frontier, seen = [node.outputs[0]], set()
        for _ in range(24):
            users = [(user, index) for v in frontier for user, index in v.uses()]
            if any(user.op_type in ("MoE", "QMoE") and index in (1, 14) or user.op_type == "TopK"
                   for user, index in users):
                return True
            frontier = [out for user, _ in users if user.op_type not in stops and id(user) not in seen
                        for out in user.outputs]
            seen.update(id(user) for user, _ in users)
            if not frontier:
                return False
        return False

    def _feeds_logits(self, node: ir.Node) -> bool:
        """The LM head: the last MatMul before the logits output (scalings may follow it)."""
        frontier = [node.outputs[0]]
        for _ in range(4):
            if any(v.name == self.logits for v in frontier):
                return True
            frontier = [out for v in frontier for user, _ in v.uses() if user.op_type != "MatMul" for out in user.outputs]
        return any(v.name == self.logits for v in frontier)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = 0
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
                continue
            weight = node.inputs[1]
            source = weight.const_value if weight is not None else None
            if not isinstance(source, CheckpointTensor) or not source.transposed or len(source.shape) != 2:
                continue
            roles = tensor_role(weight.name, self.num_layers, self._feeds_logits(node))
            if self._feeds_router(node, weight):
                roles.add("router")
            if weight.name and RECURRENT_GATES in weight.name:
                roles.add("recurrent_gate")
            kept = sorted(roles & (self.keep | {"router", "recurrent_gate"}))
            if kept:
                self.decisions[weight.name] = {"quantized": False, "kept_for": kept, "roles": sorted(roles)}
                continue
            if "lm_head" in roles and self.lm_head_bits is None and source.checkpoint.prequantized \
                    and not any(p.name in source.checkpoint.linears for p in source.parts):
                # The export is the checkpoint as its quantizer left it: a float LM head stays float.
                self.decisions[weight.name] = {"quantized": False, "kept_for": ["lm_head"], "roles": sorted(roles),
                                               "why": f"float in the {source.checkpoint.prequantized.method} checkpoint; "
                                                      "quant lm_head_bits 4 / 8 quantizes it"}
                continue
            bits, why = self._bits(weight.name, roles)
            method = self.method if bits == 4 else "rtn"
            scheme = QuantScheme(bits, self.block_size, self.symmetric, method)
            imported = imported_scheme(source, weight.name, bits)
            if imported is not None:
                if why:
                    raise ExportError(f"{weight.name} is a {imported.method} linear of {imported.bits} bits: "
                                      f"{why} cannot give it more; drop quant {why}")
                scheme, method = imported, imported.method
            quantization = (_ImportedQuantization if imported else _Quantization)(source, scheme)
            tag = {"hqq": "h", "gptq": "g", "awq": "w"}.get(method, "")
            stem = f"{weight.name}.q{bits}b{scheme.block_size}{'s' if scheme.symmetric else 'a'}{tag}"
            inputs = [node.inputs[0]]
            for role in ("packed", "scales") + (() if scheme.symmetric else ("zero_points",)):
                name = f"{stem}.{role}"
                value = graph.initializers[name] if name in graph.initializers else \
                    make_initializer(graph, QuantizedPart(quantization, role, name), name)
                inputs.append(value)
            level = self.accuracy_level.get(bits, 0) if isinstance(self.accuracy_level, dict) else self.accuracy_level
            attrs = {"K": quantization.k, "N": quantization.n, "bits": bits, "block_size": scheme.block_size,
                     "accuracy_level": level}
            new = ir.node("MatMulNBits", inputs, attributes=attrs, domain=MS_DOMAIN,
                          name=f"{node.name or weight.name}_nbits", num_outputs=1)
            _replace_node(graph, node, new)
            self.decisions[weight.name] = {"quantized": True, "bits": bits, "block_size": scheme.block_size,
                                           "symmetric": scheme.symmetric, "roles": sorted(roles),
                                           "initializer": f"{stem}.packed",
                                           **({"method": method} if method != "rtn" or self.method != "rtn" else {}),
                                           **({"bits_for": why} if why else {}),
                                           **({"imported": IMPORTED_DESCRIPTION.format(
                                               label=source.checkpoint.prequantized.label)} if imported else {})}
            changed += 1
        if changed:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        return ir.passes.PassResult(model, modified=bool(changed))


class GatherTiedEmbeddingPass(ir.passes.InPlacePass):
    """A tied embedding gathers its rows from the quantized LM head's own blocks.

    The graph gathers a tied table's columns from the ``[hidden, vocab]`` weight that the LM head
    multiplies by (``Gather(axis=1)`` + ``Transpose``); once the head is MatMulNBits, that float table
    is the one weight left unquantized (a third of SmolLM2-135M's int4 file). The pair becomes
    ``com.microsoft::GatherBlockQuantized`` over the head's packed codes and scales, viewed as ``[vocab,
    hidden * bits / 8]`` / ``[vocab, blocks]`` through Reshape nodes: one copy of the bytes on disk, and
    the embedding dequantizes exactly the values the head multiplies by. Skipped where K is not a
    whole number of blocks (the packed rows are padded), the head is not quantized (kept, or
    ``keep`` names ``embedding``), or its zero points are floats (HQQ; GatherBlockQuantized takes uint8
    ones only). The genai builder does the same for its int4 CPU exports."""

    def __init__(self, quantize: "QuantizeMatMulPass"):
        super().__init__()
        self.quantize = quantize

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = 0
        for gather in list(graph):
            if gather.op_type != "Gather" or gather.domain != "" or gather.attributes.get_int("axis", 0) != 1:
                continue
            table = gather.inputs[0]
            decision = self.quantize.decisions.get(table.name or "") if table is not None else None
            users = list(gather.outputs[0].uses())
            if not decision or not decision.get("quantized") or "lm_head" not in decision["roles"] or len(users) != 1:
                continue
            transpose = users[0][0]
            if transpose.op_type != "Transpose" or list(transpose.attributes.get_ints("perm", [])) != [1, 2, 0]:
                continue
            stem = decision["initializer"].removesuffix(".packed")
            packed = graph.initializers[f"{stem}.packed"]
            quantization = packed.const_value.quantization
            scheme, k, n = quantization.scheme, quantization.k, quantization.n
            if scheme.float_zero_points:
                decision["embedding"] = "float: GatherBlockQuantized takes no float zero points (hqq)"
                continue
            if k % scheme.block_size:
                continue
            k_blocks, _, zp_bytes = scheme.layout(k)
            views = [(packed, [n, k * scheme.bits // 8]), (graph.initializers[f"{stem}.scales"], [n, k_blocks])]
            if not scheme.symmetric:
                views.append((graph.initializers[f"{stem}.zero_points"], [n, zp_bytes]))
            inputs = []
            for value, shape in views:
                shape_name = f"{value.name}.gather_shape"
                shape_value = make_initializer(graph, ir.tensor(np.array(shape, np.int64), name=shape_name), shape_name)
                reshape = ir.node("Reshape", [value, shape_value], name=f"{value.name}.gather_view", num_outputs=1)
                graph.insert_before(gather, reshape)
                inputs.append(reshape.outputs[0])
            inputs.insert(1, gather.inputs[1])
            new = ir.node("GatherBlockQuantized", inputs, domain=MS_DOMAIN, name=f"{gather.name or 'embedding'}_quantized",
                          attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": scheme.block_size,
                                      "bits": scheme.bits}, num_outputs=1)
            _replace_node(graph, transpose, new)
            graph.remove(gather, safe=True)
            decision["embedding"] = "GatherBlockQuantized over these blocks (tied)"
            changed += 1
        return ir.passes.PassResult(model, modified=bool(changed))


class QuantizeExpertsPass(ir.passes.InPlacePass):
    """Every ``MoE`` on checkpoint experts becomes ``com.microsoft::QMoE``: fc1 / fc2 quantized row by
    row as MatMulNBits quantizes a weight's output columns (``[experts, N, K]`` is ``[experts * N, K]``
    rows, each quantized along K), the bytes streamed to the file a block at a time.

    - int4: blocks of ``block_size`` along K (it must divide the hidden and expert widths; the op does
      not check), codes packed two a byte, low nibble first.
    - int8: one scale per row (no ``block_size``): on the CPU EP block-wise 8-bit experts run
      int8 activations whatever the accuracy level (docs/moe-design.md), per-row ones stay exact.
    - Routing: without ``router_weights`` QMoE renormalizes the top k whatever
      ``normalize_routing_weights`` says, so a model that does not renormalize gets the softmax of its
      logits as ``router_weights`` (selection by the logits, mixing by those weights as given).
    - ``weights_prepacked=0``: the raw layout above on every EP (other values select EP-specific ones).
    """

    def __init__(self, bits: int, block_size: int, symmetric: bool, *, num_layers: int, keep: tuple[str, ...] = (),
                 accuracy_level: int = 0):
        super().__init__()
        self.bits, self.block_size, self.symmetric, self.accuracy_level = bits, block_size, symmetric, accuracy_level
        self.num_layers, self.keep = num_layers, set(keep)
        self.decisions: dict[str, dict] = {}

    def _scheme(self, k: int, name: str) -> QuantScheme:
        if self.bits == 8:
            return QuantScheme(8, k, self.symmetric)
        if k % self.block_size:
            raise ExportError(f"{name}: QMoE quantizes experts in blocks of {self.block_size} along their input width "
                              f"{k}, which it does not divide: choose a quant block_size that divides {k} (16, 32, 64 or 128)")
        return QuantScheme(self.bits, self.block_size, self.symmetric)

    def _quantized(self, graph: ir.Graph, weight: ir.Value) -> tuple[list[ir.Value | None], QuantScheme]:
        source = weight.const_value
        quantization = _Quantization(source, self._scheme(int(source.shape[-1]), weight.name), per_row=self.bits == 8)
        scheme = quantization.scheme
        stem = f"{weight.name}.q{scheme.bits}{'row' if quantization.per_row else f'b{scheme.block_size}'}" \
               f"{'s' if scheme.symmetric else 'a'}"
        values = []
        for role in ("packed", "scales", "zero_points"):
            if role == "zero_points" and scheme.symmetric:
                values.append(None)
                continue
            name = f"{stem}.{role}"
            values.append(graph.initializers[name] if name in graph.initializers else
                          make_initializer(graph, QuantizedPart(quantization, role, name), name))
        self.decisions[weight.name] = {"quantized": True, "op": "QMoE", "bits": scheme.bits,
                                       "block_size": None if quantization.per_row else scheme.block_size,
                                       "symmetric": scheme.symmetric, "roles": ["experts"], "initializer": f"{stem}.packed"}
        return values, scheme

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = 0
        for node in list(graph):
            if node.op_type != "MoE" or node.domain != MS_DOMAIN:
                continue
            x, router_probs, fc1, fc1_bias, fc2, fc2_bias = (list(node.inputs) + [None] * 6)[:6]
            if not all(isinstance(w.const_value, CheckpointTensor) for w in (fc1, fc2)):
                continue
            roles = tensor_role(fc1.name, self.num_layers, False)
            kept = sorted(roles & self.keep)
            if kept:  # the policy keeps this layer in the activation dtype: the float MoE stays
                for w in (fc1, fc2):
                    self.decisions[w.name] = {"quantized": False, "kept_for": kept, "roles": sorted(roles | {"experts"})}
                continue
            (fc1_q, fc1_scales, fc1_zp), scheme = self._quantized(graph, fc1)
            (fc2_q, fc2_scales, fc2_zp), _ = self._quantized(graph, fc2)
            attrs = {name: attr.value for name, attr in node.attributes.items()}
            if attrs.get("use_sparse_mixer"):
                raise ExportError("QMoE ignores use_sparse_mixer (CPU and CUDA both route by plain softmax top 2): "
                                  "a quantized phimoe keeps its sparsemixer in the graph; build it with dtype int4 / int8")
            router_weights = None
            if not attrs.get("normalize_routing_weights"):  # the CPU kernels renormalize without it
                softmax = ir.node("Softmax", [router_probs], attributes={"axis": -1}, num_outputs=1,
                                  name=f"{node.name or fc1.name}_router_weights")
                graph.insert_before(node, softmax)
                router_weights = softmax.outputs[0]
            attrs.update(expert_weight_bits=scheme.bits, weights_prepacked=0, accuracy_level=self.accuracy_level)
            if scheme.bits != 8:  # int8: one scale per row, no block_size
                attrs["block_size"] = scheme.block_size
            inputs = [x, router_probs, fc1_q, fc1_scales, fc1_bias, fc2_q, fc2_scales, fc2_bias,
                      None, None, None, fc1_zp, fc2_zp, None, router_weights]
            while inputs[-1] is None:
                inputs.pop()
            new = ir.node("QMoE", inputs, attributes=attrs, domain=MS_DOMAIN,
                          name=f"{node.name or fc1.name}_q{scheme.bits}", num_outputs=1)
            _replace_node(graph, node, new)
            changed += 1
        return ir.passes.PassResult(model, modified=bool(changed))
