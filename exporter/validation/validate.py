"""Stage: validate an export. A gate, not a warning: any failed check fails the export.

Gates (DESIGN.md, "Validation"): structure (read from model.onnx), weight integrity by value
(read from model.onnx.data), numeric parity against transformers on the same weights through the
variant's own cache contract, and a known-answer runtime probe of the target execution provider.
Writes parity_report.json and parity_report.md next to the model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import datetime
import json
import math
import time
from pathlib import Path

import numpy as np

from exporter import checkpoints
from exporter.packaging.checkpoint import Checkpoint
from exporter.errors import ExportError
from exporter.graph.components.moe import ROUTING_CUDA_SPARSE_MIXER
from exporter.validation.gates import GateResult
from exporter.validation.gates.genai import genai_gates, genai_importable
from exporter.validation.reference import top2_gap
from exporter.validation.gates.rehearsal import captures, rehearsal_gate
from exporter.validation.gates.parity import (
    NEAR_TIE_MARGIN, PREFILL_TOLERANCE, batch_gate, near_tie_margin, parity_gates, peer_gate,
)
from exporter.validation.gates.runtime_probe import expert_gate, runtime_gate
from exporter.validation.gates.structure import structure_gates
from exporter.validation.gates.weights import weight_integrity
from exporter.graph.config import LANGUAGE_MODEL_OF
from exporter.packaging.image_text import component_sources
from exporter.packaging.resolve import resolve_source
from exporter.contract import (
    BUILDER_TRACED, GENAI_CONFIG_FILE, MANIFEST_FILE, META_BUILDER, META_PREFIX, MODEL_FILE, REPORT_JSON, REPORT_MD,
)
from exporter.graph.target import is_compat

PARITY_PROMPT_LEN, PARITY_STEPS = 16, 24  # the parity run: a prompt, then greedy decode steps


@dataclasses.dataclass
class ValidationReport:
    export_dir: Path
    variant: str
    dtype: str
    ep: str
    reference: str
    gates: list[GateResult]
    # Seconds per stage. Some overlap and some include others: weights runs beside everything;
    # parity_session (making the export's session) runs beside the prompts' tokenizer, the
    # reference cache and the probe, and parity includes what it waited for it; reference is what
    # the validating thread spent on the reference (the cache, the forward pass, and the load where
    # it waited for it), reference_load the load itself, which for an export on a device ran beside
    # the probe and the export's session. They do not add up to the wall time.
    timings_s: dict[str, float]
    parity: dict | None = None
    quality: dict | None = None  # quantized exports: the quality gate's figures
    genai: dict | None = None  # what the genai gate checked (None: the export is not a genai package)
    # an image-text export: a section per component (vision, embedding, end_to_end; validation/image_text.py)
    components: dict | None = None

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[GateResult]:
        return [g for g in self.gates if g.status == "fail"]

    def summary(self) -> str:
        counts = {s: sum(g.status == s for g in self.gates) for s in ("pass", "fail", "info")}
        info = f", {counts['info']} informational" if counts["info"] else ""
        if self.passed:
            return f"all {counts['pass']} checks passed{info}"
        return "failed: " + "; ".join(f"{g.gate}: {g.check}" + (f" ({g.message})" if g.message else "") for g in self.failed)

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "status": "passed" if self.passed else "failed",
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "variant": self.variant, "dtype": self.dtype, "ep": self.ep, "reference": self.reference,
            "failed_gates": sorted({g.gate for g in self.failed}),
            "gates": [g.to_dict() for g in self.gates],
            "parity": self.parity,
            **({"quality": self.quality} if self.quality else {}),
            **({"genai": self.genai} if self.genai else {}),
            **({"components": self.components} if self.components else {}),
            "timings_s": {k: round(v, 3) for k, v in self.timings_s.items()},
        }

    def to_json(self) -> dict:
        """to_dict() as strict JSON values (a non-finite figure becomes the string "nan" / "inf"):
        what parity_report.json and the catalog hold."""
        return _finite(json.loads(json.dumps(self.to_dict(), default=_json_default)))

    def write(self, out_dir: Path | None = None) -> list[Path]:
        """parity_report.json (strict JSON: a non-finite figure is written as the string "nan" or
        "inf") and parity_report.md."""
        out_dir = Path(out_dir or self.export_dir)
        data = self.to_json()
        (out_dir / REPORT_JSON).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
        (out_dir / REPORT_MD).write_text(render_markdown(self.to_dict()))
        return [out_dir / REPORT_JSON, out_dir / REPORT_MD]


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(type(value))


def cell(value) -> str:
    """A measured or threshold value as a report table shows it (the markdown and the pages)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def render_markdown(data: dict) -> str:
    lines = [
        f"# Validation: {data['status'].upper()}",
        "",
        f"{data['variant']} / {data['dtype']} on {data['ep']}, reference `{data['reference']}`",
        "",
        "| gate | check | measured | threshold | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for g in data["gates"]:
        result = {"pass": "pass", "info": "info" + (f": {g['message']}" if g["message"] else "")}.get(
            g["status"], f"**FAIL** {g['message']}")
        lines.append(f"| {g['gate']} | {g['check']} | {cell(g['measured'])} | {cell(g['threshold'])} | {result} |")
    quality = data.get("quality")
    if quality:
        lines += ["", f"Quality against the unquantized reference ({quality['positions']} positions, "
                  f"{quality['tokenizer']} tokens): agreement {quality['agreement']:.4f} at decisive positions "
                  f"({quality['agreement_all']:.4f} at all), mean KL {quality['kl_mean']:.4g} nats, perplexity "
                  f"{quality['ppl_export']:.4g} vs {quality['ppl_reference']:.4g} ({quality['ppl_delta']:+.2%})."]
    parity = data.get("parity")
    if parity:
        lines += ["", f"Near ties (reference top-1/top-2 gap below the margin): {len(parity['near_ties'])} "
                  f"at steps {parity['near_ties']}; tokens that differed there: {parity['tie_mismatches']}."]
        from exporter.validation.routing import render_ties

        lines += render_ties([(p.get("prompt", "random tokens"), p) for p in [parity, *parity.get("prompts", [])]])
    if data.get("components"):
        from exporter.validation.image_text import render_sections

        lines += render_sections(data["components"])
    details = next((g["details"] for g in data["gates"] if g["gate"] == "weights" and g.get("details")), {})
    worst = details.get("worst", [])
    if "bit_exact" in details:
        lines += ["", f"Weight slices: {details['bit_exact']} bit-exact (the stored bytes are their source converted, "
                  f"or quantized, independently of the exporter), {details['compared_by_statistics']} compared by statistics."]
    if worst:
        lines += ["", "Worst weight slices:", "", "| initializer | slice | source | correlation | rel L2 | max abs |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for s in worst:
            corr = "n/a" if s["correlation"] is None else f"{s['correlation']:.6f}"
            lines.append(f"| {s['initializer']} | {s['region']} | {s['source']} | {corr} | {s['rel_l2']:.3g} | {'non-finite' if s['max_abs'] is None else format(s['max_abs'], '.3g')} |")
    return "\n".join(lines) + "\n"


def check_validatable(max_seq_len: int | None) -> None:
    """Refuse an export too short to validate: the parity run needs prompt + steps positions."""
    needed = PARITY_PROMPT_LEN + PARITY_STEPS
    if max_seq_len is not None and max_seq_len < needed:
        raise ExportError(
            f"max_seq_len {max_seq_len} is shorter than validation needs ({PARITY_PROMPT_LEN}-token prompt + "
            f"{PARITY_STEPS} decode steps = {needed}): use max_seq_len {needed} or more (CLI: or --no-validate)")


def _packed_gqa(model_path: Path) -> bool:
    """Whether the export's GroupQueryAttention takes one packed QKV input (no separate key)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    gqa = next((n for n in graph.node if n.op_type == "GroupQueryAttention"), None)
    return gqa is not None and (len(gqa.input) < 2 or not gqa.input[1])



def towers_beside_language_model(checkpoint: Checkpoint) -> frozenset[str]:
    """An image-text checkpoint's tensors outside its language model (vision and audio towers, their projections):
    where the export is the language model alone, not the export's to hold."""
    from exporter.validation.streamed import LANGUAGE_MODEL_PREFIX

    return frozenset(n for n in checkpoint.names() if not n.startswith((LANGUAGE_MODEL_PREFIX, "lm_head.")))


def validate_export(
    export_dir: Path,
    reference: str | None = None,
    ep: str | None = None,
    peer: Path | None = None,
    steps: int = PARITY_STEPS,
    prompt_len: int = PARITY_PROMPT_LEN,
    lm_factory=None,
    manifest: dict | None = None,
    quality_thresholds: dict | None = None,
    reference_cache: Path | None = None,
    shared_references=None,
    advise: bool = True,
) -> ValidationReport:
    """Run every gate on ``export_dir``; ``reference`` defaults to the checkpoint it was built from.

    An int4 export that fails its quality verdict gets advice (``advise``): the int4 recipe that would
    pass on this model, measured (quant_advice.py); it costs a few reference passes, only on failure.

    Reference runs are kept in ``reference_cache`` and, given ``shared_references`` (a
    ``reference.SharedReferences``, e.g. the farm's object store), shared beyond this machine; so
    are the checkpoint tokenizer's answers (``text.KeptAnswers``), locally.

    ``manifest`` is the export's manifest when the caller holds it in memory (the pipeline writes
    it once, after validation); otherwise it is read from ``export_dir``. ``lm_factory(export_dir,
    ep)`` builds the runtime driver (tests pass a deliberately wrong one).
    """
    from exporter.runtime.session import read_metadata, session_config_entries

    export_dir = Path(export_dir)
    manifest_path = export_dir / MANIFEST_FILE
    model_path = export_dir / MODEL_FILE
    if not model_path.is_file():
        raise ExportError(f"{export_dir} has no {MODEL_FILE}: pass an export directory")
    meta = read_metadata(model_path)
    if manifest is None:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    variant, dtype, cfg = meta["variant"], meta["dtype"], meta["config"]
    activations = cfg.get("activations", dtype)  # quantized exports compute in fp16 / fp32
    ep = ep or meta["ep"]
    if (cfg.get("moe") or {}).get("routing") == ROUTING_CUDA_SPARSE_MIXER and ep != "cuda":
        raise ExportError(f"{export_dir} routes its experts with onnxruntime's CUDA sparse mixer, which the {ep} "
                          "kernels ignore (they would route by plain softmax top-2): validate it with --ep cuda, "
                          f"or export the model with --ep {ep}")
    reference = reference or manifest_reference(manifest, export_dir)
    ref_source = resolve_source(reference)
    timings: dict[str, float] = {}
    gates: list[GateResult] = []

    t0 = time.perf_counter()
    compat = is_compat(meta)
    # traced by transformers.exporters (exporter/graph/traced.py): attends as transformers' code does
    traced = meta.get(META_BUILDER.removeprefix(META_PREFIX)) == BUILDER_TRACED
    recurrent = cfg.get("recurrent") or {}
    gates += structure_gates(model_path, variant, activations, cfg["num_layers"], compat,
                             tuple(recurrent.get("layers", ())), tuple(recurrent.get("ops", ())),
                             recurrent.get("attention_layers"), traced, tuple(cfg.get("kv_shared_layers", ())))
    timings["structure"] = time.perf_counter() - t0
    checkpoints.checkpoint()

    # The value check of every weight (numpy over two gigabytes) runs on its own thread while the
    # runtime probe, the reference and the export's session run here: numpy, torch and onnxruntime
    # all release the GIL, so the check overlaps them instead of adding its wall time to theirs
    # (and where parity computes the reference for an export on a device, transformers' model
    # loads on a third: reference_beside_session; the quantized quality gate loads it after).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights") as pool:
        # an image-text export: the tensors its vision and embedding graphs read are not missing from model.onnx
        elsewhere = component_sources(manifest["image_text"]) if manifest.get("image_text") else frozenset()
        if cfg.get("architecture") in LANGUAGE_MODEL_OF:  # a language model exported alone (qwen3_5, gemma4): not its towers
            elsewhere |= towers_beside_language_model(Checkpoint(ref_source.path))
        weights = pool.submit(_timed, weight_integrity, model_path, manifest, Checkpoint(ref_source.path), dtype,
                              activations, traced, elsewhere)
        if cfg.get("image_text"):  # vision -> embedding -> decoder against transformers' image-text model
            from exporter.validation.image_text import (
                component_weight_gates, image_text_gates, load_image_text_reference,
            )

            t0 = time.perf_counter()
            model = load_image_text_reference(Path(ref_source.path))  # one load: the components and the quality gate
            timings["reference_load"] = time.perf_counter() - t0
            if dtype not in QUANTIZED:  # handed over: freed once its runs are done (before a yardstick loads)
                model = [model]
            runtime, components = image_text_gates(export_dir, Path(ref_source.path), ep, dtype, activations, steps,
                                                   model=model, manifest=manifest)
            timings["image_text"] = time.perf_counter() - t0
            quality = None
            if dtype in QUANTIZED:  # the end-to-end figures only inform: the decoder is judged on text, as a text export
                quality = _image_text_quality(export_dir, ep, dtype, activations, ref_source, cfg, model, runtime,
                                              timings, quality_thresholds, reference_cache, shared_references)
                if quality is not None and advise:
                    _advise_quantization(runtime, quality, manifest, dtype, activations, ref_source, cfg,
                                         quality_thresholds, reference_cache, shared_references, image_text=True)
            del model
            (weight_results, _), timings["weights"] = weights.result()
            weight_results += component_weight_gates(export_dir, manifest, Checkpoint(ref_source.path), activations)
            return ValidationReport(export_dir, variant, dtype, ep, str(reference), gates + weight_results + runtime,
                                    timings, quality=quality, components=components)
        runtime: list[GateResult] = []
        # the export's own greedy tokens on a prompt, for the genai gate (None: it will not run)
        own: dict | None = {} if will_check_genai(manifest) else None
        parity, quality = _runtime_gates(export_dir, model_path, variant, dtype, activations, ep, cfg, ref_source,
                                         lm_factory, peer, steps, prompt_len, quality_thresholds, reference_cache,
                                         shared_references, runtime, timings, own, compat, traced)
        checkpoints.checkpoint()
        # the advice simulates int4 recipes on the streamed reference's weights by exportfarm's names: not a traced graph's
        if quality is not None and advise and not traced:
            t0 = time.perf_counter()
            if _advise_quantization(runtime, quality, manifest, dtype, activations, ref_source, cfg,
                                    quality_thresholds, reference_cache, shared_references):
                timings["quality_advice"] = time.perf_counter() - t0
        if captures(variant, ep):  # the benchmark and serving runtimes capture CUDA graphs: rehearse that
            t0 = time.perf_counter()
            runtime.append(rehearsal_gate(manifest, cfg, activations, ep))
            timings["rehearsal"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        own = own or {}
        genai_results, genai = genai_gates(export_dir, manifest, Path(ref_source.path), ep, own.get("prompt"),
                                           own.get("tokens"), _eos_ids(export_dir), own.get("gaps"),
                                           NEAR_TIE_MARGIN[activations],
                                           session_config_entries(**validation_session_options(dtype)),
                                           reference_cache)
        if genai is not None:
            timings["genai"] = time.perf_counter() - t0
        (weight_results, _), timings["weights"] = weights.result()
    gates += weight_results + runtime + genai_results
    return ValidationReport(export_dir, variant, dtype, ep, str(reference), gates, timings, parity, quality, genai)


# Why an image-text export's failed int4 verdict comes without advice.
IMAGE_TEXT_NO_ADVICE = ("no other int4 recipe measured: the advice simulates recipes on the streamed reference of a "
                        "text export, which an image-text checkpoint's model (vision tower, embedding, language model "
                        "under its own prefix) is not for most families; try the recipes by hand (--quant-asymmetric, "
                        "--quant-lm-head-bits 8, --dtype int8) or export for ep cpu with --quant-accuracy-level 0")


def _advise_quantization(gates, quality, manifest, dtype, activations, ref_source, cfg, thresholds,
                         reference_cache, shared, image_text: bool = False) -> bool:
    """An int4 export that fails its quality verdict on real text: measure which int4 recipe would pass
    on this model (validation/quant_advice.py) and say so in each failed check and the report.
    Nothing for an export that passed, one scored on byte tokens (no tokenizer) or whose reference
    failed its own check (no verdict), or one whose codes came from a GPTQ / AWQ checkpoint. An
    image-text export (``image_text``) is not advised: each failed check and the report say so and why."""
    verdicts = ("next-token agreement", "mean KL", "perplexity increase")
    failed = [g for g in gates if g.gate == "quality" and g.status == "fail" and g.check.startswith(verdicts)]
    unmeasured = any(g.gate == "quality" and "measurement check" in g.check and g.status == "fail" for g in gates)
    if (dtype != "int4" or not failed or unmeasured or quality.get("tokenizer") != "checkpoint" or not manifest.get("request")
            or (manifest.get("quantization") or {}).get("imported")):
        return False
    if image_text:
        for gate in failed:
            gate.message = f"{gate.message}; {IMAGE_TEXT_NO_ADVICE}" if gate.message else IMAGE_TEXT_NO_ADVICE
        quality["advice"] = {"skipped": IMAGE_TEXT_NO_ADVICE}
        return False
    from exporter.request import DType, ExportRequest
    from exporter.validation import quant_advice, reference
    from exporter.validation.gates.quality import DEFAULT_THRESHOLDS
    from exporter.validation.activation_range import quality_windows

    chunks = quality_windows(Path(ref_source.path), cfg["vocab_size"], cfg.get("max_seq_len"))
    _, ref = reference.cached_window_logits(reference_cache, ref_source.revision, chunks, shared)
    request = ExportRequest(**{**manifest["request"], "model": str(ref_source.path)})
    if ref is None:  # no cache: the quality gate's pass is gone; measure it again
        from exporter.validation.activation_range import measure

        _, ref = measure(Path(ref_source.path), request.ep.value, chunks, cfg["num_layers"])
    limits = {**DEFAULT_THRESHOLDS["int4"], **((thresholds or {}).get("int4", {}))}
    try:
        advice = quant_advice.advise(request, ref_source, DType(activations), chunks, ref, quality["tokenizer"], limits)
    except Exception as err:  # advice, not a gate: the failure stands without it
        if checkpoints.is_stop(err):
            raise
        import logging

        logging.getLogger(__name__).warning("could not measure other int4 recipes: %s", err)
        return False
    sentence = quant_advice.describe(advice)
    for gate in failed:
        gate.message = f"{gate.message}; {sentence}" if gate.message else sentence
    quality["advice"] = advice
    return True


def _eos_ids(export_dir: Path) -> list[int]:
    """The end-of-sequence ids genai stops at (its genai_config.json), none where there is no config."""
    try:
        eos = json.loads((Path(export_dir) / GENAI_CONFIG_FILE).read_text())["model"].get("eos_token_id")
    except (OSError, ValueError, KeyError):
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [] if eos is None else [int(eos)]


def manifest_reference(manifest: dict, export_dir: Path) -> str:
    """The checkpoint an export was built from, as its manifest names it (a local path or
    repo@revision), for resolve_source."""
    source = manifest.get("source", {})
    reference = source.get("path") if source.get("kind") == "local" else (
        f"{source.get('repo_id')}@{source.get('revision')}" if source.get("repo_id") else None)
    if reference is None:
        raise ExportError(f"{export_dir} has no manifest naming its checkpoint: pass --reference SRC")
    return reference


def _timed(function, *args):
    t0 = time.perf_counter()
    return function(*args), time.perf_counter() - t0


def _runtime_gates(export_dir, model_path, variant, dtype, activations, ep, cfg, ref_source, lm_factory, peer,
                   steps, prompt_len, quality_thresholds, reference_cache, shared_references, gates, timings, own,
                   compat, traced=False):
    """The gates that run the export: the runtime probe, then parity against the reference (or, for
    quantized exports, the quality gate); appends to ``gates``, returns (parity, quality). ``own``
    (unless None) gets the export's own greedy tokens on the real-text prompt (else the first), for
    the genai gate; ``compat``: the probe builds the compat target's attention; ``traced``: a graph
    traced by transformers.exporters, which the probe does not describe and the batch check does."""
    from exporter.validation import reference

    def probe():
        t0 = time.perf_counter()
        if traced:
            gates.append(GateResult(
                "runtime", f"{variant} attention known answer on {ep} ({activations})", True, "not run",
                "exportfarm's attention pattern", "the probe runs the attention ops exportfarm's own graphs use; a "
                "graph traced by transformers.exporters attends through its own lowering, which parity and the "
                "left-padded batch check run on this EP instead", informational=True))
        else:
            gates.append(runtime_gate(variant, ep, activations, packed_qkv=_packed_gqa(model_path),
                                      compat=compat))
        if cfg.get("moe"):
            gates.append(expert_gate(ep, activations, dtype, cfg["moe"]))
        timings["runtime_probe"] = time.perf_counter() - t0

    factory = lm_factory or (lambda d, e: validation_session(d, e, dtype))
    if dtype in QUANTIZED:
        probe()
        return None, _quality(export_dir, ep, dtype, activations, ref_source, cfg, factory, gates, timings,
                              quality_thresholds, reference_cache, shared_references, own,
                              parity_prompts(Path(ref_source.path), cfg, prompt_len, steps, [], reference_cache)[-1][1]
                              if own is not None else None, steps, traced)

    # The export's session is made on a thread from the start: onnxruntime releases the GIL while it
    # makes one, and what comes before parity needs it (the prompts, whose tokenizer imports
    # transformers and torch where its answers are not kept yet; the reference cache; the probe) is
    # mostly Python that holds it. 0.5B fp16 on the CPU: 2.2 s of CPU for the session, 3.5 s for
    # that import and the tokenizer, one after the other before.
    sessions = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="session")
    making = sessions.submit(_timed, factory, export_dir, ep)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
    try:
        prompts = parity_prompts(Path(ref_source.path), cfg, prompt_len, steps, gates, reference_cache)
        t0 = time.perf_counter()
        cached = [reference.cached_reference(reference_cache, ref_source.revision, prompt, steps, shared_references)
                  for _, prompt in prompts]
        timings["reference"] = time.perf_counter() - t0
        timings["reference_cached"] = float(all(ref is not None for _, ref in cached))
        missing = any(ref is None for _, ref in cached)
        loading = pool.submit(_loaded, ref_source.path, ep) if missing and reference_beside_session(ep) else None
        probe()
        return _parity(making, export_dir, ep, dtype, ref_source, prompts, steps, peer, cached, loading,
                       reference_cache, shared_references, gates, timings, own, factory, traced,
                       experts=bool(cfg.get("moe")) or _names_experts(Path(ref_source.path))), None
    finally:
        # Not waited for: a run that ended before it needed the model (no session, an error) does
        # not sit out the load, whose model nobody then holds once it is done.
        pool.shutdown(wait=False, cancel_futures=True)
        sessions.shutdown(wait=True)  # a session still being made is not left making beside the next job


def parity_prompts(checkpoint: Path, cfg: dict, prompt_len: int, steps: int, gates: list,
                   answers: Path | None = None) -> list[tuple[str, list[int]]]:
    """The parity runs' prompts: ``prompt_len`` random token ids (every part of the vocabulary), and
    where the checkpoint has a tokenizer, one user turn through its chat template (plain text with
    the tokenizer's special tokens where it has none), if it fits the export's context with the
    decode steps; an informational gate says when it does not. ``answers``: where the tokenizer's
    answers are kept (``text.load_tokenizer``)."""
    from exporter.validation import text

    rng = np.random.default_rng(0)
    prompts = [("", [int(t) for t in rng.integers(3, cfg["vocab_size"], size=prompt_len)])]
    try:
        tokenizer = text.load_tokenizer(checkpoint, answers)
        if tokenizer is None:
            return prompts
        ids, kind = text.chat_prompt(tokenizer)
    except Exception as err:  # a tokenizer or template transformers cannot use: parity on token ids only
        if checkpoints.is_stop(err):
            raise  # a cancel or a lost lease, not a failure of this step
        gates.append(GateResult("parity", "real-text prompt", True, "error", "the checkpoint's tokenizer",
                                f"transformers could not tokenize the real-text prompt ({str(err)[:200]}): "
                                "parity ran on random token ids only", informational=True))
        return prompts
    room = cfg.get("max_seq_len")
    if max(ids, default=0) >= cfg["vocab_size"]:
        gates.append(GateResult("parity", f"{kind} prompt", True, f"token id {max(ids)}", f"< {cfg['vocab_size']}",
                                "the tokenizer's ids exceed the model's vocabulary: no real-text parity run",
                                informational=True))
    elif room and len(ids) + steps > room:
        gates.append(GateResult("parity", f"{kind} prompt", True, f"{len(ids)} + {steps} tokens", f"<= {room}",
                                f"the {kind} prompt and {steps} decode steps do not fit max_seq_len {room}: "
                                "no real-text parity run", informational=True))
    else:
        prompts.append((f"{kind} prompt", ids))
    return prompts


def _loaded(checkpoint: Path, ep: str) -> list:
    """[(the streamed reference model, seconds)], a list its taker empties (``.pop()``), so the
    future that carried it does not keep it alive."""
    from exporter.validation import reference

    return [_timed(reference.open_reference, checkpoint, ep)]


def validation_session(export_dir: Path, ep: str, dtype: str):
    """The session parity and the quality gate run the export in (``validation_session_options``)."""
    from exporter.runtime.session import Decoder

    return Decoder(export_dir, ep=ep, **validation_session_options(dtype))


def validation_session_options(dtype: str) -> dict[str, bool]:
    """How validation makes a session of the export, its own and onnxruntime-genai's alike
    (``Decoder``'s ``prepack`` and ``spin``). It runs a few dozen steps: repacking the weights first
    would cost more than it saves (quantized exports keep it: MatMulNBits runs its CPU kernels on
    the repacked layout). It shares the cores with the weight check and the reference, so its
    threads sleep between ops rather than spin."""
    return {"prepack": dtype in QUANTIZED, "spin": False}


def reference_beside_session(ep: str) -> bool:
    """Whether transformers' model is set up while the probe and the export's session run (on a
    thread: in a fresh process that is mostly importing torch and transformers). An export that
    runs on a device leaves the host's cores to it; beside a CPU session the import would take
    the cores the session is being made on, so there it comes after."""
    return ep != "cpu"


def _parity(making, export_dir, ep, dtype, ref_source, prompts, steps, peer, cached, loading, reference_cache,
            shared_references, gates, timings, own, factory, traced=False, experts=False) -> dict | None:
    """For each prompt, the export decodes teacher-forced on the reference's tokens and is judged;
    without a cached reference it decodes freely first and transformers checks those tokens (the
    streamed model set up by ``loading``, a future of ``_loaded``, or here), from a departure on
    checking the export's continuation of the reference's own tokens. A half-precision export is
    read beside transformers in its own dtype (``yardstick``); an export whose logits are not
    finite is probed for where they stop being finite (``overflow``); a mixture of experts' (``experts``)
    departures are replayed for router near ties (``_routing_ties``). Returns the first prompt's
    result, with the others' under ``prompts``. ``making``: the future of ``_timed(factory, export_dir,
    ep)``, the export's session being made; ``factory`` makes the peer's."""
    from exporter.validation import reference
    from exporter.validation.parity import export_decode

    t0 = time.perf_counter()
    made = _session(making.result, ep, "parity", gates)  # (the driver, the seconds making it took)
    lm, timings["parity_session"] = made or (None, 0.0)
    if lm is None:
        timings["parity"] = time.perf_counter() - t0
        return None
    parity_s = time.perf_counter() - t0
    model, refs, runs = None, [], []
    try:
        for (label, prompt), (cache_path, ref) in zip(prompts, cached):
            t0 = time.perf_counter()
            free_run = None
            if ref is None:
                # The export decodes greedily on its own first; the reference then checks those tokens
                # in one forward pass (reference_greedy) rather than one pass per step. The streamed
                # reference holds about one layer, so the session stays: where the reference departs
                # from the export's tokens, the export drafts again from the reference's tokens so far.
                free_run = export_decode(lm, prompt, steps)
                parity_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                if model is None:
                    model, timings["reference_load"] = (loading.result() if loading else
                                                        _loaded(ref_source.path, ep)).pop()
                drafts = [0]

                def redraft(tokens: list[int], prompt=prompt, lm=lm) -> list[int]:
                    drafts[0] += 1
                    return export_decode(lm, prompt + tokens, steps - len(tokens)).chosen

                ref = reference.reference_greedy(model, prompt, steps, free_run.chosen, redraft)
                timings["reference_passes"] = float(model.passes)
                timings["reference_redrafts"] = timings.get("reference_redrafts", 0.0) + drafts[0]
                reference.store_reference(cache_path, ref, shared_references)
                timings["reference"] += time.perf_counter() - t0
                t0 = time.perf_counter()
            # Parity is judged teacher-forced: the export fed the reference's tokens. Its free run was
            # exactly that run when it chose the reference's tokens at every step; otherwise it runs again.
            run = free_run if free_run is not None and free_run.follows(ref.tokens) else None
            if run is None:
                run = export_decode(lm, prompt, steps, ref.tokens)
            parity_s += time.perf_counter() - t0
            refs.append(ref)
            runs.append(run)
        _note_own_greedy(own, lm, prompts[-1][1], steps, free_run, runs[-1])
    finally:
        if model is not None:
            model.close()
        del model
    if peer is not None:
        t0 = time.perf_counter()
        gates.append(peer_gate(lm, factory(Path(peer), ep), refs[0], dtype))
        parity_s += time.perf_counter() - t0
    batch = None
    if traced:
        t0 = time.perf_counter()
        batch = batch_gate(lm, len(refs[0].prefill_logits), dtype, steps)
        timings["batch"] = time.perf_counter() - t0
    del lm
    results, opened = [], []
    try:
        for (label, prompt), ref, run in zip(prompts, refs, runs):
            yardsticks = _yardsticks(dtype, run, ref, ref_source, ep, reference_cache, shared_references, timings)
            finding = None
            if not all(np.isfinite(logits).all() for logits in run.logits[: len(ref.tokens)]):
                finding = _locate_overflow(export_dir, ep, prompt, run, ref, timings)
            ties = (_routing_ties(dtype, run, ref, ref_source, ep, opened, timings, yardsticks[0])
                    if experts and finding is None else {})
            parity_results, result = parity_gates(run, ref, dtype, *yardsticks, overflow=finding, prompt=label,
                                                   ep=ep, routing_ties=ties)
            gates += parity_results
            results.append(result.to_dict())
    finally:
        for model in opened:
            model.close()
    if batch is not None:
        gates.append(batch)
    timings["parity"] = parity_s
    parity = results[0]
    if len(results) > 1:
        parity["prompts"] = [{"prompt": label, **result} for (label, _), result in zip(prompts[1:], results[1:])]
    return parity


def will_check_genai(manifest: dict) -> bool:
    """Whether the genai gate will load this export: a genai package, onnxruntime-genai importable."""
    return bool((manifest.get("genai") or {}).get("package")) and genai_importable()


def _note_own_greedy(own: dict | None, lm, prompt: list[int], steps: int, *made) -> None:
    """The export's own greedy tokens on ``prompt`` (and its top-1/top-2 gaps) into ``own``, for the
    genai gate; nothing where it will not run (None). A run of ``prompt`` already ``made`` serves
    where it was the export's own greedy run (it chose every token it was fed)."""
    if own is None:
        return
    from exporter.validation.parity import export_decode

    mine = next((r for r in made if r is not None and r.chosen == r.fed), None) or export_decode(lm, prompt, steps)
    own.update(prompt=prompt, tokens=mine.chosen, gaps=[top2_gap(logits) for logits in mine.logits[:steps]])


def _yardsticks(dtype, run, ref, ref_source, ep, reference_cache, shared, timings):
    """(transformers in the export's dtype, transformers in the other half precision or None) for a
    half-precision export, the second only where the first is not sound: it names the dtype to
    export instead. (None, None) for fp32, and where transformers cannot run in the dtype."""
    from exporter.validation import yardstick

    if dtype not in yardstick.TORCH_DTYPES:
        return None, None
    t0 = time.perf_counter()
    measure = functools.partial(yardstick.cached_measure, reference_cache, ref_source.revision, ref_source.path, ep,
                                ref=ref, shared=shared)
    same = other = None
    try:
        same = measure(dtype)
        if not yardstick.sound(same, ref, PREFILL_TOLERANCE[dtype], NEAR_TIE_MARGIN[dtype]):
            other = measure(yardstick.OTHER[dtype])
    except Exception as err:  # a yardstick, not a gate: the export is judged against fp32 without it
        if checkpoints.is_stop(err):
            raise  # a cancel or a lost lease, not a failure of this step
        import logging

        logging.getLogger(__name__).warning("transformers in %s could not run beside the export: %s", dtype, err)
    finally:
        timings["yardstick"] = timings.get("yardstick", 0.0) + time.perf_counter() - t0
    return same, other


def _names_experts(checkpoint: Path) -> bool:
    """Whether the checkpoint's config (or its text config) names routed experts: a traced export's metadata has no
    moe section."""
    from exporter.graph.config import read_raw_config

    raw = read_raw_config(checkpoint)
    return any(isinstance(c.get(key), int) and c[key] > 1 for c in (raw, raw.get("text_config") or {})
               for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))


def _routing_ties(dtype, run, ref, ref_source, ep, opened: list, timings, same=None) -> dict:
    """A half-precision export's departures on this prompt that flipped near-tie expert choices of transformers'
    fp32 model explain (routing.explain_run, on the reference opened once into ``opened`` where a prompt departs):
    {step: RoutingTie}; ``same``: transformers in the export's dtype (its measured near-tie margin, where sound, is the
    one the gates judge tokens by). Not where one pass is not the reference's run (a longrope model crossing its
    switch)."""
    from exporter.validation import reference, routing

    if dtype not in ("fp16", "bf16"):
        return {}
    margin = near_tie_margin(dtype, same, ref)
    if not routing.departures(run, ref, dtype, margin):
        return {}
    t0 = time.perf_counter()
    try:
        if not opened:
            opened.append(reference.open_reference(ref_source.path, ep))
        model = opened[0]
        switch = reference._rope_switch(model.config)
        if switch is not None and len(ref.prompt) <= switch < len(ref.prompt) + len(ref.tokens):
            return {}
        import torch

        inputs = {"input_ids": torch.tensor([list(ref.prompt) + list(ref.tokens[:-1])])}
        return routing.explain_run(model, inputs, run, ref, dtype, margin)
    except Exception as err:  # it explains, it is not a gate: the export is judged without it
        if checkpoints.is_stop(err):
            raise
        import logging

        logging.getLogger(__name__).warning("the routing replay could not run: %s", err)
        return {}
    finally:
        timings["routing_replay"] = timings.get("routing_replay", 0.0) + time.perf_counter() - t0


def _locate_overflow(export_dir, ep, prompt, run, ref, timings):
    """Where the export's values first stop being finite, on the history that led to its first
    non-finite logits (None where the probe itself cannot run: the gate then says what it saw)."""
    first = next(i for i, logits in enumerate(run.logits) if not np.isfinite(logits).all())
    return _probe_overflow(export_dir, ep, list(prompt) + list(run.fed[:first]), timings)


def _probe_overflow(export_dir, ep, tokens, timings):
    from exporter.runtime.session import read_metadata
    from exporter.validation import overflow

    t0 = time.perf_counter()
    model_path = Path(export_dir) / MODEL_FILE
    num_layers = read_metadata(model_path)["config"]["num_layers"]
    try:
        return overflow.locate(model_path, ep, list(tokens), num_layers)
    except Exception as err:  # a diagnosis, not a gate: the failure stands without it
        if checkpoints.is_stop(err):
            raise  # a cancel or a lost lease, not a failure of this step
        import logging

        logging.getLogger(__name__).warning("could not probe %s for its overflow: %s", export_dir, err)
        return None
    finally:
        timings["overflow_probe"] = timings.get("overflow_probe", 0.0) + time.perf_counter() - t0


QUANTIZED = ("int4", "int8")


def _session(make, ep, gate: str, gates: list):
    """What ``make()`` returns (the runtime driver for the export), or None with a failed gate saying
    why the export would not load."""
    try:
        return make()
    except Exception as err:
        gates.append(GateResult(gate, f"session on {ep}", False, "error", "a session",
                                f"onnxruntime could not load the model on {ep}: {str(err)[:300]}"))
        return None


def _image_text_quality(export_dir, ep, dtype, activations, ref_source, cfg, model, gates, timings, thresholds,
                        reference_cache, shared_references) -> dict | None:
    """A quantized image-text export: the quality gate of a text export, on the same windows of real text, the
    export run as its runtime runs a text prompt (ids -> embedding graph -> decoder on inputs_embeds, Qwen's
    text-only M-RoPE positions: runtime/image_text.py), against transformers' image-text ``model`` (fp32, loaded
    for the component gates) on the same ids, or the windows' logits kept for this checkpoint (an activation
    measurement's, another dtype's)."""
    from exporter.runtime.image_text import open_image_text
    from exporter.validation.reference import WholeReference

    return _quality(export_dir, ep, dtype, activations, ref_source, cfg,
                    lambda d, e: open_image_text(d, e, **validation_session_options(dtype)).decoder, gates, timings,
                    thresholds, reference_cache, shared_references, None, None, PARITY_STEPS,
                    open_model=lambda: (WholeReference(Path(ref_source.path), "cpu", model), 0.0), image_text=True)


def _quality(export_dir, ep, dtype, activations, ref_source, cfg, factory, gates, timings, thresholds,
             reference_cache, shared_references, own, prompt, steps, traced=False, open_model=None,
             image_text=False) -> dict | None:
    """Quantized exports: the quality gate (agreement, KL, perplexity) replaces exact parity. The
    reference's logits over the quality text come from the streamed reference (one pass over the
    weights for every window of one length) and are kept per checkpoint and text, like parity's.
    ``open_model()``: (the reference, seconds it took) in place of the streamed reference; ``image_text``: the
    export's decoder takes inputs_embeds (``factory`` drives it through its embedding graph), which the overflow
    probe, feeding token ids, does not run."""
    from exporter.validation import reference
    from exporter.validation.gates.quality import WINDOW, export_logits, quality_gates, reference_logits, score, \
        text_tokens, windows

    t0 = time.perf_counter()
    checkpoint = Path(ref_source.path)
    tokens, tokenizer, prefix = text_tokens(checkpoint, cfg["vocab_size"], answers=reference_cache)
    chunks = windows(tokens, min(WINDOW, cfg.get("max_seq_len") or WINDOW), prefix)
    cache_path, ref = reference.cached_window_logits(reference_cache, ref_source.revision, chunks, shared_references)
    timings["reference_cached"] = float(ref is not None)
    if ref is None:
        model, seconds = open_model() if open_model else _loaded(checkpoint, ep).pop()
        timings["reference_load"] = timings.get("reference_load", 0.0) + seconds
        try:
            ref = reference_logits(model, chunks)
            timings["reference_passes"] = float(model.passes)
        finally:
            model.close()
        del model
        reference.store_window_logits(cache_path, chunks, ref, shared_references)
    timings["reference"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lm = _session(lambda: factory(export_dir, ep), ep, "quality", gates)
    if lm is None:
        return None
    got = export_logits(lm, chunks)
    result = score(chunks, ref, got, tokenizer)
    gates += quality_gates(result, dtype, thresholds, cfg["vocab_size"])
    int8_activations = _int8_activations(export_dir / "model.onnx")
    gates.append(_decode_consistency(lm, chunks[0], got[0], activations, int8_activations))
    if traced:  # int8 activations quantize a batch's rows and a lone row's steps apart: then it informs
        gates.append(batch_gate(lm, cfg["vocab_size"], activations, steps, informational=int8_activations))
    _note_own_greedy(own, lm, prompt, steps)
    del lm  # the probe below makes a session of its own
    bad = [i for i, logits in enumerate(got) if not np.isfinite(logits).all()]
    if bad:
        finding = None if image_text else _probe_overflow(export_dir, ep, chunks[bad[0]], timings)
        gates.append(_quantized_overflow_gate(dtype, activations, ep, bad, len(chunks), finding))
    timings["quality"] = time.perf_counter() - t0
    return result.to_dict()


def _quantized_overflow_gate(dtype, activations, ep, bad, windows, finding) -> GateResult:
    """A quantized export whose logits are not finite: where its activations overflow, and the
    activation dtype that holds them."""
    where = (f"{activations} activations overflow in {finding.overflow_at} (first non-finite value: {finding.op} "
             f"{finding.node})" if finding is not None and finding.overflow_at else "non-finite logits")
    if activations == "fp16" and ep == "cuda":
        advice = ("compute in bf16, which has fp32's range: quant activations bf16 (CLI --quant-activations bf16; "
                  "the default where the checkpoint's measured activations come near fp16's largest value)")
    elif activations == "fp16":
        advice = "export for cpu, where quantized exports compute in fp32"
    else:
        advice = "the checkpoint's weights or the export are broken: check the weight gate"
    return GateResult("quality", "export outputs finite", False, f"non-finite in windows {bad} of {windows}",
                      "every logit finite", f"{dtype} export: {where}; {advice}",
                      details={"overflow": finding.to_dict() if finding else None})


def _int8_activations(model_path: Path) -> bool:
    """Whether any MatMulNBits computes with int8 activations (accuracy_level 4: the CPU EP's 8-bit weights)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    return any(a.name == "accuracy_level" and a.i == 4 for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute)


def _decode_consistency(lm, tokens: list[int], prefill_logits: np.ndarray, activations: str, int8_activations: bool = False,
                        steps: int = 24) -> GateResult:
    """Quantized exports: decode one token at a time through the KV cache (the M=1 kernels and the
    cache contract the quality windows never reach) and compare with the export's own prefill of
    the same tokens: the same weights either way, so they must agree to the activation dtype.

    With int8 activations (``int8_activations``) the CPU kernels quantize a one-token step's
    activations apart from a prefill's, so the two legitimately differ beyond that tolerance: the
    figures are reported as information, and the quality checks against the fp32 reference, which
    score what those kernels compute, are the verdict."""
    start = max(1, len(tokens) - steps)
    from exporter.validation.parity import export_decode

    decoded = export_decode(lm, tokens[:start], len(tokens) - start, tokens[start:]).logits[1:]
    # decoding tokens[i] gives the logits at position i, which the prefill computed at row i
    expected = prefill_logits[start:len(tokens)]
    diff = max(float(np.max(np.abs(d - e))) for d, e in zip(decoded, expected))
    span = float(prefill_logits.max() - prefill_logits.min())
    limit = PREFILL_TOLERANCE[activations] * span
    flips = [start + i for i, (d, e) in enumerate(zip(decoded, expected)) if int(d.argmax()) != int(e.argmax())
             and float(np.diff(np.sort(e)[-2:])[0]) >= NEAR_TIE_MARGIN[activations]]
    ok = diff <= limit and not flips
    message = "" if ok else f"max logit difference {diff:.4g}, argmax differs at positions {flips}"
    if int8_activations:
        message = ("int8 activations (MatMulNBits accuracy_level 4): a decode step and a prefill quantize activations "
                   "apart, so this is reported, not judged; the checks against the fp32 reference are the verdict"
                   + (f" ({message})" if message else ""))
    return GateResult("quality", f"{len(decoded)} decode steps through the cache vs the export's own prefill",
                      ok, diff, limit, message, informational=int8_activations,
                      details={"relative_tolerance": PREFILL_TOLERANCE[activations], "logit_range": span,
                               "int8_activations": int8_activations})


__all__ = ["ValidationReport", "validate_export", "PREFILL_TOLERANCE", "NEAR_TIE_MARGIN", "REPORT_JSON", "REPORT_MD"]
