"""The Hugging Face transformers reference on the same weights: prefill logits and greedy decode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass
class ReferenceRun:
    prompt: list[int]
    prefill_logits: np.ndarray  # [vocab] at the last prompt position
    tokens: list[int]  # greedy continuation
    step_logits: list[np.ndarray]  # logits that chose tokens[i]
    gaps: list[float]  # top-1 minus top-2 logit at each step


def top2_gap(logits: np.ndarray) -> float:
    top = np.partition(logits.astype(np.float64), -2)[-2:]
    return float(top[1] - top[0])


def load_reference(checkpoint: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.errors import ExportError

    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as err:
        raise ExportError(
            f"transformers cannot load the reference checkpoint {checkpoint} ({str(err).splitlines()[0][:200]}): "
            "pass --reference with a loadable checkpoint, or --no-validate"
        ) from None
    model.eval()
    return model


def reference_greedy(model, prompt: list[int], steps: int) -> ReferenceRun:
    """Greedy decode with the model's own KV cache; logits kept in fp32 for comparison."""
    import inspect

    import torch

    # transformers renamed past_key_values to cache (5.2x); pass whichever this version takes.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model(input_ids=ids, use_cache=True)
        past = getattr(out, cache_arg, None) or out.past_key_values
        logits = out.logits[0, -1].float().numpy()
        prefill = logits.copy()
        tokens, step_logits, gaps = [], [], []
        for _ in range(steps):
            token = int(np.argmax(logits))
            tokens.append(token)
            step_logits.append(logits)
            gaps.append(top2_gap(logits))
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_arg: past})
            past = getattr(out, cache_arg, None) or out.past_key_values
            logits = out.logits[0, -1].float().numpy()
    return ReferenceRun(list(prompt), prefill, tokens, step_logits, gaps)
