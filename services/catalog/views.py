"""Catalog views: per model, the latest ready export of each variant with its key figures."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from exporter.request import build_tag
from services.catalog.models import Export, ExportStatus


def _summary(export: Export) -> dict:
    return {
        "id": export.id, "variant": export.variant, "dtype": export.dtype, "quant": export.quant, "ep": export.ep,
        "layout": export.layout, "compat": export.compat,
        "max_seq_len": export.max_seq_len, "revision": export.revision, "ort_version": export.ort_version,
        "finished_at": export.finished_at, "storage_prefix": export.storage_prefix, "figures": export.figures or {},
    }


def quant_tag(quant: dict | None) -> str:
    """int4 / int8 builds differ by their quant options: '' for the defaults, else e.g. '-b64a-lm8'."""
    if not quant:
        return ""
    from exporter.request import QuantSpec

    spec = QuantSpec.from_dict(quant)
    if spec == QuantSpec():
        return ""
    tag = f"-b{spec.block_size}{'s' if spec.symmetric else 'a'}"
    tag += f"-lm{spec.lm_head_bits}" if spec.lm_head_bits else ""
    tag += f"-acc{spec.accuracy_level}" if spec.accuracy_level is not None else ""
    tag += f"-{spec.activations}" if spec.activations else ""
    tag += f"-{spec.method}" if spec.method != "rtn" else ""
    tag += "-int8l" + ".".join(map(str, spec.int8_layers)) if spec.int8_layers else ""
    return tag + ("-keep-" + "-".join(spec.keep) if spec.keep else "")


def latest_ready(session: Session, model: str | None = None) -> dict[str, dict[str, dict]]:
    """{model: {"<variant>-<dtype>-<ep>[-ms<n>][-hf][-compat]": summary of its newest ready export}}."""
    query = select(Export).where(Export.status == ExportStatus.READY)
    if model is not None:
        query = query.where(Export.model == model)
    views: dict[str, dict[str, dict]] = {}
    for export in session.scalars(query.order_by(Export.finished_at.asc())):
        slot = f"{export.variant}-{export.dtype}{quant_tag(export.quant)}-{export.ep}" + (
            f"-ms{export.max_seq_len}" if export.max_seq_len else "") + build_tag(export.layout, export.compat)
        views.setdefault(export.model, {})[slot] = _summary(export)  # later rows replace older ones
    return views
