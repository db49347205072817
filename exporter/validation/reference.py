"""The Hugging Face transformers reference on the same weights: prefill logits and greedy decode."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import numpy as np

from exporter.cache import read_npz, write_atomic, write_npz


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
    """transformers' model of ``checkpoint`` in ``dtype``.

    Where every floating tensor is stored in one dtype that widens to ``dtype`` exactly (bf16 or
    fp16 -> fp32), the model is loaded in that stored dtype (tensors mapped from the file) and cast
    by torch in one pass: about half the time of transformers' own loader, which converts tensor by
    tensor on a thread pool (0.5B, 2 cores: 4.4 -> 1.8 s), with the same weights. Buffers the model
    computes at construction are computed under the stored dtype then; the one a supported model
    computes that way (Gemma's embedding scale) is set again from its exact value, and a model with
    any other is loaded straight into ``dtype`` instead (tests/test_reference.py holds every
    supported architecture to a direct load, bit for bit)."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.errors import ExportError

    target = getattr(torch, dtype)
    stored = _stored_dtype(Path(checkpoint))
    fast = stored is not None and stored != target and torch.finfo(stored).bits < torch.finfo(target).bits
    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=stored if fast else target)
        if fast and not _cast_with_buffers(model, target):
            del model
            model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=target)
    except (OSError, ValueError) as err:
        raise ExportError(
            f"transformers cannot load the reference checkpoint {checkpoint} ({str(err).splitlines()[0][:200]}): "
            "pass --reference with a loadable checkpoint, or --no-validate"
        ) from None
    model.eval()
    return model


def open_reference(checkpoint: Path, ep: str = "cpu"):
    """The reference validation runs: transformers' model of ``checkpoint`` in fp32, its weights
    streamed one decoder layer at a time (``streamed.StreamedReference``), on the device the export
    is validated on where this torch reaches it (the GPU this process is bound to), else the CPU. A
    model whose layers the streamed reference cannot walk (a traced export's GPT-2, ``transformer.h``)
    is loaded whole (``WholeReference``): the traced fallback held it whole to trace it anyway."""
    from exporter.runtime.device import cuda_device
    from exporter.validation.streamed import NotStreamable, StreamedReference, reference_device

    device = reference_device(ep, cuda_device())
    try:
        return StreamedReference(Path(checkpoint), device)
    except NotStreamable:
        return WholeReference(Path(checkpoint), device)


class WholeReference:
    """transformers' whole fp32 model, called as ``StreamedReference`` is (logits back on the CPU in fp32,
    ``passes`` counted, ``close``). ``model``: one already loaded (an image-text checkpoint's image-text model,
    validation/image_text.py), in place of the causal LM ``load_reference`` loads."""

    def __init__(self, checkpoint: Path, device: str = "cpu", model=None):
        self.model = (load_reference(checkpoint) if model is None else model).to(device)
        self.config, self.device, self.passes = self.model.config, device, 0

    @property
    def forward(self):
        return self.model.forward

    def __call__(self, input_ids=None, **kwargs):
        import torch

        self.passes += 1
        with torch.no_grad():
            out = self.model(input_ids=input_ids.to(self.device), **kwargs)
        out.logits = out.logits.float().cpu()
        return out

    def close(self) -> None:
        self.model = None
        if str(self.device).startswith("cuda"):  # as StreamedReference: the device's next job gets the memory back
            import torch

            torch.cuda.empty_cache()


def _stored_dtype(checkpoint: Path):
    """The one torch dtype every floating tensor of the checkpoint's safetensors is stored in, or None."""
    import onnx_ir as ir
    import torch

    from exporter.errors import ExportError
    from exporter.packaging.checkpoint import Checkpoint

    try:
        source = Checkpoint(checkpoint)
    except ExportError:
        return None  # not safetensors: transformers loads it its own way
    floating = {ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.FLOAT16: torch.float16,
                ir.DataType.FLOAT: torch.float32, ir.DataType.DOUBLE: torch.float64}
    kinds = source.floating_dtypes()
    return floating[kinds.pop()] if len(kinds) == 1 else None


def _cast_with_buffers(model, target) -> bool:
    """Cast ``model`` to ``target``, setting again the construction-time buffers that were made in
    the load dtype; False (model untouched) if one of them cannot be set from an exact value."""
    import torch

    redo = []
    for module in model.modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            buffer = getattr(module, name, None)
            if buffer is None or not torch.is_floating_point(buffer) or buffer.dtype == target:
                continue  # e.g. rotary inv_freq: computed in float32 explicitly
            if name == "embed_scale" and hasattr(module, "scalar_embed_scale"):
                redo.append(module)
            else:
                return False
    model.to(target)
    for module in redo:
        module.embed_scale.fill_(module.scalar_embed_scale)
    return True


def _cache_key(revision: str, what: str, prompt: list[int], steps: int) -> str:
    """The cache file's key: the checkpoint, the run, and the versions that compute it. The versions
    come from package metadata, so a cache hit imports neither torch nor transformers (seconds)."""
    from exporter.cache import cache_key
    from exporter.versions import package_version

    return cache_key({"revision": revision, "what": what, "prompt": prompt, "steps": steps,
                      "transformers": package_version("transformers"), "torch": package_version("torch")})


class SharedReferences(Protocol):
    """Reference runs kept beyond one machine (the farm's object store), by file name."""

    def fetch(self, name: str) -> bytes | None: ...

    def publish(self, name: str, data: bytes) -> None: ...


def cached_reference(cache_dir: Path | None, revision: str, prompt: list[int], steps: int,
                     shared: SharedReferences | None = None) -> tuple[Path | None, ReferenceRun | None]:
    """Where the reference run of the checkpoint ``revision`` (a hub sha or a local content
    fingerprint) for this prompt and step count is kept, and the run if it is there: every variant
    and dtype exported from one checkpoint shares it. A run not in ``cache_dir`` is looked for in
    ``shared`` (another worker may have computed it) and kept in ``cache_dir`` when found there."""
    if cache_dir is None:
        return None, None
    path = Path(cache_dir) / f"greedy-{_cache_key(revision, 'greedy', prompt, steps)}.npz"
    return path, _lookup(path, lambda data: _read_run(data, prompt, steps), shared)


def _lookup(path: Path, parse, shared: SharedReferences | None):
    """``parse`` of the cache file at ``path``, else of its copy in ``shared`` (kept at ``path``
    once found there); None where neither holds what ``parse`` accepts."""
    found = parse(read_npz(path))
    if found is None and shared is not None:
        data = shared.fetch(path.name)
        found = parse(read_npz(data)) if data is not None else None
        if found is not None:
            write_atomic(path, data)
    return found


def _keep(path: Path | None, shared: SharedReferences | None, **arrays: np.ndarray) -> None:
    """Write ``arrays`` at ``path`` and publish the file to ``shared``."""
    if path is None:
        return
    write_npz(path, **arrays)
    if shared is not None:
        shared.publish(path.name, path.read_bytes())


def _read_run(data: dict[str, np.ndarray] | None, prompt: list[int], steps: int) -> ReferenceRun | None:
    """The run in a cache file's arrays, if they hold this prompt's run of ``steps`` steps."""
    if data is None or not {"prompt", "prefill_logits", "tokens", "step_logits", "gaps"} <= set(data):
        return None  # absent, torn or foreign: computed again and replaced
    run = ReferenceRun([int(t) for t in data["prompt"]], data["prefill_logits"], [int(t) for t in data["tokens"]],
                       list(data["step_logits"]), [float(g) for g in data["gaps"]])
    return run if run.prompt == list(prompt) and len(run.tokens) == steps else None


def store_reference(path: Path | None, run: ReferenceRun, shared: SharedReferences | None = None) -> None:
    """Keep ``run`` at ``path`` (from ``cached_reference``) and publish it to ``shared``."""
    vocab = run.prefill_logits.shape[-1]
    _keep(path, shared, prompt=np.array(run.prompt, np.int64), prefill_logits=run.prefill_logits,
          tokens=np.array(run.tokens, np.int64),
          step_logits=np.stack(run.step_logits) if run.step_logits else np.zeros((0, vocab), np.float32),
          gaps=np.array(run.gaps, np.float64))


def cached_window_logits(cache_dir: Path | None, revision: str, chunks: list[list[int]],
                         shared: SharedReferences | None = None) -> tuple[Path | None, list[np.ndarray] | None]:
    """The quality gate's reference: the logits of the checkpoint ``revision`` over each window of
    ``chunks`` (token ids), where they are kept, and the logits if they are there (locally, or in
    ``shared``): every quantized dtype and variant of one checkpoint shares them. An image-text checkpoint's
    are its image-text model's on the text alone or its language model's as a causal LM (the streamed
    reference of a language-model-alone export): one model on text ids, not two (Qwen3.5's M-RoPE is plain
    rotary on text, Gemma 3's mask causal without images; the two classes give the same logits, within 1e-6 of the
    range, tests/test_image_text_quality.py), so they share one key, and an activation measurement through either
    is the quality reference of both exports."""
    if cache_dir is None:
        return None, None
    path = Path(cache_dir) / f"windows-{_cache_key(revision, 'windows', chunks, len(chunks))}.npz"
    return path, _lookup(path, lambda data: _read_windows(data, chunks), shared)


def _read_windows(data: dict[str, np.ndarray] | None, chunks: list[list[int]]) -> list[np.ndarray] | None:
    if data is None or len(data) != 2 * len(chunks):
        return None
    for i, chunk in enumerate(chunks):
        ids, logits = data.get(f"ids_{i}"), data.get(f"logits_{i}")
        if ids is None or logits is None or ids.tolist() != list(chunk) or logits.shape[0] != len(chunk):
            return None
    return [data[f"logits_{i}"] for i in range(len(chunks))]


def store_window_logits(path: Path | None, chunks: list[list[int]], logits: list[np.ndarray],
                        shared: SharedReferences | None = None) -> None:
    """Keep the quality reference at ``path`` (from ``cached_window_logits``), and in ``shared``."""
    arrays = {}
    for i, (chunk, rows) in enumerate(zip(chunks, logits)):
        arrays[f"ids_{i}"], arrays[f"logits_{i}"] = np.array(chunk, np.int64), np.asarray(rows, np.float32)
    _keep(path, shared, **arrays)


def reference_greedy(model, prompt: list[int], steps: int, draft: list[int] | None = None,
                     redraft=None) -> ReferenceRun:
    """Greedy decode of ``steps`` tokens after ``prompt``; logits kept in fp32 for comparison.

    Every forward pass runs over the whole sequence so far (prompt, the tokens chosen, and the
    tokens still to check), without a KV cache: a pass reads every weight once, which for a
    streamed reference (``streamed.StreamedReference``) is the cost of the pass, while the few
    dozen positions cost next to nothing. A ``draft`` (the export's own greedy tokens) is checked
    in one pass, as speculative decoding verifies one. The tokens are still the reference's own
    argmax: where it departs from the draft, the positions after that saw a history it did not
    choose, so the next pass starts there, checking ``redraft(tokens)`` (the export's greedy
    continuation of the reference's tokens so far) if given, else one token at a time. A redraft
    whose first token already misses says the export does not follow the reference (a broken
    export): from there it goes one token at a time, without asking for more drafts.

    A model whose rotary frequencies depend on how many positions one call sees (longrope: short
    factors up to ``original_max_position_embeddings``, long past it) computes a position
    differently in one pass over the whole sequence than a runtime that prefilled the prompt and
    then decoded token by token through its cache. Where the sequence crosses that switch, the
    run is made as that runtime makes it: the prompt, then one token per pass through the cache.
    """
    switch = _rope_switch(getattr(model, "config", None))
    if switch is not None and len(prompt) <= switch < len(prompt) + steps:
        return _cached_greedy(model, prompt, steps)
    import torch

    tokens: list[int] = []
    step_logits: list[np.ndarray] = []
    prefill = None
    check, drafted = list(draft or []), False
    with torch.no_grad():
        while len(tokens) < steps:
            start = len(tokens)
            ahead = check[: steps - start - 1]
            out = model(input_ids=torch.tensor([list(prompt) + tokens + ahead], dtype=torch.long), use_cache=False)
            rows = out.logits[0, len(prompt) - 1 + start:].float().cpu().numpy()
            if prefill is None:
                prefill = rows[0].copy()
            agreed = False
            for j, row in enumerate(rows):
                tokens.append(int(np.argmax(row)))
                step_logits.append(row.copy())
                agreed = j < len(check) and tokens[-1] == check[j]
                if len(tokens) == steps or not agreed:
                    break
            if len(tokens) < steps and agreed:
                check = check[j + 1:]
            elif len(tokens) < steps:
                if drafted and j == 0:
                    redraft = None  # a fresh draft that misses at once: the export does not follow, stop asking
                check, drafted = (list(redraft(list(tokens))), True) if redraft else ([], False)
    return ReferenceRun(list(prompt), prefill, tokens, step_logits, [top2_gap(g) for g in step_logits])


def _rope_switch(config) -> int | None:
    """Where a longrope model switches from its short to its long factors (None: no such switch)."""
    if config is None:
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    return params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)


def _cached_greedy(model, prompt: list[int], steps: int) -> ReferenceRun:
    """The prompt in one pass, then one token per pass through transformers' KV cache."""
    tokens, step_logits = cached_steps(model, prompt, steps)
    return ReferenceRun(list(prompt), step_logits[0].copy(), tokens, step_logits, [top2_gap(g) for g in step_logits])


def cached_steps(model, prompt: list[int], steps: int, feed: list[int] | None = None):
    """(tokens, the logits that chose each): the prompt in one pass, then one token per pass through
    transformers' KV cache, each token ``feed[i]`` (teacher forcing) or, without ``feed``, the argmax."""
    import inspect

    import torch

    # transformers renamed past_key_values to cache (5.2x); pass whichever this version takes.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens: list[int] = []
    step_logits: list[np.ndarray] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt)], dtype=torch.long), use_cache=True)
        while True:
            step_logits.append(out.logits[0, -1].float().cpu().numpy())
            tokens.append(int(feed[len(tokens)]) if feed is not None else int(np.argmax(step_logits[-1])))
            if len(tokens) == steps:
                return tokens, step_logits
            past = getattr(out, cache_arg, None) or out.past_key_values
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_arg: past})
