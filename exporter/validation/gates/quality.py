"""The quality gate of weight-only quantized exports: scored against the unquantized reference.

Exact parity cannot hold for int4 / int8 weights, so a quantized export is held to what a user
of it feels: on real English text (``data/quality_text.txt``, public domain), teacher-forced, at
every position, how often its next-token choice agrees with the unquantized model's, the mean KL
divergence of its next-token distribution from the reference's, and the change in perplexity.
The reference is transformers on the checkpoint's own weights in fp32. Thresholds per dtype are
defaults here and overridable (farm setting QUALITY_THRESHOLDS).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from exporter.validation.gates import GateResult

TEXT_PATH = Path(__file__).resolve().parent.parent / "data" / "quality_text.txt"
# Teacher-forced windows: positions scored per window, and at most this many tokens in all.
WINDOW, MAX_TOKENS = 128, 512

# agreement: top-1 equal to the reference's at positions where the reference is decisive (its
# top-1/top-2 gap >= DECISIVE_GAP logits); kl: mean KL(reference || export) in nats per token;
# ppl_delta: relative perplexity increase over the reference.
# Measured on SmolLM2-135M (benchmarks/results/quant_quality.json): int8 agreement 1.000, KL 0.005,
# perplexity +0.2%; round-to-nearest int4 agreement 0.64, KL 1.15, perplexity +94%. The int8 limits
# leave about 10x margin; the int4 ones admit what is usually called a usable 4-bit model.
DEFAULT_THRESHOLDS = {
    "int8": {"agreement_min": 0.97, "kl_max": 0.05, "ppl_delta_max": 0.03},
    "int4": {"agreement_min": 0.85, "kl_max": 0.25, "ppl_delta_max": 0.15},
}
DECISIVE_GAP = 1.0


@dataclasses.dataclass
class QualityResult:
    tokens: int
    positions: int
    decisive_positions: int
    agreement: float  # at decisive positions
    agreement_all: float  # at every position
    kl_mean: float
    kl_p99: float
    ppl_reference: float
    ppl_export: float
    tokenizer: str  # "checkpoint" or "bytes" (no tokenizer: byte values mapped into the vocab)

    @property
    def ppl_delta(self) -> float:
        return self.ppl_export / self.ppl_reference - 1.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ppl_delta": self.ppl_delta}


# A reference whose perplexity on the text is at least this fraction of the vocabulary size predicts
# it about as well as a guess among that many tokens: a trained model is orders of magnitude below
# (SmolLM2-135M: about 10 on this text; a real gemma3_text fed the text without its BOS: 599,000 of
# a 262,144 vocabulary). Then the measurement is broken (the text, its tokens, the reference), and
# the figures say nothing about the export.
IMPLAUSIBLE_PPL_FRACTION = 0.5


def text_tokens(checkpoint: Path, vocab_size: int, limit: int = MAX_TOKENS,
                answers: Path | None = None) -> tuple[list[int], str, list[int]]:
    """The quality text as token ids, the tokenization, and the ids every window starts with.

    With the checkpoint's tokenizer: the text's ids, and the special tokens that tokenizer puts
    before a text it encodes for the model (BOS for most models): each window starts with them,
    as every sequence the model sees does. Without one: bytes mapped into the vocabulary, no prefix.
    ``answers``: where the tokenizer's answers are kept (``text.load_tokenizer``)."""
    from exporter.validation import text as real_text

    text = TEXT_PATH.read_text()
    tokenizer = real_text.load_tokenizer(Path(checkpoint), answers)
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        prefix, _ = real_text.special_affixes(tokenizer)
        if ids and max(ids + prefix) < vocab_size:
            return [int(t) for t in ids[:limit]], "checkpoint", prefix
    span = max(1, vocab_size - 3)
    return [3 + (b % span) for b in text.encode()[:limit]], "bytes", []


def windows(tokens: list[int], window: int, prefix: list[int] | None = None) -> list[list[int]]:
    """The text in windows of ``window`` ids, each ``prefix`` (the tokenizer's leading special
    tokens) followed by the next stretch of the text."""
    prefix = list(prefix or [])
    body = max(1, window - len(prefix))
    return [prefix + tokens[i : i + body] for i in range(0, len(tokens) - 1, body) if len(tokens[i : i + body]) > 1]


def reference_logits(model, chunks: list[list[int]]) -> list[np.ndarray]:
    """The reference's logits over each window; windows of one length go through as one batch (a
    streamed reference reads every weight once a pass)."""
    import torch

    by_length: dict[int, list[int]] = {}
    for i, chunk in enumerate(chunks):
        by_length.setdefault(len(chunk), []).append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(chunks)
    with torch.no_grad():
        for indices in by_length.values():
            ids = torch.tensor([chunks[i] for i in indices], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits.float().cpu().numpy()
            for row, i in enumerate(indices):
                out[i] = logits[row]
    return out


def export_logits(lm, chunks: list[list[int]]) -> list[np.ndarray]:
    """Each window as one prefill through the export's own contract (fresh state per window)."""
    return [lm.forward(np.array([c], dtype=np.int64), lm.new_state())[0].astype(np.float32) for c in chunks]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _compared(r: np.ndarray, g: np.ndarray, lr: np.ndarray, lg: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per position (rows of reference logits ``r`` and the export's ``g``, their log-softmaxes ``lr`` / ``lg``):
    KL(reference || export), whether the top-1s agree, whether the reference is decisive there."""
    part = np.partition(r.astype(np.float64), -2, axis=-1)
    return ((np.exp(lr) * (lr - lg)).sum(axis=-1), r.argmax(-1) == g.argmax(-1),
            part[:, -1] - part[:, -2] >= DECISIVE_GAP)


def score(chunks: list[list[int]], ref: list[np.ndarray], got: list[np.ndarray], tokenizer: str) -> QualityResult:
    kls, agree, decisive_agree, decisive, nll_ref, nll_got = [], 0, 0, 0, [], []
    positions = 0
    for ids, r, g in zip(chunks, ref, got):
        lr, lg = _log_softmax(r[:-1]), _log_softmax(g[:-1])
        targets = np.asarray(ids[1:])
        kl, same, sure = _compared(r[:-1], g[:-1], lr, lg)
        kls.append(kl)
        nll_ref.append(-lr[np.arange(len(targets)), targets])
        nll_got.append(-lg[np.arange(len(targets)), targets])
        agree += int(same.sum())
        decisive += int(sure.sum())
        decisive_agree += int((same & sure).sum())
        positions += len(targets)
    kl = np.concatenate(kls)
    return QualityResult(
        tokens=sum(len(c) for c in chunks), positions=positions, decisive_positions=decisive,
        agreement=decisive_agree / decisive if decisive else float("nan"), agreement_all=agree / positions,
        kl_mean=float(kl.mean()), kl_p99=float(np.quantile(kl, 0.99)),
        ppl_reference=float(np.exp(np.concatenate(nll_ref).mean())),
        ppl_export=float(np.exp(np.concatenate(nll_got).mean())), tokenizer=tokenizer,
    )


def step_figures(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    """The quality gate's agreement and KL over a handful of decode steps (the logits that chose each
    step's token, reference and export, teacher-forced on the same tokens): an image prompt's figures
    beside the text's. Too few positions to judge (24 where the gate scores 500): reported only."""
    steps = min(len(ref), len(got))  # an export that stopped early is scored on the steps it took
    r, g = np.stack(ref[:steps]).astype(np.float64), np.stack(got[:steps]).astype(np.float64)
    kl, same, sure = _compared(r, g, _log_softmax(r), _log_softmax(g))
    return {"positions": len(r), "decisive_positions": int(sure.sum()),
            "agreement": float((same & sure).sum() / sure.sum()) if sure.any() else float("nan"),
            "agreement_all": float(same.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def plausibility_gate(result: QualityResult, vocab_size: int) -> GateResult:
    """The measurement checks itself: the unquantized reference must predict the text far better
    than chance, or its figures are no verdict on the export."""
    limit = IMPLAUSIBLE_PPL_FRACTION * vocab_size
    if result.tokenizer != "checkpoint":
        return GateResult("quality", "the reference predicts the text (measurement check)", True,
                          round(result.ppl_reference, 4), f"< {limit:g}",
                          "no tokenizer: the text is bytes mapped into the vocabulary, which no model predicts; "
                          "the figures compare the export with the reference on arbitrary ids", informational=True)
    ok = math.isfinite(result.ppl_reference) and result.ppl_reference < limit
    return GateResult(
        "quality", "the reference predicts the text (measurement check)", ok, round(result.ppl_reference, 4),
        f"< {limit:g}",
        "" if ok else
        f"measurement error, not a verdict on the export: the unquantized reference's perplexity on the quality "
        f"text is {result.ppl_reference:.4g}, no better than chance over {vocab_size} tokens; the text, its "
        "tokenization (the model's special tokens) or the reference checkpoint is broken",
        details={"fraction_of_vocabulary": IMPLAUSIBLE_PPL_FRACTION, "vocab_size": vocab_size})


def quality_gates(result: QualityResult, dtype: str, thresholds: dict | None = None,
                  vocab_size: int | None = None) -> list[GateResult]:
    """The quality verdict; with ``vocab_size``, first the measurement's own check, and where that
    fails, the figures are reported as informational (they measure nothing about the export)."""
    limits = {**DEFAULT_THRESHOLDS[dtype], **((thresholds or {}).get(dtype, {}))}
    where = f"{result.positions} positions of public-domain English ({result.tokenizer} tokens)"
    check = plausibility_gate(result, vocab_size) if vocab_size else None
    gates = [check] if check else []
    verdict = _verdicts(result, limits, where)
    if check is not None and check.status == "fail":
        for gate in verdict:
            gate.informational = True
    return gates + verdict


def _verdicts(result: QualityResult, limits: dict, where: str) -> list[GateResult]:
    gates = []
    if result.decisive_positions:
        ok = result.agreement >= limits["agreement_min"]
        gates.append(GateResult(
            "quality", f"next-token agreement with the unquantized reference, teacher-forced ({where})", ok,
            round(result.agreement, 4), limits["agreement_min"],
            "" if ok else f"top-1 agrees at {result.agreement:.1%} of {result.decisive_positions} decisive positions",
            details={"decisive_gap": DECISIVE_GAP, "decisive_positions": result.decisive_positions,
                     "agreement_all_positions": round(result.agreement_all, 4)}))
    else:
        gates.append(GateResult(
            "quality", "next-token agreement with the unquantized reference", True, None, limits["agreement_min"],
            f"no position where the reference is decisive (gap >= {DECISIVE_GAP}): agreement cannot be judged",
            informational=True))
    ok = result.kl_mean <= limits["kl_max"]
    gates.append(GateResult(
        "quality", "mean KL(reference || export) per token (nats)", ok, round(result.kl_mean, 6), limits["kl_max"],
        "" if ok else f"mean KL {result.kl_mean:.4g} nats (p99 {result.kl_p99:.4g})",
        details={"kl_p99": result.kl_p99}))
    ok = result.ppl_delta <= limits["ppl_delta_max"]
    gates.append(GateResult(
        "quality", "perplexity increase over the reference", ok, round(result.ppl_delta, 5), limits["ppl_delta_max"],
        "" if ok else f"perplexity {result.ppl_export:.4g} against {result.ppl_reference:.4g}",
        details={"ppl_reference": result.ppl_reference, "ppl_export": result.ppl_export}))
    return gates
