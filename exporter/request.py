"""What a user asks for, and which graph variant that means."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json

from exporter.errors import ExportError


class DType(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT4 = "int4"  # weight-only, MatMulNBits; activations fp16 on cuda, fp32 on cpu
    INT8 = "int8"

    @property
    def bits(self) -> int | None:
        return {"int4": 4, "int8": 8}.get(self.value)

    @property
    def quantized(self) -> bool:
        return self.bits is not None


class EP(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


def activation_dtype(dtype: DType, ep: EP, chosen: str | None = None) -> DType:
    """The dtype of activations, caches and unquantized weights, as far as the request alone says. A
    quantized export computes in fp32 on cpu (x86 has no fast fp16 GEMM, and onnxruntime's CPU
    MatMulNBits has no bf16 kernel). On cuda it computes in ``chosen`` (the request's quant
    activations); without one, the pipeline measures the checkpoint
    (``exporter.validation.activation_range.choose_activations``): fp16 unless the model's activations
    do not fit it, and fp16 is what this function answers before that measurement."""
    if not dtype.quantized:
        return dtype
    if ep is not EP.CUDA:
        return DType.FP32
    return DType(chosen) if chosen is not None else DType.FP16


# What a weight-only export keeps at higher precision, by tensor role.
QUANT_KEEP_CHOICES = ("lm_head", "first_layer", "last_layer", "embedding")
# MatMulNBits accuracy levels (the minimum precision of its activations: 0 = the activation dtype,
# 4 = int8); the CPU EP acts on them, CUDA ignores them.
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# How weights are quantized: round to nearest, or onnxruntime's HQQ (graph/passes/quantize.py).
QUANT_METHODS = ("rtn", "hqq")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a quantized export quantizes: MatMulNBits block size, zero points, per-tensor policy.

    ``lm_head_bits`` quantizes the LM head at its own width (8 with int4 buys quality for a few
    percent of decode speed); ``keep`` names roles left in the activation dtype (``embedding``: a tied
    embedding stays float instead of gathering from the quantized LM head). ``accuracy_level``: every
    MatMulNBits' level; None picks by EP (graph/fold.py: int8 activations on the CPU, measured fastest
    at the quality the gates check; 0 computes in the activation dtype, exact to the dequantized weights).
    ``method``: "rtn" (round to nearest) or "hqq" (onnxruntime's HQQ for the 4-bit weights: float zero
    points, so ``symmetric`` false; graph/passes/quantize.py). It enters ``to_dict`` (the cache key) only
    when not "rtn", so every earlier export keeps its key.
    """

    block_size: int = 32
    symmetric: bool = True
    lm_head_bits: int | None = None  # None: the dtype's bits
    keep: tuple[str, ...] = ()
    activations: str | None = None  # cuda: fp16 | bf16; None: bf16 for a bf16-trained checkpoint, else fp16
    accuracy_level: int | None = None  # None: by EP (fold.CPU_ACCURACY_LEVEL)
    method: str = "rtn"  # QUANT_METHODS
    # int4 mixed precision: decoder layers whose projections get 8 bits (round to nearest), e.g. the ones
    # exporter/quant_plan.py measured as the most sensitive within a size budget
    int8_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 16 \
                or self.block_size & (self.block_size - 1):
            raise ExportError(f"quant block_size must be a power of 2 of at least 16 (MatMulNBits), got {self.block_size!r}")
        if self.lm_head_bits not in (None, 4, 8):
            raise ExportError(f"quant lm_head_bits must be 4 or 8, got {self.lm_head_bits!r}")
        keep = tuple(sorted(set(self.keep)))
        unknown = [k for k in keep if k not in QUANT_KEEP_CHOICES]
        if unknown:
            raise ExportError(f"unknown quant keep {', '.join(map(repr, unknown))}: use any of {', '.join(QUANT_KEEP_CHOICES)}")
        object.__setattr__(self, "keep", keep)
        if self.activations not in (None, "fp16", "bf16"):
            raise ExportError(f"quant activations must be fp16 or bf16 (cuda), got {self.activations!r}")
        if self.accuracy_level is not None and (isinstance(self.accuracy_level, bool)
                                                or self.accuracy_level not in ACCURACY_LEVELS):
            raise ExportError(f"quant accuracy_level must be one of {', '.join(map(str, ACCURACY_LEVELS))} (MatMulNBits: "
                              f"0 computes in the activation dtype, 4 in int8), got {self.accuracy_level!r}")
        if self.method not in QUANT_METHODS:
            raise ExportError(f"unknown quant method {self.method!r}: use rtn (round to nearest) or hqq "
                              "(half-quadratic, zero points per block)")
        if self.method == "hqq" and self.symmetric:
            raise ExportError("quant method hqq fits a zero point per block: set symmetric false (--quant-asymmetric)")
        layers = self.int8_layers
        if isinstance(layers, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                      for i in (layers or ())):
            raise ExportError(f"quant int8_layers must be a list of decoder layer indexes (0, 1, ...), got {layers!r}")
        object.__setattr__(self, "int8_layers", tuple(sorted(set(layers or ()))))

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "symmetric": self.symmetric, "lm_head_bits": self.lm_head_bits,
                "keep": list(self.keep), **({"activations": self.activations} if self.activations else {}),
                **({"accuracy_level": self.accuracy_level} if self.accuracy_level is not None else {}),
                **({"method": self.method} if self.method != "rtn" else {}),
                **({"int8_layers": list(self.int8_layers)} if self.int8_layers else {})}

    @classmethod
    def from_dict(cls, data: dict | None) -> QuantSpec:
        data = dict(data or {})
        unknown = sorted(set(data) - {"block_size", "symmetric", "lm_head_bits", "keep", "activations", "accuracy_level",
                                      "method", "int8_layers"})
        if unknown:
            raise ExportError(f"unknown quant option {', '.join(unknown)}: use block_size, symmetric, lm_head_bits, "
                              "keep, activations, accuracy_level, method, int8_layers")
        layers = data.get("int8_layers", ())
        return cls(**{**data, "keep": tuple(data.get("keep", ())),
                      "int8_layers": tuple(layers) if isinstance(layers, list) else layers})


class Variant(str, enum.Enum):
    """The attention graph an export uses (docs/graph-contracts.md has the I/O of each)."""

    ATTN_STATIC = "attn_static"
    GQA = "gqa"
    ATTN_DYNAMIC = "attn_dynamic"


def _enum_value(enum_type: type[enum.Enum], value: object, field: str) -> enum.Enum:
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum_type)
        raise ExportError(f"unknown {field} {value!r}: use one of {allowed}") from None


# Who builds the graph: "hand" is exportfarm's own architectures (exporter/graph/architectures), "traced"
# is transformers' own exporter run on the model's code (transformers.exporters, exporter/graph/traced.py),
# and "auto" takes the hand-built one where one exists, else traces.
BUILDERS = ("auto", "hand", "traced")
HAND, TRACED = "hand", "traced"


# How an export's files are laid out: "farm" (model.onnx + model.onnx.data at the root, an
# onnxruntime-genai package) or "hf" (a Hugging Face repository for transformers.js and optimum,
# exporter/packaging/hf_layout.py).
LAYOUTS = ("farm", "hf")


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    """One export as a user asks for it; ``variant`` None means "choose for me". ``layout``,
    ``compat`` (the graph in IR 10 / opset 20 for older onnxruntime, exporter/graph/target.py) and ``builder``
    (BUILDERS) enter the identity only when not the default, so the cache keys of every earlier export stay
    what they were."""

    model: str
    dtype: DType = DType.FP32
    ep: EP = EP.CPU
    static_cache: bool = False
    max_seq_len: int | None = None
    variant: Variant | None = None
    quant: QuantSpec | None = None  # quantized dtypes only; None there means the defaults
    layout: str = "farm"
    compat: bool = False
    builder: str = "auto"  # BUILDERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _enum_value(DType, self.dtype, "dtype"))
        if self.builder not in BUILDERS:
            raise ExportError(f"unknown builder {self.builder!r}: use auto (hand-built where the exporter has the "
                              "architecture, else traced), hand (exportfarm's own graphs only) or traced "
                              "(transformers.exporters)")
        if self.layout not in LAYOUTS:
            raise ExportError(f"unknown layout {self.layout!r}: use farm (model.onnx at the root, what onnxruntime-genai "
                              "reads) or hf (a Hugging Face repository for transformers.js and optimum)")
        if not isinstance(self.compat, bool):
            raise ExportError(f"compat must be true or false, got {self.compat!r}")
        if isinstance(self.quant, dict):
            object.__setattr__(self, "quant", QuantSpec.from_dict(self.quant))
        if self.dtype.quantized and self.quant is None:
            object.__setattr__(self, "quant", QuantSpec())
        if not self.dtype.quantized and self.quant is not None:
            raise ExportError(f"quant options apply to int4 / int8 only, not {self.dtype.value}: drop them or pick int4 / int8")
        if self.quant is not None and self.quant.int8_layers and self.dtype.bits != 4:
            raise ExportError(f"quant int8_layers gives some layers of an int4 export 8 bits: use dtype int4, or drop "
                              f"it for {self.dtype.value}")
        if self.quant is not None and self.quant.method == "hqq" and self.dtype.bits != 4:
            raise ExportError(f"quant method hqq quantizes 4-bit weights: use dtype int4, or method rtn for {self.dtype.value}")
        object.__setattr__(self, "ep", _enum_value(EP, self.ep, "execution provider"))
        if self.variant is not None:
            object.__setattr__(self, "variant", _enum_value(Variant, self.variant, "variant"))
        if self.quant is not None and self.quant.activations and self.ep is not EP.CUDA:
            raise ExportError(f"quant activations {self.quant.activations} apply to cuda only: a quantized cpu export "
                              "computes in fp32 (onnxruntime's CPU MatMulNBits has no bf16 kernel); drop it")
        if not self.model or not str(self.model).strip():
            raise ExportError("model is empty: pass a local checkpoint directory or a hub id")
        if self.max_seq_len is not None and (
            isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0
        ):
            raise ExportError(f"max_seq_len must be a positive integer, got {self.max_seq_len!r}")

    def resolved_variant(self) -> Variant:
        """The variant this request builds, refusing combinations that cannot work."""
        variant = self.variant
        if variant is None:
            if self.static_cache:
                variant = Variant.ATTN_STATIC
            elif self.layout == "hf" or self.compat:
                variant = Variant.ATTN_DYNAMIC  # what transformers.js and optimum drive; compat's only one
            elif self.ep is EP.CUDA and activation_dtype(self.dtype, self.ep) in (DType.FP16, DType.BF16):
                variant = Variant.GQA
            else:
                variant = Variant.ATTN_DYNAMIC
        if self.builder == TRACED:
            from exporter.graph.traced import check_traced_request

            check_traced_request(self)
            variant = Variant.ATTN_DYNAMIC  # the one contract a traced graph is mapped onto
        if self.static_cache and variant is not Variant.ATTN_STATIC:
            raise ExportError(
                f"static_cache needs the attn_static variant, not {variant.value}: "
                "drop the variant or drop static_cache"
            )
        if variant is Variant.ATTN_STATIC and self.max_seq_len is None:
            raise ExportError(
                "a static cache needs its buffer length: set max_seq_len (CLI: --max-seq-len N), "
                "the longest prompt + output"
            )
        if variant is Variant.GQA and self.ep is EP.CUDA and self.activations is DType.FP32:
            raise ExportError(
                "GroupQueryAttention has no fp32 kernel on the CUDA execution provider (fp16 / bf16 only): "
                "use the attn_dynamic or attn_static variant for fp32 on cuda, or dtype fp16 / bf16"
            )
        if variant is Variant.GQA and self.dtype is DType.BF16 and self.ep is EP.CPU:
            raise ExportError(
                "GroupQueryAttention has no bf16 kernel on the CPU execution provider: "
                "use dtype fp16/fp32 for cpu, or ep cuda for bf16"
            )
        chosen = self.quant.activations if self.quant else None
        if chosen == "bf16" and (self.layout == "hf" or self.compat):
            raise ExportError(
                f"quant activations bf16 cannot be {'laid out for transformers.js' if self.layout == 'hf' else 'run by older onnxruntime (compat)'}"
                ": neither has bf16 kernels for these graphs; set quant activations fp16 (model_q4f16.onnx)")
        if self.layout == "hf":
            from exporter.packaging.hf_layout import check_request

            check_request(self.dtype.value, variant.value, self.ep.value)
        if self.compat:
            from exporter.graph.target import check_compat

            check_compat(variant.value, self.dtype.value, self.ep.value)
        return variant

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "dtype": self.dtype.value,
            "ep": self.ep.value,
            "static_cache": self.static_cache,
            "max_seq_len": self.max_seq_len,
            "variant": self.variant.value if self.variant else None,
            **({"quant": self.quant.to_dict()} if self.quant else {}),
            **({"layout": self.layout} if self.layout != "farm" else {}),
            **({"compat": True} if self.compat else {}),
            **({"builder": self.builder} if self.builder != "auto" else {}),
        }

    @property
    def activations(self) -> DType:
        """The activation dtype as far as the request says (a quantized cuda export without a chosen one
        is measured on its checkpoint by the pipeline: ``activation_range.choose_activations``)."""
        return activation_dtype(self.dtype, self.ep, self.quant.activations if self.quant else None)


def build_tag(layout: str | None, compat: bool | None) -> str:
    """'-hf' / '-compat' for the builds that are not the farm layout on the current target: the suffix
    of their catalog slot and of their object prefix."""
    return ("-hf" if layout == "hf" else "") + ("-compat" if compat else "")


def cache_key(request: ExportRequest, revision: str, exporter_version: str, ort_version: str) -> str:
    """Identity of an export: same key, same artifact (the scheduler re-exports when ORT moves)."""
    payload = {
        "request": {**request.to_dict(), "variant": request.resolved_variant().value},
        "revision": revision,
        "exporter": exporter_version,
        "onnxruntime": ort_version,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
