"""int4 mixed precision chosen by measurement: which decoder layers get 8 bits.

Each layer's sensitivity is the quality gate's KL (the reference's logits against the export's,
exporter/validation/gates/quality.py) of an export in which that layer alone is int4 and every other
layer 8-bit, measured on the quality text's tail that the gate itself never scores: the damage int4 does there, measured, not guessed from weight
statistics. The most sensitive layers then get 8 bits, most sensitive first, as many as the size
budget holds (the sizes estimated by exporter/resources.py, the final one measured and held to the
budget), or, given a KL target, until the measured KL meets it. The result is a quant spec
(``int8_layers``) any export can use; its manifest then records ``bits_for: int8_layers`` on each
weight that got 8 bits.

This is one export and one quality pass per layer: minutes for a small model on a CPU, a job for
a big one; the plan is kept as JSON beside the exports (``exportfarm quant-plan``).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from exporter.errors import ExportError
from exporter.request import ExportRequest, QuantSpec


@dataclasses.dataclass
class Measured:
    int8_layers: tuple[int, ...]
    kl: float
    agreement: float
    perplexity_ratio: float
    bytes: int

    def to_dict(self) -> dict:
        return {"int8_layers": list(self.int8_layers), "kl": round(self.kl, 5), "agreement": round(self.agreement, 5),
                "perplexity_ratio": round(self.perplexity_ratio, 5), "bytes": self.bytes}


def plan_int8_layers(request: ExportRequest, work: Path, budget_bytes: int | None = None,
                     kl_target: float | None = None, log: Callable[[str], None] = lambda _: None) -> dict:
    """Measure every layer's sensitivity for ``request`` (an int4 export of a local checkpoint, its
    quant spec the base: method, block size, LM head) and choose ``int8_layers``: within
    ``budget_bytes`` (model.onnx.data), and with ``kl_target`` no more layers than meet it."""
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.packaging.resolve import resolve_source
    from exporter.pipeline import export_model
    from exporter.resources import export_bytes
    from exporter.runtime.session import Decoder
    from exporter.validation.gates.quality import MAX_TOKENS, WINDOW, export_logits, reference_logits, score, \
        text_tokens, windows
    from exporter.validation.reference import load_reference

    if request.dtype.bits != 4:
        raise ExportError(f"quant-plan chooses 8-bit layers of an int4 export: use dtype int4, not {request.dtype.value}")
    if budget_bytes is None and kl_target is None:
        raise ExportError("quant-plan needs a size budget (--budget-mb), a KL target (--kl-target), or both")
    source = Path(resolve_source(request.model).path)
    from exporter.graph.language_model import image_text_type

    if image_text_type(source):
        raise ExportError("quant-plan scores a text decoder's logits on text, and this image-text checkpoint exports as "
                          "vision, embedding and a decoder on inputs_embeds: choose int8_layers by hand for it, or "
                          "plan on a text checkpoint of its language model")
    cfg = load_model_config(source, ARCHITECTURES)
    base = request.quant or QuantSpec()
    # Measured on the quality text past the tokens the quality gate scores (MAX_TOKENS), so that the
    # gate, and any benchmark scoring the export the way it does, judges the plan on text it was not
    # chosen on.
    tokens, how, prefix = text_tokens(source, cfg.vocab_size, limit=10**7)
    held_out = tokens[MAX_TOKENS:]
    if len(held_out) < 2 * WINDOW:
        raise ExportError(f"the quality text leaves {len(held_out)} tokens past the {MAX_TOKENS} the gate scores "
                          f"for this tokenizer: quant-plan needs at least {2 * WINDOW}")
    chunks = windows(held_out, min(WINDOW, request.max_seq_len or WINDOW), prefix)
    model = load_reference(source)
    reference = reference_logits(model, chunks)
    del model
    work.mkdir(parents=True, exist_ok=True)

    def with_layers(layers) -> ExportRequest:
        return dataclasses.replace(request, quant=dataclasses.replace(base, int8_layers=tuple(sorted(layers))))

    def measure(layers) -> Measured:
        out = work / "candidate"
        shutil.rmtree(out, ignore_errors=True)
        export_model(with_layers(layers), out, validate=False)
        lm = Decoder(out, ep=request.ep.value)
        result = score(chunks, reference, export_logits(lm, chunks), how)
        del lm
        size = (out / "model.onnx.data").stat().st_size
        shutil.rmtree(out, ignore_errors=True)
        return Measured(tuple(sorted(layers)), result.kl_mean, result.agreement, result.ppl_export / result.ppl_reference, size)

    start = time.perf_counter()
    every = set(range(cfg.num_layers))
    baseline = measure(())
    log(f"all int4: KL {baseline.kl:.4f}, agreement {baseline.agreement:.4f}, {baseline.bytes / 1e6:.1f} MB")
    sensitivity = {}
    for i in range(cfg.num_layers):
        alone = measure(every - {i})
        sensitivity[i] = alone.kl
        log(f"layer {i} alone int4: KL {alone.kl:.4f}")
    order = sorted(sensitivity, key=lambda i: -sensitivity[i])
    # Sizes: the measured all-int4 file plus the estimate's difference for each prefix of the order.
    estimate = {k: export_bytes(cfg, with_layers(order[:k])) for k in range(cfg.num_layers + 1)}

    def fits(k: int) -> bool:
        return budget_bytes is None or baseline.bytes + estimate[k] - estimate[0] <= budget_bytes

    k = max(k for k in estimate if fits(k))
    tried: list[Measured] = []
    if kl_target is not None:  # the fewest layers that meet the target, measured one by one
        for n in range(0, k + 1):
            got = baseline if n == 0 else measure(order[:n])
            tried.append(got)
            log(f"{n} layers at 8 bits: KL {got.kl:.4f}")
            if got.kl <= kl_target:
                k = n
                break
    final = next((m for m in tried if len(m.int8_layers) == k), None) or measure(order[:k])
    while budget_bytes is not None and final.bytes > budget_bytes and k > 0:  # the estimate was short
        k -= 1
        final = measure(order[:k])
    spec = dataclasses.replace(base, int8_layers=tuple(sorted(order[:k])))
    return {
        "model": str(request.model), "base_quant": base.to_dict(), "ep": request.ep.value,
        "how": "sensitivity of layer i: the quality gate's mean KL (reference || export), over the quality text's "
               "tail past the tokens the gate scores, of an export with layer i alone int4 and every other layer "
               "8-bit; layers given 8 bits most "
               "sensitive first, within the size budget (estimated, the final file measured) and, with a KL "
               "target, no more than meet it",
        "budget_bytes": budget_bytes, "kl_target": kl_target,
        "tokens": sum(len(c) for c in chunks), "tokenizer": how,
        "baseline": baseline.to_dict(),
        "sensitivity_kl": {str(i): round(v, 5) for i, v in sensitivity.items()},
        "order": order,
        "tried": [m.to_dict() for m in tried],
        "chosen": final.to_dict(),
        "target_met": None if kl_target is None else final.kl <= kl_target,
        "quant": spec.to_dict(),
        "seconds": round(time.perf_counter() - start, 1),
    }
