"""The Hugging Face transformers reference on the same weights: prefill logits and greedy decode."""

from __future__ import annotations

import dataclasses
import os
import zipfile
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


def cache_dir_default() -> Path:
    """Where references are kept between validations (EXPORTFARM_CACHE, default ~/.cache/exportfarm)."""
    from exporter.cache import cache_root

    return cache_root() / "references"


def _cache_key(revision: str, what: str, prompt: list[int], steps: int) -> str:
    """The cache file's key: the checkpoint, the run, and the versions that compute it. The versions
    come from package metadata, so a cache hit imports neither torch nor transformers (seconds)."""
    import hashlib
    import json

    from exporter.versions import package_version

    payload = {"revision": revision, "what": what, "prompt": prompt, "steps": steps,
               "transformers": package_version("transformers"), "torch": package_version("torch")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def cached_reference_greedy(checkpoint: Path, revision: str, prompt: list[int], steps: int,
                            cache_dir: Path | None) -> tuple[ReferenceRun, bool]:
    """The reference run of ``checkpoint`` (identified by ``revision``: a hub sha or a local
    content fingerprint) for this prompt and step count, computed once and then read back: every
    variant and dtype exported from one checkpoint shares it. Returns (run, whether it was cached)."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"greedy-{_cache_key(revision, 'greedy', prompt, steps)}.npz"
        if path.is_file():
            try:
                with np.load(path) as data:
                    run = ReferenceRun([int(t) for t in data["prompt"]], data["prefill_logits"],
                                       [int(t) for t in data["tokens"]], list(data["step_logits"]),
                                       [float(g) for g in data["gaps"]])
                if run.prompt == list(prompt) and len(run.tokens) == steps:
                    return run, True
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                pass  # a torn or foreign file: compute again and replace it
    run = reference_greedy(load_reference(checkpoint), prompt, steps)
    if path is not None:
        import tempfile

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        vocab = run.prefill_logits.shape[-1]
        with os.fdopen(fd, "wb") as f:
            np.savez(f, prompt=np.array(run.prompt, np.int64), prefill_logits=run.prefill_logits,
                     tokens=np.array(run.tokens, np.int64),
                     step_logits=np.stack(run.step_logits) if run.step_logits else np.zeros((0, vocab), np.float32),
                     gaps=np.array(run.gaps, np.float64))
        Path(name).replace(path)  # atomic: concurrent validations never read half a file
    return run, False


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
