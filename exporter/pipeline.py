"""The export pipeline: resolve -> build (build, fold, package) -> validate, as stage functions.

``build_export`` and ``validate_built`` are the stages the CLI and the farm's workers share; each
takes and returns plain objects and keeps the manifest in memory, so it is written exactly once,
by whoever finishes the export. ``export_model`` (the CLI's path) runs them into a hidden sibling
directory and renames it into place after writing the manifest, so a failed export leaves no DIR
that looks complete, whatever stage failed.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
import uuid
from pathlib import Path

from exporter import contract
from exporter.graph.build import IR_DTYPES, build_model
from exporter.graph.language_model import check_image_text_request, image_text_type, language_model
from exporter.packaging.image_text import write_image_text_graphs
from exporter.errors import ExportError, ValidationFailed
from exporter.graph.fold import fold_model
from exporter.graph.traced import builder_entry, check_traced_quantization, resolve_builder, trace_model
from exporter.graph.passes.quantize import IMPORTED_DESCRIPTION, METHOD_DESCRIPTIONS
from exporter.packaging import hf_layout
from exporter.packaging.genai import write_genai_package
from exporter.packaging.genai_image_text import write_genai_image_text_package
from exporter.packaging.package import MANIFEST_FILE, Manifest, build_manifest, write_model
from exporter.request import ExportRequest
from exporter.packaging.resolve import ResolvedSource, resolve_source
from exporter.validation.validate import REPORT_JSON, ValidationReport, check_validatable, validate_export


class Progress:
    """Callbacks for long work; the CLI draws bars, a worker writes stage + percent to the catalog."""

    def stage(self, name: str) -> None: ...

    def layer(self, index: int, total: int) -> None: ...

    def bytes_written(self, count: int, total: int) -> None: ...


@dataclasses.dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    source: ResolvedSource
    report: ValidationReport | None = None  # when validation ran


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} is a file: choose a directory path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"--out {out_dir} exists and is not empty: pass --overwrite or choose another directory")


def _publish_dir(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        out_dir.rename(trash)
        staging.rename(out_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out_dir)


def build_export(
    request: ExportRequest, source: ResolvedSource, out_dir: Path, progress: Progress | None = None,
    export_id: str | None = None, timings: dict[str, float] | None = None, rope_cache: Path | None = None,
    reference_cache: Path | None = None, shared_references=None,
) -> Manifest:
    """Stages build, fold and package: write the model, its weights and the genai package into ``out_dir``.

    A quantized cuda export without chosen activations first measures the checkpoint's activations
    (``activation_range.choose_activations``: one pass of the streamed reference over the quality
    gate's text, whose logits are kept in ``reference_cache`` / ``shared_references`` for validation;
    an image-text checkpoint's image-text model: where its activations do not fit fp16, its export computes in bf16).

    Returns the manifest in memory (files, versions, op census, where every weight came from);
    nothing is written to ``out_dir / manifest.json``, so a directory without one is never mistaken
    for a finished export.
    """
    progress = progress or Progress()
    timings = timings if timings is not None else {}
    out_dir = Path(out_dir)

    t0 = time.perf_counter()
    progress.stage("build")
    # exportfarm's own graph where it has the architecture (or the request says so), else transformers' trace
    # an image-text checkpoint: three graphs (graph/language_model.py)
    image_text = image_text_type(source.path)
    if image_text:
        check_image_text_request(request, source.path)
    builder = contract.BUILDER_HAND if image_text else resolve_builder(request, source.path)
    traced = builder == contract.BUILDER_TRACED
    activations, chosen = _activations(request, source, traced, image_text, reference_cache, shared_references)
    if chosen["by"] == "measurement":
        timings["activation_range"] = time.perf_counter() - t0
    if traced:
        built = trace_model(request, source, activations)
    else:
        built = build_model(request, source, on_layer=progress.layer, rope_cache=rope_cache, activations=activations)
    timings["build"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    progress.stage("fold")
    folded = fold_model(built.model, request, built.config.num_layers)
    kept_float = check_traced_quantization(built.model, folded.quantization, request.dtype.value) \
        if traced and request.dtype.quantized else {}
    timings["fold"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    progress.stage("package")
    total = sum(v.const_value.nbytes for v in built.model.graph.initializers.values())
    written = 0

    def on_bytes(n: int) -> None:
        nonlocal written
        written += n
        progress.bytes_written(written, total)

    hashed = write_model(built.model, out_dir, on_bytes)  # model.onnx.data, hashed as it was written
    components = None
    if image_text:  # vision.onnx and embedding.onnx beside it, in the decoder's activation dtype
        written, components = write_image_text_graphs(out_dir, source.path, built.model, IR_DTYPES[built.activations],
                                                      on_bytes)
        hashed.update(written)
    progress.bytes_written(total, total)  # tiny tensors are stored inline, without a callback
    timings["write"] = time.perf_counter() - t0
    if image_text:  # genai_config.json with vision / embedding / decoder sections where genai has the type
        genai = write_genai_image_text_package(out_dir, source.path, built.config, built.variant, request, components,
                                               [v.name for v in built.model.graph.inputs],
                                               [v.name for v in built.model.graph.outputs])
    else:
        # genai_config.json + tokenizer files, so the folder also runs in onnxruntime-genai unchanged.
        genai = write_genai_package(
            out_dir, source.path, built.config, built.variant, request,
            [v.name for v in built.model.graph.inputs], [v.name for v in built.model.graph.outputs], traced=traced,
        )
    manifest = build_manifest(built.model, out_dir, request, built.variant, source, timings,
                              sorted(hashed.keys() - set(contract.MODEL_FILES)) + genai.files if image_text
                              else genai.files,
                              export_id, hashed, builder_entry(builder))
    if image_text:
        manifest.data["task"] = contract.IMAGE_TEXT_TASK
        manifest.data["image_text"] = components
    manifest.data["genai"] = genai.manifest_entry()
    if folded.quantization is not None:
        manifest.data["quantization"] = {
            "method": request.quant.method,
            "algorithm": METHOD_DESCRIPTIONS[request.quant.method]
                         + ("; experts through QMoE, round to nearest (int8: one scale per row)"
                            if any(node.op_type == "QMoE" for node in built.model.graph) else ""),
            "dtype": request.dtype.value, "activations": built.activations.value, "activations_chosen": chosen,
            **request.quant.to_dict(),
            "weights": folded.quantization,
            # a traced graph's weights multiplied by ops the quantize pass does not rewrite, left in float
            **({"not_quantized": {"weights": kept_float, "why": "transformers.exporters multiplies by them through "
                                  "Gemm / FusedMatMul, which MatMulNBits does not replace"}} if kept_float else {}),
        }
        if built.checkpoint.prequantized is not None:  # its linears keep their codes; the method applies to the rest
            manifest.data["quantization"]["imported"] = {
                **built.checkpoint.prequantized.to_dict(),
                "linears": sum(1 for d in folded.quantization.values() if d.get("imported")),
                "how": IMPORTED_DESCRIPTION.format(label=built.checkpoint.prequantized.label)}
    manifest.data["status"] = "unvalidated"
    if request.layout == hf_layout.LAYOUT:
        hf_layout.hf_file_names(manifest.data)  # the graph's activation dtype has a file name: before validating
        hf_layout.check_cache(manifest.data, source.path)  # and its caches are ones transformers.js allocates
    # The graph's reference cycles (nodes, values, graphs) keep its in-memory constants (the rope
    # tables: 1 GiB for 2^20 positions of a 256-wide head) alive until the collector happens to run,
    # which left them beside validation's own memory: freed here, before the next stage.
    del built, folded
    gc.collect()
    return manifest


def _activations(request: ExportRequest, source: ResolvedSource, traced: bool, image_text: str | None,
                 reference_cache, shared) -> tuple:
    """(what the export computes in, why): measured for a quantized cuda export without a choice
    (``image_text``: the checkpoint's image-text type where its image-text export is asked for, measured on
    its image-text model's language model)."""
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.graph.traced import traced_sizes
    from exporter.validation.activation_range import choose_activations

    if image_text:
        cfg = language_model(source.path).config
        num_layers, vocab_size = cfg.num_layers, cfg.vocab_size
    elif traced:
        num_layers, vocab_size = traced_sizes(source.path)
    else:
        cfg = load_model_config(source.path, ARCHITECTURES)
        num_layers, vocab_size = cfg.num_layers, cfg.vocab_size
    return choose_activations(request, source, num_layers, vocab_size, reference_cache, shared, image_text)


def validate_built(
    out_dir: Path, manifest: Manifest, reference: str, ep: str, progress: Progress | None = None,
    quality_thresholds: dict | None = None, reference_cache: Path | None = None, shared_references=None,
) -> ValidationReport:
    """Stage validate: run every gate on the export in ``out_dir`` and record the outcome in ``manifest``.

    Writes parity_report.json / .md next to the model and sets the manifest's status to ``ready``
    or ``quarantined`` (a failed gate); the caller decides what a quarantined export means.
    """
    progress = progress or Progress()
    t0 = time.perf_counter()
    progress.stage("validate")
    report = validate_export(out_dir, reference, ep, manifest=manifest.data, quality_thresholds=quality_thresholds,
                             reference_cache=reference_cache, shared_references=shared_references)
    manifest.add_files(out_dir, [p.name for p in report.write(out_dir)])
    manifest.data["timings_s"]["validate"] = round(time.perf_counter() - t0, 3)
    manifest.data["validation"] = {
        "status": "passed" if report.passed else "failed",
        "failed_gates": sorted({g.gate for g in report.failed}),
        "summary": report.summary(),
        "report": REPORT_JSON,
    }
    if report.genai is not None and isinstance(manifest.data.get("genai"), dict):
        manifest.data["genai"]["validated"] = report.genai  # what the genai gate checked
    manifest.data["status"] = "ready" if report.passed else "quarantined"
    return report


def export_model(
    request: ExportRequest,
    out_dir: Path,
    progress: Progress | None = None,
    overwrite: bool = False,
    validate: bool = True,
    validate_ep: str | None = None,
    reference: str | None = None,
    export_id: str | None = None,
    reference_cache: Path | None = None,
    rope_cache: Path | None = None,
) -> ExportResult:
    """Export ``request`` into ``out_dir``; with ``validate`` the gates decide its status.

    A failed gate still publishes the directory (report included) with manifest status
    "quarantined", then raises ``ValidationFailed``. With the request's layout "hf" the validated export
    laid out as a Hugging Face model repository (exporter/packaging/hf_layout.py) is what lands in ``out_dir``.
    """
    progress = progress or Progress()
    export_id = export_id or uuid.uuid4().hex
    request.resolved_variant()  # refuse impossible requests (and layouts) before touching anything
    if validate:
        check_validatable(request.max_seq_len)
    out_dir = Path(out_dir).absolute()
    _check_out_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        t0 = time.perf_counter()
        progress.stage("resolve")
        source = resolve_source(request.model)
        timings = {"resolve": time.perf_counter() - t0}
        # what an image-text export cannot be yet: refused before any build
        if image_text_type(source.path):
            check_image_text_request(request, source.path)
            if validate:
                from exporter.validation.image_text import check_image_text_validatable
                from exporter.validation.validate import PARITY_STEPS
                from exporter.vision import load_vision_config

                check_image_text_validatable(request.max_seq_len, load_vision_config(source.path),
                                             PARITY_STEPS)
        # a family transformers.js cannot drive: refused before any build (a traced graph whose cache turns out to be
        # of two head sizes, for a model type transformers.js has no class for, only once built: check_cache)
        if request.layout == hf_layout.LAYOUT:
            hf_layout.check_family(source.path, resolve_builder(request, source.path))
        manifest = build_export(request, source, staging, progress, export_id, timings, rope_cache, reference_cache)
        report = None
        if validate:
            report = validate_built(staging, manifest, reference or str(source.path), validate_ep or request.ep.value,
                                    progress, reference_cache=reference_cache)
        manifest.write(staging)
        if request.layout == hf_layout.LAYOUT:
            # write_hf_layout leaves nothing behind when it fails; the farm staging is dropped either way.
            laid_out = staging.with_name(f"{staging.name}-hf")
            manifest = Manifest(hf_layout.write_hf_layout(staging, laid_out, source.path, weights="move"))
            farm, staging = staging, laid_out
            shutil.rmtree(farm, ignore_errors=True)
        _publish_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report is not None and not report.passed:
        raise ValidationFailed(f"validation {report.summary()}; report in {out_dir / REPORT_JSON}", report, out_dir)
    return ExportResult(out_dir, manifest, source, report)


def load_manifest(out_dir: Path) -> dict:
    import json

    path = Path(out_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ExportError(f"{out_dir} has no {MANIFEST_FILE}: it is not a finished export")
    return json.loads(path.read_text())
