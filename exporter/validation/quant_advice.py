"""Which int4 passes the quality gate on this model: other recipes measured on the model itself.

When an int4 export fails its quality gate, "try something else" is no help: the user needs the recipe
that passes on *this* model and the request field that gets it. Each candidate recipe (zero points,
an 8-bit LM head, smaller blocks, HQQ on CUDA, fp32 activations on the CPU; nothing the request
already has) is measured without exporting it: the export's graph is built and folded for the
candidate's request (cheap: no weight is quantized until written), which names every checkpoint
tensor the candidate quantizes and how; transformers' model of the checkpoint (the streamed
reference) then runs the quality gate's windows with each of those tensors replaced, as it is read,
by its own quantize-dequantize (the exporter's numpy quantizer, bit for bit onnxruntime's), and on
the CPU with the inputs of the quantized projections rounded as onnxruntime's int8-activation
kernels round them (accuracy_level 4: int8 per block of K, one scale each). That is the quantized
model's arithmetic up to the kernels' accumulation order, scored against the same reference logits
by the gate's own ``score``. Candidates are tried smallest first; the first within
``ERROR_MARGIN`` of every threshold is the advice, with its size, its figures and the CLI flags and
API fields that get it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

# A candidate is advised only with this much of each error budget to spare (KL, perplexity increase,
# disagreement): the simulation leaves out the kernels' rounding order and the export's fp16 / bf16
# arithmetic on CUDA, which the real export adds back.
# (Measured on Qwen2.5-Coder-0.5B, the CPU default int4: simulated KL 0.191, agreement 0.911,
# perplexity +32.7% against the export's own 0.189, 0.916, +31.8%.)
ERROR_MARGIN = 0.9


@dataclasses.dataclass(frozen=True)
class Candidate:
    label: str
    quant: dict  # QuantSpec fields over the request's
    dtype: str = "int4"

    def cli(self) -> str:
        if self.dtype != "int4":
            return f"--dtype {self.dtype}"
        flags = {"symmetric": lambda v: "" if v else "--quant-asymmetric",
                 "lm_head_bits": lambda v: f"--quant-lm-head-bits {v}",
                 "block_size": lambda v: f"--quant-block-size {v}",
                 "method": lambda v: f"--quant-method {v}",
                 "accuracy_level": lambda v: f"--quant-accuracy-level {v}",
                 "int8_layers": lambda v: f"--quant-int8-layers {','.join(map(str, v))}"}
        return " ".join(f for k, v in self.quant.items() if (f := flags[k](v)))


def candidates(request, sensitive: list[int] = ()) -> list[Candidate]:
    """int4 recipes to try for ``request``, smallest first (zero points cost 1/2 bit a block of 32, an
    8-bit LM head a vocabulary of bytes, each 8-bit layer twice its int4 bytes); ``sensitive``: decoder
    layers most sensitive first, for 8-bit layers; the ones it already has are left out."""
    cuda = request.ep.value == "cuda"
    layers = [Candidate(f"zero points + 8-bit LM head + the {k} most sensitive layers in 8 bits",
                        {"symmetric": False, "lm_head_bits": 8, "int8_layers": sorted(sensitive[:k])})
              for k in (2, 4, 8, 12) if len(sensitive) >= 2 * k]
    options = [
        Candidate("zero points (asymmetric)", {"symmetric": False}),
        *([Candidate("HQQ (zero points fitted per block)", {"method": "hqq", "symmetric": False})] if cuda else []),
        Candidate("8-bit LM head", {"lm_head_bits": 8}),
        Candidate("zero points + 8-bit LM head", {"symmetric": False, "lm_head_bits": 8}),
        *([Candidate("HQQ + 8-bit LM head", {"method": "hqq", "symmetric": False, "lm_head_bits": 8})] if cuda else []),
        *layers,
        Candidate("zero points + 8-bit LM head, blocks of 16", {"symmetric": False, "lm_head_bits": 8, "block_size": 16}),
        *([] if cuda else [Candidate("zero points + 8-bit LM head, fp32 activations (accuracy_level 0: slower decode)",
                                     {"symmetric": False, "lm_head_bits": 8, "accuracy_level": 0})]),
        Candidate("int8 (no int4 recipe passes)", {}, "int8"),
    ]
    have = {**_DEFAULTS, **(request.quant.to_dict() if request.quant else {})}
    return [c for c in options if c.dtype != "int4" or any(have[k] != v for k, v in c.quant.items())]


_DEFAULTS = {"symmetric": True, "lm_head_bits": None, "block_size": 32, "method": "rtn", "accuracy_level": None,
             "int8_layers": []}


def with_candidate(request, candidate: Candidate):
    from exporter.request import ExportRequest, QuantSpec

    if candidate.dtype != "int4":  # another width: its own defaults, the request's activations and layout
        kept = {k: v for k, v in (request.quant.to_dict() if request.quant else {}).items() if k == "activations"}
        return ExportRequest(**{**request.to_dict(), "dtype": candidate.dtype, "quant": QuantSpec.from_dict(kept)})
    quant = {**(request.quant.to_dict() if request.quant else {}), **candidate.quant}
    return ExportRequest(**{**request.to_dict(), "quant": QuantSpec.from_dict(quant)})


def quantized_tensors(request, source, activations) -> dict[str, tuple]:
    """checkpoint tensor -> (QuantScheme, transposed, accuracy level) for every weight ``request``'s export
    quantizes: its graph built and folded (nothing quantized yet), read from the initializers' recipes."""
    from exporter.graph.build import build_model
    from exporter.graph.fold import CPU_ACCURACY_LEVEL, fold_model
    from exporter.graph.passes.quantize import QuantScheme
    from exporter.packaging.package import initializer_sources

    built = build_model(request, source, activations=activations)
    fold_model(built.model, request, built.config.num_layers)
    spec = request.quant
    found = {}
    for recipe in initializer_sources(built.model).values():
        quant = recipe.get("quantization")
        if not quant or quant["role"] != "packed":
            continue
        scheme = QuantScheme.of(quant)
        level = spec.accuracy_level if spec and spec.accuracy_level is not None else (
            CPU_ACCURACY_LEVEL.get(scheme.bits, 0) if request.ep.value == "cpu" else 0)
        for part in recipe.get("parts", []):
            found[part["tensor"]] = (scheme, bool(part.get("transposed")), level)
    return found


def _roundtrip(array: np.ndarray, scheme, transposed: bool, dtype) -> np.ndarray:
    """``array``'s quantize-dequantize as the export stores it (rows along the last axis, or the
    second to last for a transposed [experts, in, out] weight), in the reference's float32."""
    from exporter.cores import in_order, usable_cores
    from exporter.graph.passes.quantize import dequantize, quantize_hqq, quantize_rows

    w = np.asarray(array, np.float32)
    if transposed:
        w = np.ascontiguousarray(w.swapaxes(-1, -2))
    rows = w.reshape(-1, w.shape[-1]).astype(dtype)  # scales in the activation dtype, as the export's

    def roundtrip(span: slice) -> np.ndarray:
        part = rows[span]
        if scheme.method == "hqq":
            packed, scales, zero = quantize_hqq(part, scheme.bits, scheme.block_size)
        else:
            packed, scales, zero = quantize_rows(part, scheme.bits, scheme.block_size, scheme.symmetric)
        return dequantize(packed, scales, None if scheme.symmetric else zero, scheme, part.shape[1])

    # Rows quantize independently (blocks run along K): spread over the cores, a bounded span at a
    # time. HQQ's optimizer stops on the mean error of the rows it is given: one call, as the export's.
    step = rows.shape[0] if scheme.method == "hqq" else max(1, (1 << 22) // max(1, rows.shape[1]))
    spans = [slice(a, a + step) for a in range(0, rows.shape[0], step)]
    back = np.concatenate(list(in_order(roundtrip, spans, usable_cores(), "advice")), axis=0).reshape(w.shape)
    return np.ascontiguousarray(back.swapaxes(-1, -2) if transposed else back)


def _int8_blocks(x, block: int):
    """onnxruntime's int8 activations (MatMulNBits accuracy_level 4 on the CPU): each block of ``block``
    along K rounded to int8 with its own scale (largest magnitude / 127)."""
    import torch

    k = x.shape[-1]
    pad = (-k) % block
    y = torch.nn.functional.pad(x, (0, pad)) if pad else x
    y = y.reshape(*y.shape[:-1], -1, block)
    scale = y.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(y / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127) * scale, y)
    q = q.reshape(*x.shape[:-1], k + pad)
    return q[..., :k] if pad else q


def _layer_outputs(model, store: list | None, baseline: list | None):
    """Hooks on every decoder layer: with ``store``, keep each layer's output (the fp32 reference's);
    with ``baseline`` (those outputs), add up each layer's squared error against it and the norm."""
    errors = [[0.0, 0.0] for _ in model.layers]
    handles = []
    for i, layer in enumerate(model.layers):
        def hook(_module, _args, out, i=i):
            hidden = (out[0] if isinstance(out, (tuple, list)) else out).detach().float()
            if store is not None:
                store.append(hidden.cpu())
            else:
                ref = baseline[len(store_seen) % len(baseline)]
                store_seen.append(i)
                errors[i][0] += float(((hidden.cpu() - ref) ** 2).sum())
                errors[i][1] += float((ref ** 2).sum())
        handles.append(layer.register_forward_hook(hook))
    store_seen: list[int] = []
    return handles, errors


def layer_sensitivity(request, source, activations, chunks: list[list[int]]) -> list[int]:
    """Decoder layers, most sensitive first: the error each adds to the residual stream when every
    weight is quantized as ``request`` says (its output's relative error against the fp32 reference's,
    less the error it was given), measured in one fp32 pass and one simulated pass over ``chunks``."""
    from exporter.validation.gates.quality import reference_logits
    from exporter.validation.reference import open_reference

    outputs: list = []
    model = open_reference(Path(source.path), request.ep.value)
    handles, _ = _layer_outputs(model, outputs, None)
    try:
        reference_logits(model, chunks)
    finally:
        for handle in handles:
            handle.remove()
        model.close()
    errors: list = []
    simulate(request, source, activations, chunks, None, "", layer_errors=(outputs, errors))
    relative = [float(np.sqrt(e / n)) if n else 0.0 for e, n in errors]
    added = [relative[i] - (relative[i - 1] if i else 0.0) for i in range(len(relative))]
    return sorted(range(len(added)), key=lambda i: -added[i])


def simulate(request, source, activations, chunks: list[list[int]], reference: list[np.ndarray] | None,
             tokenizer: str, layer_errors: tuple | None = None):
    """The quality gate's figures (``QualityResult``) of ``request``'s export, measured by simulation;
    with ``layer_errors`` (the fp32 layer outputs, a list to fill), each layer's error instead."""
    import ml_dtypes
    import torch

    from exporter.validation.gates.quality import reference_logits, score
    from exporter.validation.reference import open_reference

    tensors = quantized_tensors(request, source, activations)
    dtype = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}.get(activations.value, np.float32)
    model = open_reference(Path(source.path), request.ep.value)
    gathered_from_head = request.quant is None or request.quant.method != "hqq"

    def transform(name: str, array: np.ndarray, embedding: bool) -> np.ndarray:
        found = tensors.get(name)
        if found is None or (embedding and not gathered_from_head):
            return array
        scheme, transposed, _ = found
        return _roundtrip(array, scheme, transposed, dtype)

    model.transform = transform
    handles = []
    for module_name, module in model.model.named_modules():
        weight = getattr(module, "weight", None)
        name = model._names.get(id(weight)) if isinstance(module, torch.nn.Linear) else None
        if name in tensors and tensors[name][2] == 4:
            block = tensors[name][0].block_size
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, block=block: (_int8_blocks(args[0], block), *args[1:])))
    if layer_errors is not None:
        extra, errors = _layer_outputs(model, None, layer_errors[0])
        handles += extra
    try:
        got = reference_logits(model, chunks)
    finally:
        for handle in handles:
            handle.remove()
        model.close()
    if layer_errors is not None:
        layer_errors[1][:] = errors
        return None
    return score(chunks, reference, got, tokenizer)


def within(result, limits: dict, margin: float = 1.0) -> bool:
    """Whether the figures pass ``limits`` (the gate's thresholds) with ``margin`` of each error budget."""
    return (result.kl_mean <= margin * limits["kl_max"] and result.ppl_delta <= margin * limits["ppl_delta_max"]
            and (not result.decisive_positions or 1 - result.agreement <= margin * (1 - limits["agreement_min"])))


def advise(request, source, activations, chunks, reference, tokenizer: str, limits: dict, num_layers_config=None,
           log=lambda _: None) -> dict:
    """Measure ``candidates(request)`` smallest first and return the advice: the first within the
    error margin, every figure measured on the way, and how to ask for it."""
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.resources import export_bytes

    config = num_layers_config or load_model_config(source.path, ARCHITECTURES)
    tried, chosen, sensitive = [], None, []
    base = export_bytes(config, request)
    queue = candidates(request)
    while queue and chosen is None:
        candidate = queue.pop(0)
        if "int8_layers" in candidate.quant and not sensitive:
            continue
        asked = with_candidate(request, candidate)
        result = simulate(asked, source, activations, chunks, reference, tokenizer)
        size = export_bytes(config, asked)
        entry = {"recipe": candidate.label, "dtype": candidate.dtype, "quant": candidate.quant, "kl": round(result.kl_mean, 4),
                 "agreement": round(result.agreement, 4), "ppl_delta": round(result.ppl_delta, 4),
                 "bytes": size, "size_vs_request": round(size / base, 3), "cli": candidate.cli()}
        tried.append(entry)
        log(f"quality advice: {candidate.label}: KL {result.kl_mean:.4g}, agreement {result.agreement:.4f}, "
            f"perplexity {result.ppl_delta:+.1%}")
        if within(result, limits, ERROR_MARGIN):
            chosen = entry
        elif not sensitive and candidate.quant == {"symmetric": False, "lm_head_bits": 8}:
            # The whole-model options are not enough: which layers would 8 bits help most, measured.
            sensitive = layer_sensitivity(asked, source, activations, chunks)
            queue = [c for c in candidates(request, sensitive) if "int8_layers" in c.quant] + \
                [c for c in queue if "int8_layers" not in c.quant]
    return {"how": "each recipe's weights quantized and dequantized as its export would store them, inside "
                   "transformers' model of the checkpoint, scored on the gate's text against the same reference"
                   + (" (the CPU's int8 activations rounded too)" if request.ep.value == "cpu" else ""),
            "margin": ERROR_MARGIN, "sensitive_layers": sensitive, "tried": tried, "advice": chosen}


def describe(advice: dict) -> str:
    """The advice as one sentence for the failed gate's message."""
    chosen = advice.get("advice")
    if chosen is None:
        best = min(advice["tried"], key=lambda t: t["kl"], default=None)
        return ("no recipe measured on this model passes with room to spare, int8 included"
                + (f" (closest: {best['recipe']}, KL {best['kl']:.3g}, perplexity {best['ppl_delta']:+.1%})" if best else "")
                + ": export fp16 / bf16, or loosen QUALITY_THRESHOLDS if those figures are acceptable")
    import json

    figures = (f"KL {chosen['kl']:.3g}, agreement {chosen['agreement']:.3f}, perplexity {chosen['ppl_delta']:+.1%}, "
               f"{chosen['size_vs_request']:.2f}x the size")
    if chosen["dtype"] != "int4":
        return (f"no int4 recipe measured on this model passes with room to spare; {chosen['dtype']} does ({figures}): "
                f"request dtype {chosen['dtype']} (CLI {chosen['cli']})")
    return (f"measured on this model, {chosen['recipe']} passes ({figures}): request quant "
            f"{json.dumps(chosen['quant'])} (CLI {chosen['cli']})")


__all__ = ["advise", "candidates", "describe", "simulate", "within", "Candidate", "ERROR_MARGIN"]
