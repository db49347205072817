"""Request and response bodies of the API (separate from the database models).

Requests are strict: a boolean is true or false (not 1, not "yes"), an integer is a JSON integer
(not true, not "4096"), a model id has no whitespace or control characters, and unknown fields are
refused, each with a message naming the field.
"""

from __future__ import annotations

import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from exporter.errors import ExportError
from exporter.request import ExportRequest
from services.auth import SCOPES
from services.catalog.exports import PUBLISHED_STATUSES
from services.catalog.models import ApiToken, Export
from services.sources import check_model_id

Strict = ConfigDict(extra="forbid", strict=True)
Name = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.@:-]*$")]


class QuantOptions(BaseModel):
    """Weight-only quantization (dtype int4 / int8): MatMulNBits block size, zero points, policy."""

    model_config = Strict

    block_size: int = Field(32, ge=16, le=4096, description="a power of 2, at least 16")
    symmetric: bool = Field(True, description="false: a zero point per block")
    lm_head_bits: Literal[4, 8] | None = Field(None, description="the LM head's width (default: the dtype's)")
    keep: list[Literal["lm_head", "first_layer", "last_layer", "embedding"]] = Field(
        default_factory=list, max_length=4, description="roles left unquantized")
    accuracy_level: Literal[0, 1, 2, 3, 4] | None = Field(
        None, description="MatMulNBits accuracy level on cpu (0: fp32 activations, 4: int8); default by EP")
    method: Literal["rtn", "hqq"] = Field(
        "rtn", description="rtn: round to nearest; hqq: onnxruntime's HQQ for int4 (needs symmetric false)")
    int8_layers: list[Annotated[int, Field(ge=0, le=4095)]] = Field(
        default_factory=list, max_length=512,
        description="int4 mixed precision: decoder layers whose projections get 8 bits (exportfarm quant-plan "
                    "measures which)")


class ExportCreate(BaseModel):
    """An export request. The variant follows from the rest unless given."""

    model_config = ConfigDict(
        extra="forbid", strict=True,
        json_schema_extra={"examples": [
            {"model": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "fp16", "ep": "cuda"},
            {"model": "microsoft/Phi-3.5-mini-instruct@main", "dtype": "fp16", "ep": "cuda",
             "static_cache": True, "max_seq_len": 4096},
        ]},
    )

    model: str = Field(..., min_length=1, max_length=300,
                       description="a model directory name under MODELS_DIR, or a hub id 'org/name[@revision]'")
    dtype: Literal["fp32", "fp16", "bf16", "int4", "int8"] = Field(
        "fp16", description="int4 / int8: weight-only (MatMulNBits), activations fp16 on cuda, fp32 on cpu")
    ep: Literal["cpu", "cuda"] = "cuda"
    static_cache: bool = False
    max_seq_len: int | None = Field(None, gt=0, le=1 << 20, description="context length; required with static_cache")
    variant: Literal["attn_static", "gqa", "attn_dynamic"] | None = None
    quant: QuantOptions | None = Field(None, description="int4 / int8 only")
    layout: Literal["farm", "hf"] = Field(
        "farm", description="farm: model.onnx at the root, an onnxruntime-genai package; hf: a Hugging Face "
        "repository (config.json, onnx/model*.onnx) for transformers.js and optimum, attn_dynamic only")
    compat: bool = Field(False, description="the graph in IR 10 / opset 20 for older runtimes (transformers.js 3.x): "
                         "attn_dynamic, fp32 / fp16 / int4 / int8, dense models")
    builder: Literal["auto", "hand", "traced"] = Field(
        "auto", description="auto: exportfarm's hand-built graph where it has the architecture, else traced; hand: "
        "refuse a model without one; traced: transformers' own exporter (transformers.exporters), attn_dynamic only")
    force: bool = Field(False, description="export again even if an identical export exists")

    @model_validator(mode="after")
    def _consistent(self) -> ExportCreate:
        try:
            check_model_id(self.model)
            self.to_request().resolved_variant()
        except ExportError as err:
            raise ValueError(str(err)) from None
        return self

    def to_request(self) -> ExportRequest:
        return ExportRequest(model=self.model, dtype=self.dtype, ep=self.ep, static_cache=self.static_cache,
                             max_seq_len=self.max_seq_len, variant=self.variant,
                             quant=self.quant.model_dump() if self.quant else None, layout=self.layout,
                             compat=self.compat, builder=self.builder)


class Links(BaseModel):
    self: str
    artifacts: str | None = None


class ExportEventOut(BaseModel):
    at: datetime.datetime
    from_status: str | None
    to_status: str
    stage: str | None
    message: str | None
    worker: str | None


class ExportOut(BaseModel):
    id: str
    status: str
    stage: str | None
    percent: int
    error: str | None
    model: str
    revision: str
    cache_key: str = Field(description="the export's identity; equal to its published manifest's")
    variant: str
    dtype: str
    quant: dict | None = Field(None, description="int4 / int8: the quantization options")
    queue: str | None = Field(None, description="the worker class it was placed on")
    estimate: dict | None = Field(None, description="the resource estimate it was placed by (GiB)")
    ep: str
    static_cache: bool
    max_seq_len: int | None
    layout: str = Field("farm", description="how the published files are laid out: farm or hf")
    compat: bool = Field(False, description="IR 10 / opset 20 graph for older runtimes")
    builder: str = Field("auto", description="the builder the request asked for: auto, hand or traced")
    built_by: dict | None = Field(None, description="who built the published graph and its version (the manifest's "
                                  "builder: exportfarm, or transformers.exporters)")
    ort_version: str
    reason: str
    predecessor_id: str | None
    worker: str | None
    attempts: int
    cancel_requested: bool = False
    target_ort: str | None = None
    lost_reason: str | None = Field(None, description="how the last lost attempt died")
    dispatched_at: datetime.datetime | None = Field(None, description="when its message was last sent")
    storage_prefix: str | None
    figures: dict | None
    timings: dict | None
    regression: bool = False
    created_at: datetime.datetime
    started_at: datetime.datetime | None
    finished_at: datetime.datetime | None
    links: Links
    events: list[ExportEventOut] = []

    @classmethod
    def of(cls, export: Export, with_events: bool = False) -> ExportOut:
        # Column fields only: touching ``events`` would lazy-load a relationship per listed row.
        data = {c: getattr(export, c) for c in _EXPORT_FIELDS}
        data["status"] = export.status.value
        data["built_by"] = (export.manifest or {}).get("builder")
        base = f"/exports/{export.id}"
        links = Links(self=base, artifacts=f"{base}/artifacts" if export.status in PUBLISHED_STATUSES else None)
        events = [ExportEventOut.model_validate(e, from_attributes=True) for e in export.events] if with_events else []
        return cls(**data, links=links, events=events)


_EXPORT_FIELDS = tuple(name for name in ExportOut.model_fields if name not in ("links", "events", "built_by"))


class ExportList(BaseModel):
    items: list[ExportOut]
    total: int
    limit: int
    offset: int


class Artifact(BaseModel):
    url: str
    size: int
    sha256: str


class Artifacts(BaseModel):
    export_id: str
    prefix: str
    expires_in_s: int
    files: dict[str, Artifact]


class ReexportRequest(BaseModel):
    """Re-export exports built on an older onnxruntime than the newest live worker's."""

    model_config = Strict

    policy: Literal["all", "listed", "dry-run"] | None = Field(None, description="default: REEXPORT_POLICY")
    models: list[Annotated[str, StringConstraints(min_length=1, max_length=300)]] | None = Field(
        None, max_length=1000, description="with policy 'listed' (default: REEXPORT_MODELS)")
    limit: int | None = Field(None, ge=0, le=1000, description="lower the in-flight cap for this run (REEXPORT_MAX_IN_FLIGHT)")


class TokenCreate(BaseModel):
    model_config = Strict

    name: Name
    scope: Literal[SCOPES] = "read"  # type: ignore[valid-type]
    expires_in_s: int | None = Field(None, ge=60, le=10 * 365 * 86400, description="default: never expires")


class TokenOut(BaseModel):
    id: int
    name: str
    scope: str
    bootstrap: bool
    created_at: datetime.datetime
    expires_at: datetime.datetime | None
    last_used_at: datetime.datetime | None
    revoked_at: datetime.datetime | None

    @classmethod
    def of(cls, row: ApiToken) -> TokenOut:
        return cls.model_validate(row, from_attributes=True)


class TokenCreated(TokenOut):
    token: str = Field(description="the bearer token; shown only here, stored hashed")
