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


class EP(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


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


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    """One export as a user asks for it; ``variant`` None means "choose for me"."""

    model: str
    dtype: DType = DType.FP32
    ep: EP = EP.CPU
    static_cache: bool = False
    max_seq_len: int | None = None
    variant: Variant | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _enum_value(DType, self.dtype, "dtype"))
        object.__setattr__(self, "ep", _enum_value(EP, self.ep, "execution provider"))
        if self.variant is not None:
            object.__setattr__(self, "variant", _enum_value(Variant, self.variant, "variant"))
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
            elif self.ep is EP.CUDA and self.dtype in (DType.FP16, DType.BF16):
                variant = Variant.GQA
            else:
                variant = Variant.ATTN_DYNAMIC
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
        if variant is Variant.GQA and self.dtype is DType.BF16 and self.ep is EP.CPU:
            raise ExportError(
                "GroupQueryAttention has no bf16 kernel on the CPU execution provider: "
                "use dtype fp16/fp32 for cpu, or ep cuda for bf16"
            )
        return variant

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "dtype": self.dtype.value,
            "ep": self.ep.value,
            "static_cache": self.static_cache,
            "max_seq_len": self.max_seq_len,
            "variant": self.variant.value if self.variant else None,
        }


def cache_key(request: ExportRequest, revision: str, exporter_version: str, ort_version: str) -> str:
    """Identity of an export: same key, same artifact (the scheduler re-exports when ORT moves)."""
    payload = {
        "request": {**request.to_dict(), "variant": request.resolved_variant().value},
        "revision": revision,
        "exporter": exporter_version,
        "onnxruntime": ort_version,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
