"""How large a model's activations get on real text: what decides a quantized CUDA export's activations.

A weight-only quantized export computes in a half precision on CUDA: fp16 (onnxruntime's fastest
MatMulNBits and attention kernels; bf16 ones decoded 36% slower at 4 layers of an 8B geometry) unless
the model's activations do not fit fp16, whose largest value is 65504 (a real Gemma 3 overflows it
in its 11th layer), then bf16, which has fp32's range. Whether a checkpoint was trained in bf16 says
nothing about that (nearly every 2025-26 model ships bf16, and most run in fp16), so it is measured:
transformers' own model of the checkpoint (the streamed fp32 reference) runs the quality gate's
windows of real text, and every floating value a module of it takes or gives is watched for its
largest magnitude. fp16 is chosen when that peak, times ``FP16_HEADROOM``, still fits fp16: text the
export will see can go past the calibration text's peak. The logits of that pass are the quality
gate's reference, kept where validation finds them, so the measurement costs validation nothing more.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

FP16_MAX = 65504.0
# fp16 is chosen when the measured peak is at most half of fp16's largest value: one binade of room.
FP16_HEADROOM = 2.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.\d+$")


@dataclasses.dataclass
class ActivationRange:
    """The largest magnitude anywhere in the model on the measured text, where it was, and per layer."""

    peak: float
    where: str  # "decoder layer 11: mlp.down_proj input"
    layer_peaks: list[float]
    tokens: int
    finite: bool  # False: the fp32 reference itself produced inf / NaN

    def fits_fp16(self) -> bool:
        return self.finite and self.peak * FP16_HEADROOM <= FP16_MAX

    def to_dict(self) -> dict:
        return {"peak": round(self.peak, 3), "where": self.where, "tokens": self.tokens, "finite": self.finite,
                "headroom_needed": FP16_HEADROOM, "fp16_max": FP16_MAX,
                "layer_peaks": [round(p, 3) for p in self.layer_peaks]}


def _part(name: str) -> tuple[int | None, str]:
    match = _LAYER.search(name)
    if match is None:
        return None, name or "the model"
    return int(match.group(1)), name[match.end():] or "output"


def _peak(tensor) -> tuple[float, bool]:
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
        return 0.0, True
    t = tensor.detach()
    finite = torch.isfinite(t)
    ok = bool(finite.all())
    values = t if ok else t[finite]
    return (float(values.abs().max()) if values.numel() else 0.0), ok


def watch_peaks(model, num_layers: int):
    """Forward hooks on every module of transformers' ``model`` (a StreamedReference's ``.model``):
    returns (handles, state) where state fills with the peak, its place and each layer's peak."""
    state = {"peak": 0.0, "where": "", "layer_peaks": [0.0] * num_layers, "finite": True}

    def note(name: str, what: str, tensor) -> None:
        peak, finite = _peak(tensor)
        state["finite"] &= finite
        layer, local = _part(name)
        if layer is not None and layer < num_layers:
            state["layer_peaks"][layer] = max(state["layer_peaks"][layer], peak)
        if peak > state["peak"]:
            state["peak"] = peak
            state["where"] = (f"decoder layer {layer}: {local} {what}" if layer is not None else f"{local} {what}")

    def hook(name):
        def run(module, args, out):
            for value in args:
                note(name, "input", value)
            for value in (out if isinstance(out, (tuple, list)) else (out,)):
                note(name, "output", getattr(value, "logits", value))
        return run

    import torch

    def watched(name: str, module) -> bool:
        # What the export holds as tensors of its activation dtype: every projection's input and output
        # (the MLP's down projection takes act(gate) * up), the embedding, norms, experts, each layer's
        # output (the residual stream). Not masks or rotary tables, which are not activations.
        kind = type(module).__name__
        return (isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or _LAYER_NAME.search(name) is not None
                or kind.endswith(("Norm", "Experts", "MLP", "MoE", "MoeBlock", "SparseMoeBlock")))

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if name and watched(name, module)]
    return handles, state


def measure(checkpoint: Path, ep: str, chunks: list[list[int]], num_layers: int, image_text: bool = False):
    """(ActivationRange, the reference's logits of each window): one streamed fp32 pass over ``chunks``.
    ``image_text``: the checkpoint's image-text model (whole, as its validation loads it) runs the text, and
    its language model and LM head are watched, what an image-text export's decoder computes (its vision
    tower, which the text never reaches, is judged at validation by its features' tolerance)."""
    from exporter.validation.gates.quality import reference_logits

    if image_text:
        import torch

        from exporter.validation.image_text import language_model_module, open_image_text_reference

        model = open_image_text_reference(Path(checkpoint))  # on the host, as validation holds it
        # a container of the two, named as a causal LM's modules are ("model.layers.3...", "lm_head"); the
        # image-text model itself is not changed
        watched = torch.nn.ModuleDict({"model": language_model_module(model.model),
                                       "lm_head": model.model.get_output_embeddings()})
    else:
        from exporter.validation.reference import open_reference

        model = open_reference(Path(checkpoint), ep)
        watched = model.model
    handles, state = watch_peaks(watched, num_layers)
    try:
        logits = reference_logits(model, chunks)
    finally:
        for handle in handles:
            handle.remove()
        del watched, handles  # the last references to the model's modules: close() gives the device memory back
        model.close()
    found = ActivationRange(state["peak"], state["where"], state["layer_peaks"], sum(len(c) for c in chunks),
                            state["finite"])
    return found, logits


def quality_windows(checkpoint: Path, vocab_size: int, max_seq_len: int | None) -> list[list[int]]:
    """The quality gate's windows of real text for this checkpoint (validate.py's ``_quality`` reads
    the same ones, so the logits measured here are its reference)."""
    from exporter.validation.gates.quality import WINDOW, text_tokens, windows

    tokens, _, prefix = text_tokens(Path(checkpoint), vocab_size)
    return windows(tokens, min(WINDOW, max_seq_len or WINDOW), prefix)


def choose_activations(request, source, num_layers: int, vocab_size: int, reference_cache: Path | None = None,
                       shared=None, image_text: str | None = None):
    """(the activation dtype, why) for ``request`` on the checkpoint ``source``: the dtype's own
    for float exports and fp32 for quantized cpu ones; on cuda what the request chose, the dtype a
    GPTQ / AWQ checkpoint's scales are in (other activations would round them), else measured.

    ``image_text``: the model_type of an image-text checkpoint whose image-text export is asked for, measured
    through its image-text model (its language model's layers). Where its activations do not fit fp16 its image-text
    export computes in bf16, as a bf16 request's does."""
    from exporter.errors import ExportError
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.request import EP, DType
    from exporter.validation import reference

    chosen = request.quant.activations if request.quant else None
    if not request.dtype.quantized or request.ep is not EP.CUDA:
        return request.activations, {"by": "dtype", "why": f"{request.dtype.value} on {request.ep.value}"}
    if chosen:
        return DType(chosen), {"by": "request", "why": f"the request's quant activations {chosen}"}
    checkpoint = Checkpoint(Path(source.path))
    if checkpoint.prequantized is not None:
        import onnx_ir as ir

        scales = DType.BF16 if checkpoint.packed_scales_dtype is ir.DataType.BFLOAT16 else DType.FP16
        return scales, {"by": "checkpoint", "why": f"the checkpoint's {checkpoint.prequantized.method} scales are "
                                                    f"{scales.value}: other activations would round them"}
    chunks = quality_windows(Path(source.path), vocab_size, request.max_seq_len)
    found, logits = measure(Path(source.path), request.ep.value, chunks, num_layers, image_text=bool(image_text))
    cache_path, cached = reference.cached_window_logits(reference_cache, source.revision, chunks, shared)
    if cached is None:
        reference.store_window_logits(cache_path, chunks, logits, shared)
    fits = found.fits_fp16()
    dtype = DType.FP16 if fits else DType.BF16
    if not fits and (request.layout == "hf" or request.compat):
        consumer = "transformers.js" if request.layout == "hf" else "older onnxruntime (compat)"
        raise ExportError(
            f"this model's activations reach {found.peak:.4g} ({found.where}) on real text, too close to fp16's "
            f"largest value ({FP16_MAX:g}) for fp16 activations, and {consumer} has no bf16 kernels for a quantized "
            f"export: export it for ep cpu (fp32 activations), or without {'the hf layout' if request.layout == 'hf' else 'compat'} (bf16)")
    if not found.finite:
        why = "the fp32 reference itself produced non-finite values on the calibration text: bf16 (fp32's range)"
    elif fits:
        why = (f"the largest activation on {found.tokens} tokens of text is {found.peak:.4g} ({found.where}), "
               f"{FP16_MAX / found.peak:.1f}x below fp16's largest value: fp16")
    else:
        why = (f"the largest activation on {found.tokens} tokens of text is {found.peak:.4g} ({found.where}): "
               f"within a factor {FP16_HEADROOM:g} of fp16's largest value ({FP16_MAX:g}) or beyond it, so bf16")
    return dtype, {"by": "measurement", "why": why, **found.to_dict(),
                   **({"measured_on": "the image-text model's language model"} if image_text else {})}


__all__ = ["ActivationRange", "choose_activations", "measure", "watch_peaks", "FP16_HEADROOM", "FP16_MAX"]
