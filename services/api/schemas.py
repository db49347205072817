"""Request and response bodies of the API (separate from the database models)."""

from __future__ import annotations

import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exporter.errors import ExportError
from exporter.request import ExportRequest
from services.sources import check_model_id


class ExportCreate(BaseModel):
    """An export request. The variant follows from the rest unless given."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"model": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "fp16", "ep": "cuda"},
            {"model": "microsoft/Phi-3.5-mini-instruct@main", "dtype": "fp16", "ep": "cuda",
             "static_cache": True, "max_seq_len": 4096},
        ]},
    )

    model: str = Field(..., max_length=300, description="hub id 'org/name[@revision]' or a model directory name")
    dtype: Literal["fp32", "fp16", "bf16"] = "fp16"
    ep: Literal["cpu", "cuda"] = "cuda"
    static_cache: bool = False
    max_seq_len: int | None = Field(None, gt=0, le=1 << 20, description="context length; required with static_cache")
    variant: Literal["attn_static", "gqa", "attn_dynamic"] | None = None
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
                             max_seq_len=self.max_seq_len, variant=self.variant)


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
    variant: str
    dtype: str
    ep: str
    static_cache: bool
    max_seq_len: int | None
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

    model_config = ConfigDict(extra="forbid")

    policy: Literal["all", "listed", "dry-run"] | None = Field(None, description="default: REEXPORT_POLICY")
    models: list[str] | None = Field(None, description="with policy 'listed' (default: REEXPORT_MODELS)")
    limit: int | None = Field(None, ge=0, le=1000, description="lower the in-flight cap for this run (REEXPORT_MAX_IN_FLIGHT)")
