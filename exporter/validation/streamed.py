"""transformers' own model of a checkpoint, run with one decoder layer's weights in memory at a time.

The whole-model reference needs the model in fp32 (4 bytes a parameter: 32 GB for an 8B, 282 GB
for a 70B), which no worker holds beside the export it checks. ``StreamedReference`` builds
transformers' model class with its parameters on the meta device (its buffers, computed at
construction, stay real: rotary frequencies, Gemma's embedding scale) and runs transformers' own
``forward``: each decoder layer's weights are read from the memory-mapped safetensors, widened to
fp32 on the reference's device just before the layer runs and dropped right after it; the embedding
gathers only the rows of the tokens it is given; the LM head computes the logits a block of
vocabulary rows at a time. Everything between the layers (masks, rotary, norms, soft-capping,
scaling) is transformers' code as it is, so the numbers are the whole-model reference's
(tests/test_streamed_reference.py holds every architecture to it).

One forward pass reads every weight once, so callers give it the whole teacher-forced sequence at
once (``reference.reference_greedy`` with a draft, the quality gate's windows in one batch) rather
than one token per pass.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import warnings
from pathlib import Path

import numpy as np

from exporter import checkpoints
from exporter.errors import ExportError
from exporter.graph.config import TEXT_FAMILY_OF

# Where an image-text checkpoint keeps its language model (gemma4's, transformers' model.language_model).
LANGUAGE_MODEL_PREFIX = "model.language_model."

class NotStreamable(ExportError):
    """transformers' model of the checkpoint keeps its decoder layers elsewhere than ``get_decoder().layers``
    (GPT-2's ``transformer.h``), or builds a weight from the checkpoint's by a conversion this reference does
    not read: the streamed reference cannot run it (``reference.open_reference`` then loads the whole model)."""


# The LM head's weight is read in blocks of vocabulary rows of about this many fp32 bytes.
VOCAB_BLOCK_BYTES = 256 * 1024 * 1024


def reference_device(ep: str, device_index: int | None = None) -> str:
    """Where the reference computes: the worker's GPU when the export runs on CUDA and this torch
    can reach one (``cuda:<device_index>``), else the host's CPU (the GPU worker image carries a CPU
    build of torch: there the reference runs on the host's cores, streamed all the same)."""
    if ep != "cuda":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = device_index or 0
    if index >= torch.cuda.device_count():
        raise ExportError(f"the worker is bound to GPU {index}, but torch sees {torch.cuda.device_count()} GPU(s): "
                          "set GPU_DEVICE to an index below that")
    return f"cuda:{index}"


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory), their buffers
    where they are computed: transformers' rotary tables and scales are made at construction and
    are not in the checkpoint. (accelerate's ``init_empty_weights(include_buffers=False)`` does the
    same; accelerate is not a dependency of the exporter.)"""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class StreamedReference:
    """A callable like transformers' model (``model(input_ids=..., use_cache=..., cache=...)``) whose
    weights stream from ``checkpoint``; logits come back on the CPU in fp32."""

    def __init__(self, checkpoint: Path, device: str = "cpu", prefetch: bool | None = None,
                 vocab_block_bytes: int = VOCAB_BLOCK_BYTES, dtype: str = "float32"):
        """``dtype`` is what the weights are widened (or narrowed) to and what transformers computes
        in: float32 for the reference, float16 / bfloat16 for the half-precision yardstick
        (``yardstick.py``: transformers itself in an export's dtype)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from exporter.packaging.checkpoint import Checkpoint

        self.checkpoint = Path(checkpoint)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        # (checkpoint name, array, read for the embedding) -> the array to use: what a quantized
        # export stores instead (validation/quant_advice.py); None reads the checkpoint as it is.
        self.transform = None
        if self.device.type == "cuda":
            # The reference is fp32: TF32 matmuls would round their inputs to 10 mantissa bits.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.vocab_block_bytes = vocab_block_bytes
        self.source = Checkpoint(self.checkpoint)
        self.language_model_prefix = None
        try:
            config = AutoConfig.from_pretrained(str(self.checkpoint))
            if config.model_type in TEXT_FAMILY_OF:
                # An image-text checkpoint whose language model is exported alone (gemma4): the reference is that
                # language model as its own causal LM (its image-text forward reads the embedding table outside
                # the embedding's forward), its weights read under the checkpoint's model.language_model.
                config = config.get_text_config()
                self.language_model_prefix = LANGUAGE_MODEL_PREFIX
            with _parameters_on_meta():
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        except (OSError, ValueError) as err:
            raise ExportError(
                f"transformers cannot build the reference model of {self.checkpoint} "
                f"({str(err).splitlines()[0][:200]}): pass --reference with a loadable checkpoint, or --no-validate"
            ) from None
        model.eval()
        self.model, self.config = model, config
        decoder = model.get_decoder()
        if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
            raise NotStreamable(f"{type(model).__name__} keeps no decoder layer list at get_decoder().layers")
        self.layers = list(decoder.layers)
        self.embedding = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self._merged = self._converted_names()
        self._names = self._checkpoint_names()
        # Every parameter outside the layers, the embedding and the LM head (final norm, ...) is small
        # and used by every pass: materialized once.
        streamed = {id(p) for m in (*self.layers, self.embedding, self.lm_head) for p in m.parameters()}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) not in streamed:
                    setattr(module, name, self._parameter(self._names[id(param)]))
        for prefix, buffer_owner in model.named_modules():
            for name, buffer in list(buffer_owner._buffers.items()):
                full = f"{prefix}.{name}" if prefix else name
                if self.language_model_prefix and full.startswith("model.") and full not in self.source:
                    full = self.language_model_prefix + full[len("model."):]
                stored = full in self.source or self._merged.get(full, ("",))[0] == "renamed"
                if buffer is not None and name not in buffer_owner._non_persistent_buffers_set and stored:
                    # A persistent buffer the checkpoint stores (lfm2_moe's expert_bias, nemotron_h's
                    # e_score_correction_bias under backbone.*): its value, not the construction's (zeros).
                    # Small: read once, kept in its own dtype (fp32 routing biases).
                    buffer_owner._buffers[name] = self._tensor(full).to(buffer.dtype)
                elif buffer is not None and buffer.device != self.device:
                    buffer_owner._buffers[name] = buffer.to(self.device)
        # On a GPU the next layer's weights are read and copied while this one computes; on the
        # host's cores that would take the cores and the memory of a second layer for little gain.
        self.prefetch = self.device.type != "cpu" if prefetch is None else prefetch
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-weights")
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._meta = {i: {n: p for n, p in layer.named_parameters()} for i, layer in enumerate(self.layers)}
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda module, args, i=i: self._enter_layer(i))
            layer.register_forward_hook(lambda module, args, out, i=i: self._leave_layer(i, out))
        self.embedding.register_forward_pre_hook(self._embed_rows, with_kwargs=True)
        self.embedding.register_forward_hook(self._embed_done)
        self._embedding_meta = self.embedding.weight
        self.lm_head.forward = self._lm_head_forward
        self.passes = 0
        # Set to a list, each layer's output appends (layer, largest magnitude, every value finite).
        self.watch: list[tuple[int, float, bool]] | None = None

    def materialized_layers(self) -> list[int]:
        """Indices of the decoder layers whose weights are in memory now (at most one, between passes none)."""
        return [i for i, layer in enumerate(self.layers) if any(p.device.type != "meta" for p in layer.parameters())]

    # --- what transformers' callers use ----------------------------------------------------------

    @property
    def forward(self):
        return self.model.forward

    def __call__(self, input_ids=None, **kwargs):
        import torch

        self.passes += 1
        try:
            with torch.no_grad():
                out = self.model(input_ids=input_ids.to(self.device), **kwargs)
        finally:
            self._drop()  # a pass that failed (out of memory, say) leaves no layer behind either
        out.logits = out.logits.float().cpu()
        return out

    def _drop(self) -> None:
        """Every layer back on the meta device, weights read ahead dropped."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        for i, layer in enumerate(self.layers):
            _assign(layer, self._meta[i])
        self.embedding.weight = self._embedding_meta

    def close(self) -> None:
        """Give back what the reference holds: its threads, and on a GPU torch's cached blocks (a
        worker's process runs the next job's sessions on that device)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._drop()
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    # --- names and tensors -----------------------------------------------------------------------

    def _checkpoint_names(self) -> dict[int, str]:
        """The checkpoint tensor of every parameter (by identity): the first of its names the
        checkpoint has, or transformers' own name for a checkpoint tensor it renames or merges
        (``_converted_names``: mixtral's ``block_sparse_moe`` is its ``mlp``, experts stored one by one
        are its fused ``experts.gate_up_proj``); an LM head tied to the embedding reads the
        embedding's tensor."""
        candidates: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            candidates.setdefault(id(param), []).append(name)
            if self.language_model_prefix and name.startswith("model."):  # model.X stored as model.language_model.X
                candidates[id(param)].append(self.language_model_prefix + name[len("model."):])
        # (under transformers' own name where the checkpoint stores it renamed: an image-text checkpoint's
        # model.language_model.embed_tokens, read as the causal LM's model.embed_tokens)
        embedding = next((n for n in candidates[id(self.embedding.weight)] if n in self.source or n in self._merged), None)
        names, missing = {}, []
        for key, options in candidates.items():
            found = next((n for n in options if n in self.source or n in self._merged), None)
            if found is None and key == id(self.lm_head.weight) and getattr(self.config, "tie_word_embeddings", False):
                found = embedding
            if found is None:
                missing.append(options[0])
            else:
                names[key] = found
        if missing:
            raise ExportError(f"{self.checkpoint} has no tensors for {', '.join(sorted(missing)[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}: the reference reads transformers' own names")
        return names

    def _converted_names(self) -> dict[str, tuple]:
        """transformers' parameter names that the checkpoint stores under other names, from
        transformers' own conversion mapping for this model (the one ``from_pretrained`` applies):
        name -> ("renamed", checkpoint name), ("mxfp4", blocks, scales) (decoded by transformers'
        ``convert_moe_packed_tensors``) or ("merged", [[names] per source pattern], concat dim),
        each pattern's names in expert order, stacked along a new first dimension (MergeModulelist)
        and the patterns concatenated (Concatenate). A mapping with other operations is refused."""
        import re

        from transformers import conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, rename_source_key

        transforms = conversion_mapping.get_model_conversion_mapping(self.model) or []
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        found: dict[str, tuple] = {}
        collected: dict[str, dict[str, list[str]]] = {}
        names = set(self.source.names())
        for name in names:  # MXFP4 experts (gpt-oss): transformers' own decoder makes the bf16 parameter
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names:
                found[name.removesuffix("_blocks")] = ("mxfp4", name, name.removesuffix("_blocks") + "_scales")
        for name in self.source.names():
            target, pattern = rename_source_key(name, renamings, converters)
            if pattern is None:
                if target != name:
                    found[target] = ("renamed", name)
                continue
            collected.setdefault(target, {}).setdefault(pattern, []).append(name)

        def expert_order(name: str):
            return [int(n) for n in re.findall(r"\.(\d+)\.", name)]

        for target, by_pattern in collected.items():
            converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
            ops = list(converter.operations)
            if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or any(
                    not isinstance(op, Concatenate) for op in ops[1:]) or len(ops) > 2:
                # transformers' own loader applies the conversion: the whole model can still be the reference
                raise NotStreamable(f"the reference cannot build {target} from the checkpoint: transformers converts it "
                                    f"with {[type(op).__name__ for op in ops]}, which the streamed reference does not read")
            groups = [sorted(by_pattern[p], key=expert_order) for p in converter.source_patterns if p in by_pattern]
            if len(groups) != len(converter.source_patterns):
                raise ExportError(f"the checkpoint lacks some of the tensors transformers merges into {target}")
            found[target] = ("merged", groups, ops[1].dim if len(ops) > 1 else None)
        return found

    def _tensor(self, name: str, rows=None, embedding: bool = False):
        """A checkpoint tensor (or rows of it) in the reference's dtype on its device, or one that
        transformers merges from several (``_converted_names``); ``embedding``: read for the
        embedding's gather (``transform`` may treat a tied table's two uses apart)."""
        import torch

        merged = self._merged.get(name)
        if merged is not None and name not in self.source:
            if merged[0] == "renamed":
                return self._tensor(merged[1], rows)
            if merged[0] == "mxfp4":
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                blocks, scales = (torch.from_numpy(np.ascontiguousarray(self.source.array(n))) for n in merged[1:])
                tensor = convert_moe_packed_tensors(blocks, scales, dtype=self.dtype).to(self.device)
                return tensor if rows is None else tensor[rows]
            _, groups, dim = merged
            stacks = [torch.stack([self._tensor(n) for n in group]) for group in groups]
            tensor = stacks[0] if dim is None else torch.cat(stacks, dim=dim)
            return tensor if rows is None else tensor[rows]
        if isinstance(rows, slice):  # a block of rows (a packed linear's decoded alone)
            array = self.source.rows(name, rows.start, rows.stop)
        else:
            array = self.source.array(name)
            array = array if rows is None else array[rows]
        if self.transform is not None:
            array = self.transform(name, array, embedding)
        stored = self.source.stored_dtype(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the memory map is read-only; nothing writes it
            tensor = torch.from_numpy(np.ascontiguousarray(array) if rows is not None else array)
        if stored is not None and stored.name == "BFLOAT16":
            tensor = tensor.view(torch.bfloat16)
        tensor = tensor.to(self.device)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def _parameter(self, name: str, rows=None, embedding: bool = False):
        import torch

        return torch.nn.Parameter(self._tensor(name, rows, embedding), requires_grad=False)

    # --- decoder layers --------------------------------------------------------------------------

    def _load_layer(self, i: int) -> dict:
        return {local: self._parameter(self._names[id(meta)]) for local, meta in self._meta[i].items()}

    def _take_layer(self, i: int) -> dict:
        with self._lock:
            future = self._pending.pop(i, None)
        return future.result() if future is not None else self._load_layer(i)

    def _enter_layer(self, i: int) -> None:
        checkpoints.checkpoint()  # a pass over a big model takes minutes: a cancel stops it between layers
        weights = self._take_layer(i)
        if self.prefetch and i + 1 < len(self.layers):
            with self._lock:
                self._pending[i + 1] = self._pool.submit(self._load_layer, i + 1)
        _assign(self.layers[i], weights)

    def _leave_layer(self, i: int, out=None) -> None:
        _assign(self.layers[i], self._meta[i])
        if self.watch is not None and out is not None:
            import torch

            hidden = (out[0] if isinstance(out, (tuple, list)) else out).detach()
            finite = bool(torch.isfinite(hidden).all())
            peak = float(hidden[torch.isfinite(hidden)].abs().max()) if hidden.numel() and finite else float("inf")
            self.watch.append((i, peak, finite))

    # --- embedding and LM head -------------------------------------------------------------------

    def _embed_rows(self, module, args, kwargs):
        """Only the rows of the tokens asked for, and the ids renumbered into them."""
        import torch

        ids = args[0] if args else kwargs["input"]
        if self.prefetch and self.layers:
            with self._lock:
                if 0 not in self._pending:
                    self._pending[0] = self._pool.submit(self._load_layer, 0)
        rows, inverse = torch.unique(ids, return_inverse=True)
        module.weight = self._parameter(self._names[id(self._embedding_meta)], rows.cpu().numpy(), embedding=True)
        # padding_idx only keeps a row's gradient at zero; renumbered, it would name another row.
        self._padding_idx, module.padding_idx = getattr(module, "padding_idx", None), None
        inverse = inverse.reshape(ids.shape)
        return ((inverse, *args[1:]), kwargs) if args else (args, {**kwargs, "input": inverse})

    def _embed_done(self, module, args, out):
        module.weight, module.padding_idx = self._embedding_meta, self._padding_idx

    def _lm_head_forward(self, hidden):
        import torch

        head = self.lm_head
        name = self._names[id(head.weight)]
        vocab, width = head.weight.shape
        step = max(1, self.vocab_block_bytes // (width * self.dtype.itemsize))
        bias_name = self._names.get(id(head.bias)) if getattr(head, "bias", None) is not None else None
        out = torch.empty((*hidden.shape[:-1], vocab), dtype=self.dtype, device=self.device)
        blocks = [(a, min(vocab, a + step)) for a in range(0, vocab, step)]
        ahead = self._pool.submit(self._tensor, name, slice(*blocks[0])) if self.prefetch else None
        for n, (a, b) in enumerate(blocks):
            weight = ahead.result() if ahead is not None else self._tensor(name, slice(a, b))
            ahead = (self._pool.submit(self._tensor, name, slice(*blocks[n + 1]))
                     if self.prefetch and n + 1 < len(blocks) else None)
            bias = self._tensor(bias_name, slice(a, b)) if bias_name else None
            out[..., a:b] = torch.nn.functional.linear(hidden, weight, bias)
            del weight
        return out


def _assign(module, weights: dict) -> None:
    """Set ``module``'s parameters by their dotted local names."""
    for dotted, param in weights.items():
        owner, _, leaf = dotted.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        target._parameters[leaf] = param
