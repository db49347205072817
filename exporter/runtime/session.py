"""The one ONNX Runtime driver: an exported decoder run through its variant's own cache contract.

``Decoder`` serves validation, the tests and the benchmark alike, with two ways of binding:

- host arrays (``new_state`` / ``forward`` / ``prefill`` / ``step``): numpy in, numpy out, the cache
  state kept between calls as a serving runtime keeps it; batch > 1 with ragged prompts; bfloat16
  through bound host buffers (ORT's numpy bridge has none); ``in_place`` binds each attn_static
  cache input and its updated output to the same host buffer.
- device buffers (``new_caches`` / ``prefill_bound`` / ``decode_bound``): IO binding on the EP's
  device, static caches updated in place, GroupQueryAttention past and present on one shared
  max-length buffer, the per-step inputs in fixed buffers so a decode step can be captured once
  as a CUDA graph and replayed.

How a batch of ragged prompts is laid out follows what each variant's attention can express:
attn_dynamic is left-padded (its in-graph mask hides the padding; positions count real tokens),
gqa is right-padded (GroupQueryAttention's contract: per-row ``seqlens_k``, new tokens written at
each row's length), attn_static keeps rows ragged with per-row ``write_indices`` /
``nonpad_kv_seqlen``. A maskless static-cache prefill cannot hide padding inside one step, so its
rows are prefilled one by one (in place, on views of the batch's caches) and decoded together.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import onnx

from exporter.request import Variant
from exporter.runtime.device import cuda_provider
from exporter.runtime.isolated import phase
from exporter.contract import (
    ATTENTION_MASK, BY_ORT, DTYPES, GENAI_CONFIG_FILE, INPUT_IDS, INPUTS_EMBEDS, LOGITS, META_CONFIG, META_PREFIX,
    META_VARIANT, MODEL_FILE, POSITION_IDS, WRITE_INDICES, DType, is_state_input, numpy_of_ort,
    cache_kind, static_cache_counts, value_head_dim,
)

PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
STATIC, GQA, DYNAMIC = "static", "gqa", "dynamic"  # cache modes, read off a model's inputs


def read_metadata(model_path: Path) -> dict:
    """What an export says of itself (variant, dtype, ep, config), from model.onnx's metadata."""
    proto = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key[len(META_PREFIX):]: p.value for p in proto.metadata_props if p.key.startswith(META_PREFIX)}
    if META_CONFIG.removeprefix(META_PREFIX) in meta:
        meta["config"] = json.loads(meta["config"])
    return meta


def session_config_entries(prepack: bool = True, spin: bool = True) -> dict[str, str]:
    """onnxruntime's session config entries for ``Decoder``'s ``prepack`` and ``spin`` (see there), as
    another runtime's session of the same export takes them too (onnxruntime-genai: its config's
    ``session_options``)."""
    entries = {}
    if not prepack:
        entries["session.disable_prepacking"] = "1"
    if not spin:
        entries["session.intra_op.allow_spinning"] = "0"
    return entries


def cache_mode(input_names: set[str]) -> str:
    """Which cache contract a model's inputs describe (ours or another builder's)."""
    if WRITE_INDICES in input_names:
        return STATIC
    if POSITION_IDS in input_names and ATTENTION_MASK in input_names:
        return DYNAMIC
    return GQA


def ort_bits(array: np.ndarray) -> np.ndarray:
    """``array`` as ORT's numpy bridge takes it: bfloat16, which the bridge lacks (OrtValue.update_inplace refuses it
    too), as its uint16 bits; any other dtype as it is."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def host_ortvalue(array: np.ndarray):
    """numpy -> CPU OrtValue sharing its memory; bfloat16 (which ORT's numpy bridge lacks) via uint16."""
    import onnxruntime as ort

    if array.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(ort_bits(array), DTYPES["bf16"].onnx)
    return ort.OrtValue.ortvalue_from_numpy(array)


def run_bound(session, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """session.run with every input and output bound to host arrays (which ORT fills in place): the
    way to run bfloat16 graphs, and to update buffers in place."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, host_ortvalue(np.ascontiguousarray(array)))
    for name, array in outputs.items():
        binding.bind_ortvalue_output(name, host_ortvalue(array))
    session.run_with_iobinding(binding)
    return outputs


def run_declared(session, feeds: dict[str, np.ndarray], output_shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """``session`` on host arrays in the element types its graph declares: each input converted to its declared type
    (an overridable initializer's too), each output written by ORT into a new host array of its declared type and the
    shape ``output_shapes`` gives (ORT refuses a run whose output is another shape). So a bfloat16 graph runs and
    hands back ml_dtypes bfloat16 arrays exactly, which session.run cannot (its numpy bridge has no bfloat16)."""
    declared = {a.name: a.type for a in (*session.get_inputs(), *session.get_overridable_initializers())}
    typed = {name: np.asarray(value).astype(numpy_of_ort(declared[name]), copy=False) for name, value in feeds.items()}
    outputs = {o.name: np.empty(output_shapes[o.name], numpy_of_ort(o.type)) for o in session.get_outputs()}
    return run_bound(session, typed, outputs)


@dataclasses.dataclass
class CacheState:
    """What a runtime carries between steps, per batch row.

    ``caches`` follows ``Decoder.pairs`` (one array per cache input; device caches, from
    ``Decoder.new_device_state``: a dict of OrtValues by input name); ``lengths`` counts the real
    tokens each row holds; ``width`` is the cache's extent along its positions axis (the static
    buffer, or the past length); ``pads`` is attn_dynamic's left padding per row. ``states``: a
    hybrid's recurrent states by input name (``Decoder.state_pairs``), fixed in size.
    """

    caches: list
    lengths: np.ndarray
    width: int
    pads: np.ndarray
    states: dict = dataclasses.field(default_factory=dict)


class Decoder:
    def __init__(self, model: Path, ep: str = "cpu", *, session_options=None, cuda_graph: bool = False,
                 in_place: bool = False, mode: str | None = None, gqa_mask: str = "buffer", prepack: bool = True,
                 spin: bool = True):
        """``prepack=False`` leaves weights as stored instead of repacking them for the CPU's GEMM at
        session creation: for a session that runs a few dozen steps (validation) that repacking costs
        more than it saves (0.5B fp16 on 2 cores: 1.5-1.7 s vs 4.3-4.6 s of session creation, +0.5 s over 24 steps).
        ``spin=False``: the intra-op threads sleep between ops instead of spinning, which a serving
        session does to cut each op's wake-up latency; a session that shares the cores with other
        work (validation's weight check and reference) would spin on cores that work needs. 0.5B
        fp16 on 2 cores beside the weight check (benchmarks/results/session_cost_cpu.json, 4 rounds
        each first in turn, medians, gqa / attn_static): session creation 0.63 / 0.68 s against
        0.81 / 0.88 s spinning; session, 24 steps and the check done in 2.10 / 2.81 s against
        2.32 / 2.97 s. On the 16-core H200 host (2 rounds, h200/session_cost_beside_weights.json):
        session and 24 steps 0.46-0.61 s against 0.52-0.67 s, the check done in 0.66-0.71 s
        against 0.67-0.82 s.
        ``prepack`` and ``spin`` set up the default options; given ``session_options``, those are
        used as they are.
        ``gqa_mask`` (device binding, GroupQueryAttention): ``buffer`` feeds a mask as wide as the
        shared KV buffer (what onnxruntime-genai does under CUDA graph capture, and the only way to
        capture); ``grow`` one as wide as the tokens so far (what genai does without a graph)."""
        import onnxruntime as ort

        self.ort = ort
        model = Path(model)
        self.model_path = model / MODEL_FILE if model.is_dir() else model
        if ep not in PROVIDER_NAMES:
            raise ValueError(f"ep must be one of {sorted(PROVIDER_NAMES)}, not {ep!r}")
        if ep == "cuda":
            if PROVIDER_NAMES["cuda"] not in ort.get_available_providers():
                # ORT would quietly run on the CPU instead; a CUDA run that is not on CUDA proves nothing.
                raise RuntimeError(f"CUDAExecutionProvider is not available in this onnxruntime ({ort.__version__})")
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()
            # On the device this process is bound to (one worker per GPU: exporter.runtime.device).
            providers = [cuda_provider(enable_cuda_graph="1" if cuda_graph else "0")]
        else:
            providers = ["CPUExecutionProvider"]
        if session_options is None:
            session_options = ort.SessionOptions()
            # TensorScatter warns on every copy when caches are not bound in place; keep errors only.
            session_options.log_severity_level = 3
            for key, value in session_config_entries(prepack, spin).items():
                session_options.add_session_config_entry(key, value)
        self.ep, self.device, self.cuda_graph = ep, "cuda" if ep == "cuda" else "cpu", cuda_graph
        self.device_id = int(providers[0][1]["device_id"]) if ep == "cuda" else 0
        self.providers = providers
        phase(f"creating the {ep} session of {self.model_path.parent.name}" + (" for CUDA graphs" if cuda_graph else ""))
        self.session = ort.InferenceSession(str(self.model_path), session_options, providers=providers)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        # (an M-RoPE gqa decoder takes position_ids beside its mask, as attn_dynamic does: its variant tells them apart)
        gqa = self.session.get_modelmeta().custom_metadata_map.get(META_VARIANT) == Variant.GQA.value
        self.mode = mode or (GQA if gqa else cache_mode(set(self.inputs)))
        if cuda_graph and self.mode == DYNAMIC:
            raise ValueError("a growing past/present cache cannot be captured in a CUDA graph")
        if in_place and self.mode != STATIC:
            raise ValueError("in-place cache binding is the attn_static contract")
        self.in_place = in_place
        if gqa_mask not in ("buffer", "grow") or (gqa_mask == "grow" and cuda_graph):
            raise ValueError("gqa_mask is 'buffer' or 'grow', and a growing mask cannot be captured in a CUDA graph")
        self.grow_mask = gqa_mask == "grow" and self.mode == GQA
        self.meta = read_metadata(self.model_path)
        self.pairs = [(name, "updated_" + name if self.mode == STATIC else name.replace("past_key_values.", "present."))
                      for name in self.inputs if name.startswith(("key_cache.", "value_cache.", "past_key_values."))]
        # A hybrid's recurrent states (past_conv.i -> present_conv.i, ...): fixed shapes but the batch.
        self.state_pairs = [(name, "present_" + name.removeprefix("past_")) for name in self.inputs if is_state_input(name)]
        self.state_specs = {name: ([d for d in self.inputs[name].shape[1:]], BY_ORT[self.inputs[name].type])
                            for name, _ in self.state_pairs}
        if self.state_pairs and cuda_graph:
            raise ValueError("a hybrid's recurrent states are taken from each step's outputs, which a CUDA graph "
                             "cannot capture: run it without CUDA graphs")
        if not self.pairs:  # no attention layer at all (a recurrent stack: Mamba2 and MLP blocks): the logits' dtype
            self.dtype: DType = BY_ORT[self.session.get_outputs()[0].type]
            self.cache_dims = []
        else:
            first = self.inputs[self.pairs[0][0]]
            self.dtype = BY_ORT[first.type]
            self.cache_dims = list(first.shape)
        # Each cache's own dims, as the graph declares them (gemma4's global layers have their own head size and KV
        # heads; a traced latent-attention cache its values' own, contract.VALUE_HEAD_DIM). A head size left symbolic
        # (onnxruntime-genai's builder) is the metadata's where the export has ours, else its genai_config.json's.
        symbolic = any(not isinstance(self.inputs[name].shape[-1], int) for name, _ in self.pairs)
        sizes = self._head_sizes(self.meta.get("config") or {}) if symbolic else {}
        if self.cache_dims and not isinstance(self.cache_dims[-1], int):
            self.cache_dims[-1] = sizes["key"]
        self.pair_dims = {name: [*self.inputs[name].shape[:-1], self.inputs[name].shape[-1] if not symbolic or
                                 isinstance(self.inputs[name].shape[-1], int) else sizes[cache_kind(name)]]
                          for name, _ in self.pairs}
        self.mask_dtype = numpy_of_ort(self.inputs[ATTENTION_MASK].type) if ATTENTION_MASK in self.inputs else np.int64
        self.logits_dtype = numpy_of_ort(self.session.get_outputs()[0].type)
        self.vocab = self.session.get_outputs()[0].shape[2]
        config = self.meta.get("config", {})
        variant = self.meta.get(META_VARIANT.removeprefix(META_PREFIX))
        self.variant = Variant(variant) if variant else None  # None: another builder's export
        self.max_seq_len = config.get("max_seq_len")
        self._graph_ids = 0
        self._cast = None  # bfloat16 -> float32 on the device, for reading logits back
        # A decoder taking inputs_embeds (an image-text export's): input_ids [batch, seq] -> its embeddings,
        # set by the driver that owns the embedding graph (exporter.runtime.image_text).
        self.embed = None
        # A decoder with multimodal rotary (position_ids [3, batch, seq]): (input_ids, the step's 1-D positions, its
        # attention_mask or None) -> the three streams, set by the same driver (it knows the images' grids).
        self.positions = None
        # Called whenever new caches are made (a new sequence starts), set by the same driver: what it carries from
        # step to step (M-RoPE's per-row offsets) starts again.
        self.on_new_sequence = None
        self.mrope = POSITION_IDS in self.inputs and len(self.inputs[POSITION_IDS].shape) == 3

    def _head_sizes(self, config: dict) -> dict[str, int]:
        """{"key": head size, "value": head size} of the caches, for dims the graph leaves symbolic: the metadata's
        (contract.value_head_dim), or onnxruntime-genai's builder's genai_config.json (one head size for both)."""
        if "head_dim" in config:
            return {"key": int(config["head_dim"]), "value": value_head_dim(config)}
        path = self.model_path.parent / GENAI_CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"{self.model_path} leaves its caches' head size symbolic and names it nowhere (no "
                             f"{META_CONFIG} metadata, no {GENAI_CONFIG_FILE} beside it)")
        head_size = json.loads(path.read_text())["model"]["decoder"]["head_size"]
        return {"key": head_size, "value": head_size}

    def _embedded(self, feeds: dict) -> dict:
        """``feeds`` as the graph takes them: input_ids through ``embed`` where it takes inputs_embeds (and the
        positions through ``positions`` where it takes M-RoPE's three streams)."""
        if INPUTS_EMBEDS not in self.inputs:
            return feeds
        if self.embed is None or (self.mrope and self.positions is None):
            raise ValueError(f"{self.model_path} takes {INPUTS_EMBEDS}: drive it through its embedding graph "
                             "(exporter.runtime.image_text.ImageTextModel)")
        feeds = dict(feeds)
        if self.positions is not None:  # before embed, which takes the queued images the positions are computed from
            feeds[POSITION_IDS] = self.positions(feeds[INPUT_IDS], feeds[POSITION_IDS], feeds.get(ATTENTION_MASK))
        feeds[INPUTS_EMBEDS] = self.embed(feeds.pop(INPUT_IDS))
        return feeds

    @property
    def num_layers(self) -> int:
        return len(self.pairs) // 2

    # --- the per-step inputs, for every binding ---------------------------------------------------

    def counts(self, cached: np.ndarray, new_tokens: int) -> dict[str, np.ndarray]:
        """attn_static's counters (a test overrides this to plant the before-scatter bug)."""
        return static_cache_counts(cached, new_tokens)

    def step_feeds(self, input_ids: np.ndarray, cached: np.ndarray, new: np.ndarray, width: int,
                   pads: np.ndarray | None = None, buffer: int | None = None) -> dict[str, np.ndarray]:
        """Inputs of one step: ``input_ids`` [batch, seq] holding ``new[r]`` real tokens of row r after
        the ``cached[r]`` it holds; ``width`` positions along the cache before the step; ``buffer``
        the shared GroupQueryAttention buffer's width (device binding)."""
        batch, seq = input_ids.shape
        feeds = {INPUT_IDS: input_ids.astype(np.int64)}
        if self.mode == STATIC:
            feeds[POSITION_IDS] = cached[:, None] + np.arange(seq, dtype=np.int64)[None]
            feeds.update(self.counts(cached, seq))
        elif self.mode == GQA:  # right padding: row r's real tokens fill positions [0, cached + new)
            mask = np.zeros((batch, buffer if buffer is not None else width + seq), self.mask_dtype)
            for r in range(batch):
                mask[r, : cached[r] + new[r]] = 1
            feeds[ATTENTION_MASK] = mask
            if POSITION_IDS in self.inputs:  # M-RoPE's gqa decoder: from these, ``positions`` gives the three streams
                feeds[POSITION_IDS] = cached[:, None] + np.arange(seq, dtype=np.int64)[None]
        else:  # left padding: pads first, positions count real tokens only
            pads = np.zeros(batch, np.int64) if pads is None else pads
            mask = np.ones((batch, width + seq), self.mask_dtype)
            step_pads = seq - new
            for r in range(batch):
                mask[r, : pads[r]] = 0
                mask[r, width: width + step_pads[r]] = 0
            positions = cached[:, None] + np.arange(seq, dtype=np.int64)[None] - step_pads[:, None]
            feeds[POSITION_IDS] = np.maximum(positions, 0)
            feeds[ATTENTION_MASK] = mask
        return feeds

    # --- host arrays --------------------------------------------------------------------------------

    def new_state(self, batch: int = 1, buffer: int | None = None) -> CacheState:
        """Empty caches: attn_static's whole buffer (default: the exported max_seq_len), else an empty past."""
        self._new_sequence()
        width = (buffer or self.max_seq_len) if self.mode == STATIC else 0
        caches = [np.zeros(self._cache_shape(name, batch, width), self.dtype.numpy) for name, _ in self.pairs]
        return CacheState(caches, np.zeros(batch, np.int64), width, np.zeros(batch, np.int64), self.new_states(batch))

    def _cache_shape(self, name: str, batch: int, positions: int) -> list[int]:
        """The cache input ``name`` of ``batch`` rows holding ``positions`` positions."""
        return [batch] + [d if isinstance(d, int) else positions for d in self.pair_dims[name][1:]]

    def _new_sequence(self) -> None:
        if self.on_new_sequence is not None:
            self.on_new_sequence()

    def new_states(self, batch: int) -> dict[str, np.ndarray]:
        """A hybrid's recurrent states at the start of a sequence: zeros."""
        return {name: np.zeros([batch, *dims], dtype.numpy) for name, (dims, dtype) in self.state_specs.items()}

    def forward(self, input_ids: np.ndarray, state: CacheState) -> np.ndarray:
        """Every row takes ``input_ids.shape[1]`` more tokens (a prompt, a chunk, one decode token);
        returns the logits [batch, seq, vocab] and advances ``state``."""
        batch, seq = input_ids.shape
        new = np.full(batch, seq, np.int64)
        return self._run_host(self.step_feeds(input_ids, state.lengths, new, state.width, state.pads), state, new)

    def prefill(self, prompts: list[list[int]], state: CacheState) -> np.ndarray:
        """Prompts of any lengths into an empty ``state``; returns each row's last-token logits [batch, vocab]."""
        lengths = np.array([len(p) for p in prompts], np.int64)
        if len(prompts) != len(state.lengths) or state.lengths.any() or lengths.min() < 1:
            raise ValueError("prefill takes one non-empty prompt per row of an empty state")
        longest = int(lengths.max())
        if self.mode == GQA and self.state_pairs and lengths.min() != longest:
            raise ValueError("this hybrid's gqa export takes a batch of prompts of one length: right padding would run "
                             "the padding through the recurrent states (attn_dynamic takes ragged batches, left-padded)")
        if self.mode == STATIC:
            return np.stack([self._prefill_row(r, prompt, state) for r, prompt in enumerate(prompts)])
        ids = np.zeros((len(prompts), longest), np.int64)
        for r, prompt in enumerate(prompts):
            if self.mode == GQA:
                ids[r, : len(prompt)] = prompt
            else:
                ids[r, longest - len(prompt):] = prompt
        logits = self._run_host(self.step_feeds(ids, state.lengths, lengths, state.width, state.pads), state, lengths)
        if self.mode == DYNAMIC:
            state.pads = longest - lengths
            return logits[:, -1]
        return logits[np.arange(len(prompts)), lengths - 1]

    def step(self, tokens, state: CacheState) -> np.ndarray:
        """One more token per row; returns the logits [batch, vocab]."""
        return self.forward(np.asarray(tokens, np.int64).reshape(-1, 1), state)[:, -1]

    def _prefill_row(self, r: int, prompt: list[int], state: CacheState) -> np.ndarray:
        """One row of a static-cache batch, on views of its caches: written in place, the rest untouched."""
        row = CacheState([c[r:r + 1] for c in state.caches], state.lengths[r:r + 1].copy(), state.width,
                         state.pads[r:r + 1], {name: s[r:r + 1] for name, s in state.states.items()})
        logits = self._run_host(self.step_feeds(np.array([prompt], np.int64), row.lengths, row.lengths + len(prompt),
                                                row.width), row, np.array([len(prompt)]), in_place=True)
        state.lengths[r] = row.lengths[0]
        return logits[0, -1]

    def _run_host(self, feeds: dict, state: CacheState, new: np.ndarray, in_place: bool | None = None) -> np.ndarray:
        batch, seq = feeds[INPUT_IDS].shape
        in_place = self.in_place if in_place is None else in_place
        if self.mode == STATIC and self.max_seq_len and int((state.lengths + seq).max()) > state.width:
            raise ValueError(f"{int((state.lengths + seq).max())} tokens do not fit a {state.width}-token static cache")
        for (name_in, _), cache in zip(self.pairs, state.caches):
            feeds[name_in] = cache
        feeds.update(state.states)
        feeds = self._embedded(feeds)
        logits = np.empty((batch, seq, self.vocab), self.logits_dtype)
        new_states = {out: np.empty(state.states[name].shape, state.states[name].dtype) for name, out in self.state_pairs}
        if in_place:  # each cache input and its updated output are one (host) buffer
            outputs = run_bound(self.session, feeds, {LOGITS: logits, **new_states, **{out: c for (_, out), c in
                                                                                       zip(self.pairs, state.caches)}})
            for name, out in self.state_pairs:  # into the caller's arrays (views of a batch's rows)
                state.states[name][...] = outputs[out]
        else:
            width = state.width if self.mode == STATIC else state.width + seq
            outputs = {LOGITS: logits, **new_states,
                       **{out: np.empty(self._cache_shape(name, batch, width), self.dtype.numpy) for name, out in self.pairs}}
            if self.dtype.name == "bf16":
                run_bound(self.session, feeds, outputs)
            else:
                outputs = dict(zip(self.output_names, self.session.run(None, feeds)))
            state.caches = [outputs[out] for _, out in self.pairs]
            state.states = {name: outputs[out] for name, out in self.state_pairs}
            state.width = width
        state.lengths = state.lengths + new
        return outputs[LOGITS]

    # --- device buffers (benchmark) -------------------------------------------------------------------

    def _device_value(self, array: np.ndarray):
        array = np.ascontiguousarray(array)
        if array.dtype.name == "bfloat16":
            value = self._device_empty(array.shape, DTYPES["bf16"])
            value.update_inplace(ort_bits(array))
            return value
        return self.ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)

    def _device_empty(self, shape, dtype: DType):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.onnx, self.device, self.device_id)

    def _run_device(self, binding, graph_id: int) -> None:
        options = self.ort.RunOptions()
        if self.device == "cuda":
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.session.run_with_iobinding(binding, options)

    def new_caches(self, buffer: int, batch: int = 1) -> dict:
        """Zeroed device cache buffers of ``buffer`` positions (dynamic: an empty past)."""
        self._new_sequence()
        length = 0 if self.mode == DYNAMIC else buffer
        caches = {name: self._device_value(np.zeros(self._cache_shape(name, batch, length), self.dtype.numpy))
                  for name, _ in self.pairs}
        # A hybrid's states in two buffers each, by input and output name: a step reads one and writes
        # the other, then they swap (``_swap_states``).
        zeros = self.new_states(batch)
        for name_in, name_out in self.state_pairs:
            caches[name_in], caches[name_out] = (self._device_value(zeros[name_in]) for _ in range(2))
        return caches

    def _bound_feeds(self, tokens: np.ndarray, past: int, buffer: int) -> dict[str, np.ndarray]:
        batch, seq = tokens.shape
        cached, new = np.full(batch, past, np.int64), np.full(batch, seq, np.int64)
        return self.step_feeds(tokens, cached, new, past,
                               buffer=buffer if self.mode == GQA and not self.grow_mask else None)

    def _bind_caches(self, binding, caches: dict) -> None:
        for name_in, name_out in self.pairs:
            binding.bind_ortvalue_input(name_in, caches[name_in])
            if self.mode == DYNAMIC:
                binding.bind_output(name_out, self.device, self.device_id)
            else:
                binding.bind_ortvalue_output(name_out, caches[name_in])
        self._bind_states(binding, caches)

    def _bind_states(self, binding, caches: dict) -> None:
        for name_in, name_out in self.state_pairs:
            binding.bind_ortvalue_input(name_in, caches[name_in])
            binding.bind_ortvalue_output(name_out, caches[name_out])

    def _swap_states(self, caches: dict) -> None:
        """After a step: the states it wrote become the next step's input."""
        for name_in, name_out in self.state_pairs:
            caches[name_in], caches[name_out] = caches[name_out], caches[name_in]

    def _take_presents(self, binding, caches: dict) -> None:
        # Bound in this order: logits, then each cache output.
        outputs = dict(zip([LOGITS] + [out for _, out in self.pairs], binding.get_outputs()))
        for name_in, name_out in self.pairs:
            caches[name_in] = outputs[name_out]

    def prefill_bound(self, tokens: np.ndarray, caches: dict, buffer: int):
        """Run the prompts [batch, ctx] (never captured); returns (elapsed seconds, logits OrtValue)."""
        return self._run_bound(tokens, caches, 0, buffer)

    def _run_bound(self, tokens: np.ndarray, caches: dict, past: int, buffer: int):
        """One uncaptured run of ``tokens`` after ``past`` cached positions, the caches bound as
        ``_bind_caches`` binds them (a dynamic present taken as the next past); returns (elapsed
        seconds of the run, logits OrtValue on the device)."""
        binding = self.session.io_binding()
        if self.mode == GQA and past == 0:
            # GroupQueryAttention's first prompt: the mask as wide as the prompt (as onnxruntime-genai
            # feeds it); a buffer-wide one reads as a later chunk of a prompt, which takes batch 1 only.
            batch, seq = tokens.shape
            feeds = self.step_feeds(tokens, np.zeros(batch, np.int64), np.full(batch, seq, np.int64), 0)
        else:
            feeds = self._bound_feeds(tokens, past, buffer)
        for name, array in self._embedded(feeds).items():
            binding.bind_ortvalue_input(name, self._device_value(array))
        binding.bind_output(LOGITS, self.device, self.device_id)  # first: outputs come back in binding order
        self._bind_caches(binding, caches)
        start = time.perf_counter()
        self._run_device(binding, -1)
        elapsed = time.perf_counter() - start
        if self.mode == DYNAMIC:
            self._take_presents(binding, caches)
        self._swap_states(caches)
        return elapsed, binding.get_outputs()[0]

    def decode_bound(self, caches: dict, past: int, buffer: int, steps: int, warmup: int, should_stop=lambda: False,
                     capture: bool | None = None):
        """Time ``steps`` one-token steps of every row after ``warmup``; returns (ms list, last logits).

        ``capture`` (default: whether the session was made for CUDA graphs) records the step once
        and replays it; False runs every step normally, even in a graph-enabled session.
        """
        graph_id = -1
        if self.cuda_graph and capture is not False:
            self._graph_ids += 1
            graph_id = self._graph_ids  # one captured graph per buffer set (addresses differ)
        batch = next(iter(caches.values())).shape()[0]
        phase(f"decoding {warmup + steps} steps after {past} positions, batch {batch}"
              + (f" (CUDA graph {graph_id}: captured on the first run, replayed after)" if graph_id >= 0 else ""))
        ones = np.ones((batch, 1), np.int64)
        # (an image-text decoder's inputs_embeds in place of the ids: the embedding graph's, on the host, every step)
        fixed = {name: self._device_value(array)
                 for name, array in self._embedded(self._bound_feeds(ones, past, buffer)).items()}
        logits = self._device_empty((batch, 1, self.vocab), BY_ORT[self.session.get_outputs()[0].type])
        binding = self.session.io_binding()
        for name, value in fixed.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(LOGITS, logits)
        if self.mode != DYNAMIC:
            self._bind_caches(binding, caches)
        times = []
        for i in range(warmup + steps):
            if should_stop():
                raise InterruptedError("benchmark stopped")
            start = time.perf_counter()
            if self.mode == DYNAMIC or self.grow_mask:  # the mask grows with the past: a new one each step
                binding.bind_ortvalue_input(ATTENTION_MASK, self._device_value(np.ones((batch, past + i + 1), self.mask_dtype)))
            if self.mode == DYNAMIC:  # ... and so do the caches
                self._bind_caches(binding, caches)
            elif self.state_pairs:  # a hybrid's states alternate between their two buffers
                self._bind_states(binding, caches)
            for name, array in self._embedded(self._bound_feeds(ones, past + i, buffer)).items():
                if name not in (INPUT_IDS, ATTENTION_MASK) or (self.mode == GQA and not self.grow_mask):
                    # same address: a captured graph sees the new value (a bf16 inputs_embeds as its bits)
                    fixed[name].update_inplace(ort_bits(np.ascontiguousarray(array)))
            self._run_device(binding, graph_id)
            if self.mode == DYNAMIC:
                self._take_presents(binding, caches)
            self._swap_states(caches)
            elapsed = (time.perf_counter() - start) * 1000.0
            if i >= warmup:
                times.append(elapsed)
        return times, self.to_host(logits)

    # --- device caches, one row (validation on CUDA) ------------------------------------------------

    def new_device_state(self, buffer: int) -> CacheState:
        """Empty caches of one row on the device, for ``forward_device``: attn_static's and
        GroupQueryAttention's a buffer of ``buffer`` positions each (attn_static: the exported
        max_seq_len; GroupQueryAttention: at most that, as far as its rotary tables reach), a
        dynamic past of none. ``caches`` is a dict by cache input name, not a list."""
        if self.mode == STATIC and self.max_seq_len:
            buffer = self.max_seq_len
        elif self.mode == GQA and self.max_seq_len:
            buffer = min(buffer, self.max_seq_len)
        width = 0 if self.mode == DYNAMIC else buffer
        return CacheState(self.new_caches(buffer), np.zeros(1, np.int64), width, np.zeros(1, np.int64))

    def forward_device(self, input_ids: np.ndarray, state: CacheState) -> np.ndarray:
        """``forward`` for one row with its caches left on the device between steps, as a runtime
        runs the export: attn_static's and GroupQueryAttention's buffers bound as both the cache
        input and its output (GQA: onnxruntime-genai's shared past/present buffer, its mask as wide
        as the prompt on the first run and as the buffer after), a dynamic present taken as the
        next past. Only the step's inputs and its logits cross to the host. On CUDA a host-fed
        GroupQueryAttention, with past and present apart, ran 10x slower (0.5B fp16, H200: 39-42 ms a
        step against 3.8 ms), and attn_static copied its whole buffer both ways every step."""
        if input_ids.shape[0] != 1:
            raise ValueError("forward_device runs one row")
        seq, past = input_ids.shape[1], int(state.lengths[0])
        if self.mode != DYNAMIC and past + seq > state.width:
            raise ValueError(f"{past + seq} tokens do not fit a {state.width}-position cache buffer")
        _, logits = self._run_bound(input_ids, state.caches, past, state.width)
        state.lengths = state.lengths + seq
        return self.to_host(logits)

    def to_host(self, value) -> np.ndarray:
        """A device OrtValue as a host array; bfloat16 comes back as float32 (numpy has no bfloat16
        bridge in ORT), cast on the device by a one-node session."""
        if value.data_type() != DTYPES["bf16"].ort:
            return value.numpy()
        phase("reading bf16 logits back to the host (a one-node Cast session)")
        if self._cast is None:
            import onnx_ir as ir

            x = ir.Value(name="x", type=ir.TensorType(ir.DataType.BFLOAT16), shape=ir.Shape(["d0", "d1", "d2"]))
            node = ir.node("Cast", [x], {"to": ir.DataType.FLOAT})
            y = node.outputs[0]
            y.name, y.type, y.shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape(["d0", "d1", "d2"])
            graph = ir.Graph([x], [y], nodes=[node], opset_imports={"": 21})
            proto = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
            # Never captured: its input is a new buffer and its output a host copy at every call. Made with
            # the decoder's graph-enabled providers, onnxruntime-gpu 1.31.1 replayed its captured graph
            # from the third call on and left the bound output unallocated: every bf16 bench died of
            # SIGSEGV in copy_outputs_to_cpu (benchmarks/bf16_bench_crash.py, results/h100/).
            providers = [cuda_provider()] if self.device == "cuda" else ["CPUExecutionProvider"]
            self._cast = self.ort.InferenceSession(proto, providers=providers)
        binding = self._cast.io_binding()
        binding.bind_ortvalue_input("x", value)
        binding.bind_output("y", "cpu")
        self._cast.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]


__all__ = ["Decoder", "CacheState", "read_metadata", "cache_mode", "run_bound", "run_declared", "host_ortvalue",
           "ort_bits", "session_config_entries"]
