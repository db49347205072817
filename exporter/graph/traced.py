"""Stage 2, traced: a causal LM without a hand-built architecture, through transformers' own exporter.

exportfarm builds its graphs by hand for the architectures in ``exporter.graph.architectures``; any
other causal LM transformers knows is traced from the model's own code by ``transformers.exporters``
(``OnnxExporter`` with dynamic shapes and onnxruntime's fusions for the EP) and mapped onto the
``attn_dynamic`` contract, so the rest of the pipeline (fold, quantize, write, genai package,
validation, bench, the farm) takes it as it takes a hand-built graph.

One graph serves prefill and decode: the model is traced on a step of ``TRACE_NEW`` new tokens after
a cache of ``TRACE_PAST`` (a left-padded batch of ``TRACE_BATCH``), every axis symbolic. That step is
a KV-cache forward of any number of new tokens, and an empty past (length 0) is a prefill: transformers'
mask reads ``attention_mask`` (padding) and the past's length (causality), and the cache's ``Concat``
takes an empty past. Sizes 0 and 1 are avoided in the trace, since torch.export specializes them.

transformers names the graph's inputs and outputs after the traced call's tensors
(``input.cache.layers.3.keys`` in, ``output.cache.layers.3.keys`` out); they are found by identity
with the sample's cache tensors, not by parsing those names, and renamed to ``exporter.contract``'s.

The caches are what transformers caches. For multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2, GLM-4.7-Flash)
that is the normed latent as the keys (kv_lora_rank wide) and the rotated shared key as the values (qk_rope_head_dim
wide), one head each: keys and values of two head sizes, the values' carried as ``contract.VALUE_HEAD_DIM``.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import onnx_ir as ir

from exporter import __version__, contract
from exporter.errors import ExportError
from exporter.request import HAND, TRACED, DType, EP, ExportRequest, Variant

# The traced step: a batch of 2 (the second row left-padded by 2) with 5 cached positions and 3 new
# tokens. Distinct sizes, none 0 or 1, so torch.export keeps every axis symbolic and keeps batch, past
# and new tokens apart.
TRACE_BATCH, TRACE_PAST, TRACE_NEW, TRACE_PAD = 2, 5, 3, 2
TORCH_DTYPES = {DType.FP32: "float32", DType.FP16: "float16", DType.BF16: "bfloat16"}
# The cache layers a model may make itself that hold keys and values only (a sliding one crops them; the trace
# gives it growing ones). Anything else carries other state: linear-attention or Mamba states, an indexer's keys.
KV_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer"}
# Logits with the contract's positions and with the model's own agree within this part of their range when the
# model counts positions from 0 (in fp32 they are equal; half precision may round two code paths apart).
POSITION_TOLERANCE = 1e-3
# The onnxscript transformers.exporters' OnnxExporter is tested with (its tested_versions); pinned in pyproject.
ONNXSCRIPT_VERSION = "0.7.0"


# --- which builder ----------------------------------------------------------------------------------


def resolve_builder(request: ExportRequest, checkpoint_dir: Path) -> str:
    """``contract.BUILDER_HAND`` or ``contract.BUILDER_TRACED`` for ``request`` on this checkpoint:
    the request's builder, or for ``auto`` the hand-built architecture where one exists."""
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import read_raw_config

    from exporter.graph.language_model import image_text_type

    model_type = read_raw_config(Path(checkpoint_dir)).get("model_type")
    if request.builder == TRACED:
        return contract.BUILDER_TRACED
    # an image-text checkpoint's three graphs are hand-built (graph/language_model.py refuses what they cannot be)
    if model_type in ARCHITECTURES or image_text_type(Path(checkpoint_dir)):
        return contract.BUILDER_HAND
    if request.builder == HAND:
        raise ExportError(f"exportfarm has no hand-built architecture for model_type {model_type!r} (it has "
                          f"{', '.join(sorted(ARCHITECTURES))}): drop builder hand (CLI --builder) to export it "
                          "through transformers.exporters (builder auto or traced)")
    return contract.BUILDER_TRACED


def builder_entry(name: str) -> dict:
    """The manifest's ``builder``: who built the graph, and which version of it."""
    if name == contract.BUILDER_TRACED:
        import transformers

        return {"name": name, "version": transformers.__version__}
    return {"name": contract.BUILDER_HAND, "version": __version__}


def check_traced_request(request: ExportRequest) -> None:
    """Refuse what a traced graph cannot be: it is mapped onto attn_dynamic only, in the current target."""
    if request.static_cache or request.variant not in (None, Variant.ATTN_DYNAMIC):
        asked = "static_cache" if request.static_cache else f"variant {request.variant.value}"
        raise ExportError(f"a graph traced by transformers.exporters is mapped onto the attn_dynamic contract only, "
                          f"not {asked}: drop it (the traced graph takes a growing past, prefill and decode alike), "
                          "or export a model type with a hand-built architecture")
    if request.compat:
        raise ExportError("compat lowers exportfarm's own attention for older onnxruntime; a graph traced by "
                          "transformers.exporters carries onnxruntime's fused ops of the current release: drop compat")


def traced_sizes(checkpoint_dir: Path) -> tuple[int, int]:
    """(layers, vocabulary) of the checkpoint as transformers reads its config (for activation measurement)."""
    config = _config(Path(checkpoint_dir))
    text = config.get_text_config(decoder=True)
    return int(text.num_hidden_layers), int(text.vocab_size)


# --- the trace ----------------------------------------------------------------------------------------


def trace_model(request: ExportRequest, source, activations: DType | None = None):
    """The checkpoint's causal LM traced by transformers.exporters, as an attn_dynamic ``BuildResult``
    whose weights are recipes over the checkpoint (``CheckpointSourcesPass``)."""
    from exporter.graph.build import BuildResult
    from exporter.graph.config import check_not_prequantized, read_raw_config
    from exporter.graph.passes.checkpoint_sources import CheckpointSourcesPass
    from exporter.packaging.checkpoint import Checkpoint

    check_traced_request(request)
    activations = activations or request.activations
    checkpoint_dir = Path(source.path)
    raw = read_raw_config(checkpoint_dir)
    model_type = raw.get("model_type")
    check_not_prequantized(raw)
    checkpoint = Checkpoint(checkpoint_dir)
    if checkpoint.prequantized is not None:
        raise ExportError(f"the traced fallback does not import {checkpoint.prequantized.label} codes: export the "
                          "float checkpoint (and int4 / int8 to quantize it)")
    _check_causal_lm(model_type)
    config = _config(checkpoint_dir)
    _check_positions(request, config, model_type)  # before the minutes a trace can take
    model = _load(checkpoint_dir, activations, model_type)
    sample, layers = _sample(model, model_type)
    paths = _leaf_paths(sample, layers)
    program = _trace(model, sample, request.ep, model_type)
    del model
    kv_heads, head_dim, value_head_dim = int(layers[0].keys.shape[1]), int(layers[0].keys.shape[3]), \
        int(layers[0].values.shape[3])
    geometry = _map_to_contract(program, paths, kv_heads, head_dim, value_head_dim, model_type)
    sources = CheckpointSourcesPass(checkpoint)
    sources(program)
    cfg = _model_config(config, model_type, geometry)
    context = request.max_seq_len or cfg.max_position_embeddings or None
    program.metadata_props.update({
        contract.META_VARIANT: Variant.ATTN_DYNAMIC.value,
        contract.META_DTYPE: request.dtype.value,
        contract.META_EP: request.ep.value,
        contract.META_BUILDER: contract.BUILDER_TRACED,
        contract.META_CONFIG: json.dumps({
            "architecture": model_type, "num_layers": geometry["layers"], "num_heads": cfg.num_heads,
            "num_kv_heads": geometry["kv_heads"],
            # transformers' latent-attention cache: keys kv_lora_rank wide, values qk_rope_head_dim wide
            **contract.head_dim_entries(geometry["head_dim"], geometry["value_head_dim"]), "vocab_size": geometry["vocab"],
            "max_seq_len": request.max_seq_len, "context_length": context, "activations": activations.value,
            "builder": builder_entry(contract.BUILDER_TRACED),
            # bloom's ALiBi reads positions off attention_mask: the contract's position_ids input is kept, unread
            "position_ids": "read" if geometry["positions"] else "unread: the model derives positions from attention_mask",
            "computed_initializers": len(sources.computed),
            **({"quant": request.quant.to_dict()} if request.quant else {}),
        }),
    })
    program.producer_name, program.producer_version = "exportfarm (transformers.exporters)", __version__
    return BuildResult(program, cfg, None, Variant.ATTN_DYNAMIC, checkpoint, activations)


def _config(checkpoint_dir: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(checkpoint_dir))
    except Exception as err:  # transformers' own checks of config.json
        raise ExportError(f"transformers cannot read {checkpoint_dir}/config.json ({_first_line(err)}): the traced "
                          "fallback needs a config transformers knows; fix config.json or upgrade transformers") from None


def _check_causal_lm(model_type: str | None) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ExportError(f"transformers has no causal-LM class for model_type {model_type!r} "
                          "(AutoModelForCausalLM): the exporter exports decoder LMs only; point --model at one")


def _load(checkpoint_dir: Path, activations: DType, model_type: str):
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.graph.architectures import ARCHITECTURES

    dtype = getattr(torch, TORCH_DTYPES[activations])
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype, output_loading_info=True)
    except Exception as err:
        raise ExportError(f"transformers cannot load the {model_type} checkpoint in {activations.value} "
                          f"({_first_line(err)}): the traced fallback runs the model's own code; fix the checkpoint "
                          "or export another dtype") from None
    # transformers fills weights the checkpoint lacks with random values and only warns: a trace of that model
    # would export noise (a llama checkpoint whose config.json says gpt2 loads as a random GPT-2)
    missing, mismatched = loading.get("missing_keys") or [], loading.get("mismatched_keys") or []
    if missing or mismatched:
        named = sorted(missing)[:5] + [str(m[0]) if isinstance(m, tuple) else str(m) for m in mismatched][:5]
        raise ExportError(f"the checkpoint does not hold the weights transformers' {type(model).__name__} expects for "
                          f"model_type {model_type!r} ({len(missing)} missing, {len(mismatched)} of another shape, e.g. "
                          f"{', '.join(named)}): config.json and the weights disagree; fix config.json's model_type "
                          f"(exportfarm builds these by hand: {', '.join(sorted(ARCHITECTURES))}) or use the weights "
                          "it belongs to")
    return model.eval()


def _sample(model, model_type: str) -> tuple[dict, list]:
    """The traced step's inputs (forward kwargs: the new tokens, their mask and positions, the cache
    after a left-padded prefill) and the cache's layers."""
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

    accepted = inspect.signature(model.forward).parameters
    cache_arg = next((a for a in ("cache", "past_key_values") if a in accepted), None)
    if cache_arg is None or "attention_mask" not in accepted:
        missing = "KV cache (cache / past_key_values)" if cache_arg is None else "attention_mask"
        raise ExportError(f"{type(model).__name__}.forward takes no {missing}: the attn_dynamic contract feeds a "
                          "growing past and a padding mask, so this model cannot be exported through it")
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    total = TRACE_PAST + TRACE_NEW
    ids = torch.randint(3, vocab, (TRACE_BATCH, total), generator=generator)  # 3: past the usual special ids
    mask = torch.ones(TRACE_BATCH, total, dtype=torch.long)
    mask[1, :TRACE_PAD] = 0  # left padding: the traced mask must read attention_mask, not assume it is all ones
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill = {"input_ids": ids[:, :TRACE_PAST], "attention_mask": mask[:, :TRACE_PAST], "use_cache": True}
    if "position_ids" in accepted and not _counts_from_zero(model, ids[:1, :TRACE_PAST]):
        accepted = {k: v for k, v in accepted.items() if k != "position_ids"}  # traced without: the model places tokens
    if "position_ids" in accepted:
        prefill["position_ids"] = positions[:, :TRACE_PAST]
    # First the cache the model makes itself: one that is not keys and values (Mamba's, RWKV's states) is refused
    # by name. Then the step is traced over a cache of plain growing layers, whatever the config says: a sliding
    # layer would crop the past, and the contract's present is always past + new (the window is the mask's business).
    own = _prefill(model, prefill, cache_arg, model_type)
    # A decoder built for cross-attention (BERT-style LM heads) keeps an EncoderDecoderCache: with no encoder, its
    # cross-attention half stays empty and the self-attention half is the KV cache
    paired = isinstance(own, EncoderDecoderCache) and own.cross_attention_cache.get_seq_length() == 0
    if paired:
        own = own.self_attention_cache
    if own is None:
        raise ExportError(f"{model_type}'s forward returns no cache (use_cache true): as configured it does not decode "
                          "through a KV cache, and the attn_dynamic contract decodes through one (an encoder's "
                          "checkpoint used as a causal LM sets is_decoder true in config.json)")
    kinds = sorted({type(layer).__name__ for layer in getattr(own, "layers", ())})
    if not isinstance(own, DynamicCache) or not kinds or not set(kinds) <= KV_LAYERS:
        raise ExportError(f"{model_type} keeps its state in {type(own).__name__} ({', '.join(kinds) or 'no layers'}), "
                          "not a KV cache of growing layers: the attn_dynamic contract carries keys and values only "
                          "(recurrent states are exported by the hand-built hybrids)")
    given = EncoderDecoderCache(DynamicCache(), DynamicCache()) if paired else DynamicCache()
    returned = _prefill(model, {**prefill, cache_arg: given}, cache_arg, model_type)
    cache = returned.self_attention_cache if paired and isinstance(returned, EncoderDecoderCache) else returned
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())})
    if not isinstance(cache, DynamicCache) or kinds != [DynamicLayer.__name__]:
        raise ExportError(f"{model_type} does not keep its keys and values in the plain DynamicCache it is given "
                          f"(it returned {type(cache).__name__}: {', '.join(kinds) or 'no layers'}): the traced "
                          "fallback cannot map its cache onto the attn_dynamic contract")
    sample = {"input_ids": ids[:, TRACE_PAST:], "attention_mask": mask, cache_arg: returned, "use_cache": True}
    if "position_ids" in accepted:
        sample["position_ids"] = positions[:, TRACE_PAST:]
    layers = list(cache.layers)
    # Keys and values may differ in head size (transformers caches latent attention's normed latent as the keys and
    # its rotary key as the values): the contract carries the values' own (contract.VALUE_HEAD_DIM).
    for i, layer in enumerate(layers):
        if (layer.keys.dim() != 4 or layer.values.dim() != 4 or tuple(layer.keys.shape[:3]) != tuple(layer.values.shape[:3])
                or tuple(layer.keys.shape[::2]) != (TRACE_BATCH, TRACE_PAST)):
            raise ExportError(f"{model_type}'s layer {i} caches keys {list(layer.keys.shape)} and values "
                              f"{list(layer.values.shape)}; the attn_dynamic contract carries both as [batch, kv_heads, "
                              f"positions, head size] with one batch, head count and length (batch {TRACE_BATCH}, "
                              f"{TRACE_PAST} positions here)")
    geometries = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in layers}
    if len(geometries) != 1:
        raise ExportError(f"{model_type}'s layers cache different head counts or sizes "
                          f"({sorted((k[1::2], v[3]) for k, v in geometries)}: heads, key and value head sizes): the "
                          "attn_dynamic contract gives every layer one cache geometry")
    return sample, layers


def _counts_from_zero(model, ids) -> bool:
    """Whether the model given the contract's positions (0, 1, ... over real tokens) computes what it computes
    with none, as transformers (and so the reference) runs it. RoBERTa's family counts from padding_idx + 1:
    fed the contract's, its logits would be another model's; such a model is traced without position_ids and
    places its tokens itself (the contract's input stays, unread)."""
    import torch

    try:
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits.float()
            given = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits.float()
    except Exception:  # a model that refuses one of the calls: the prefill below says what is wrong with it
        return True
    span = float(own.max() - own.min()) or 1.0
    return bool((own - given).abs().max() <= POSITION_TOLERANCE * span)


def _prefill(model, inputs: dict, cache_arg: str, model_type: str):
    """The cache after the model's forward on ``inputs`` (a left-padded prompt)."""
    import torch

    try:
        with torch.no_grad():
            out = model(**inputs)
    except Exception as err:
        given = "a plain DynamicCache" if cache_arg in inputs else "its own cache"
        raise ExportError(f"{model_type}'s forward failed on a left-padded prompt with {given} ({_first_line(err)}): "
                          "the traced fallback needs the model to take attention_mask and a KV cache; export a model "
                          "type with a hand-built architecture") from None
    return getattr(out, cache_arg, None) or getattr(out, "past_key_values", None)


def _leaf_paths(sample: dict, layers: list) -> dict:
    """{"input_ids" / "attention_mask" / "position_ids" / (layer, "key" | "value"): the sample's leaf path},
    found by identity with the tensors, as transformers names graph inputs after those paths."""
    from transformers.exporters.utils import get_leaf_tensors

    by_id = {id(tensor): path for path, tensor in get_leaf_tensors(sample).items()}
    paths = {name: name for name in (contract.INPUT_IDS, contract.ATTENTION_MASK, contract.POSITION_IDS) if name in sample}
    for i, layer in enumerate(layers):
        paths[(i, "key")], paths[(i, "value")] = by_id[id(layer.keys)], by_id[id(layer.values)]
    return paths


def _trace(model, sample: dict, ep: EP, model_type: str) -> ir.Model:
    try:
        from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

        exporter = OnnxExporter()
    except ImportError as err:
        raise ExportError(f"transformers.exporters cannot run here ({err}): install onnxscript=={ONNXSCRIPT_VERSION} "
                          "(make install does)") from None
    try:
        exported = exporter.export(model, copy.deepcopy(sample), config=OnnxConfig(dynamic=True, ort_fusions=ep.value))
    except Exception as err:  # torch.export, torch.onnx and onnxscript raise many types: each is this model's trace
        raise ExportError(f"transformers.exporters could not trace {model_type} ({_root_cause(err)}): this model type "
                          "has no hand-built architecture here and its code does not trace with dynamic shapes; "
                          "try another transformers release, or export a model type the exporter builds by hand") from None
    return exported.program


def _map_to_contract(model: ir.Model, paths: dict, kv_heads: int, head_dim: int, value_head_dim: int,
                     model_type: str) -> dict:
    """Rename the traced graph's inputs and outputs to the attn_dynamic contract's, in its order, with its
    declared dims (values at ``value_head_dim``); returns the cache geometry (layers, kv heads, key and value
    head sizes, vocabulary, positions read)."""
    graph = model.graph
    inputs, outputs = {v.name: v for v in graph.inputs}, {v.name: v for v in graph.outputs}

    def find(named: dict, path: str, prefix: str) -> ir.Value | None:
        return named.get(f"{prefix}.{path}", named.get(path))

    layers = sum(1 for key in paths if isinstance(key, tuple)) // 2
    logits = outputs.get(contract.LOGITS)
    if logits is None or logits.shape is None or len(logits.shape) != 3 or not isinstance(logits.shape[2], int):
        raise ExportError(f"the traced {model_type} graph has no logits output [batch, sequence, vocab] (outputs: "
                          f"{', '.join(outputs)}): it is not a causal LM head")
    dtype, vocab = logits.dtype, logits.shape[2]
    first = find(inputs, paths[(0, "key")], "input") if layers else None
    if first is None:
        raise ExportError(f"the traced {model_type} graph takes no past keys (inputs: {', '.join(inputs)}): "
                          "transformers.exporters traced it without its cache")
    new_inputs = []
    for name in (contract.INPUT_IDS, contract.ATTENTION_MASK, contract.POSITION_IDS):
        value = find(inputs, paths[name], "input") if name in paths else None
        if value is None and name == contract.POSITION_IDS:
            # The model computes positions itself (ALiBi from the mask): the contract's input stays, unread,
            # so every runtime feeds every traced export the same way.
            value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64))
        elif value is None:
            raise ExportError(f"the traced {model_type} graph has no {name} input (inputs: {', '.join(inputs)})")
        value.name = name
        value.shape = ir.Shape([contract.BATCH, contract.TOTAL if name == contract.ATTENTION_MASK else contract.SEQ])
        new_inputs.append(value)
    new_outputs = [logits]
    logits.shape = ir.Shape([contract.BATCH, contract.SEQ, vocab])
    for i in range(layers):
        k_in, v_in, k_out, v_out = contract.cache_names(Variant.ATTN_DYNAMIC, i)
        for kind, name_in, name_out, width in (("key", k_in, k_out, head_dim), ("value", v_in, v_out, value_head_dim)):
            path = paths[(i, kind)]
            past, present = find(inputs, path, "input"), find(outputs, path, "output")
            if past is None or present is None or present is past:
                raise ExportError(f"the traced {model_type} graph does not carry layer {i}'s {kind}s from input to "
                                  "output (transformers returned no updated cache): it cannot decode through a past")
            past.name, present.name = name_in, name_out
            past.shape = ir.Shape(contract.cache_dims(Variant.ATTN_DYNAMIC, kv_heads, width))
            present.shape = ir.Shape(contract.cache_dims(Variant.ATTN_DYNAMIC, kv_heads, width, output=True))
            if past.dtype != dtype or present.dtype != dtype:
                raise ExportError(f"the traced {model_type} graph caches layer {i} in {past.dtype} but computes logits in "
                                  f"{dtype}: the contract keeps caches in the model dtype")
            new_inputs.append(past)
            new_outputs.append(present)
    unread = [v.name for v in graph.inputs if v not in new_inputs]
    if unread:
        raise ExportError(f"the traced {model_type} graph takes inputs beyond the attn_dynamic contract "
                          f"({', '.join(unread)}): no runtime of this farm feeds them")
    graph.inputs.clear()
    graph.inputs.extend(new_inputs)
    graph.outputs.clear()  # anything else the model returned (an auxiliary loss) is no output of the contract
    graph.outputs.extend(new_outputs)
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "value_head_dim": value_head_dim,
            "vocab": vocab, "positions": contract.POSITION_IDS in paths}


def _check_positions(request: ExportRequest, config, model_type: str) -> None:
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if request.max_seq_len is not None and isinstance(limit, int) and request.max_seq_len > limit:
        raise ExportError(f"max_seq_len {request.max_seq_len} is above {model_type}'s max_position_embeddings {limit}: "
                          f"use max_seq_len {limit} or less")


def _model_config(config, model_type: str, geometry: dict):
    """The architecture-independent numbers packaging reads (genai_config.json), from transformers'
    config and the traced cache's geometry (the heads the cache really holds: falcon's multi-query)."""
    from exporter.graph.config import ModelConfig, RopeConfig

    text = config.get_text_config(decoder=True)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    limit = getattr(text, "max_position_embeddings", None)
    return ModelConfig(
        architecture=model_type, vocab_size=geometry["vocab"], hidden_size=hidden,
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0), num_layers=geometry["layers"],
        num_heads=heads or geometry["kv_heads"], num_kv_heads=geometry["kv_heads"], head_dim=geometry["head_dim"],
        value_head_dim=geometry["value_head_dim"] if geometry["value_head_dim"] != geometry["head_dim"] else None,
        rms_norm_eps=0.0, max_position_embeddings=limit if isinstance(limit, int) else 0,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        # the traced graph computes its own positions; nothing downstream reads these for it
        rope=RopeConfig("traced", 0.0, 0), attention_bias=False, mlp_bias=False, sliding_window=None, hf_config=config)


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split("\n")[0].split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _root_cause(err: BaseException) -> str:
    """The innermost error of a chain (torch.export wraps the one that says what failed), on one line."""
    while err.__cause__ is not None and err.__cause__ is not err:
        err = err.__cause__
    return _first_line(err)


# --- after the fold -----------------------------------------------------------------------------------


def unquantized_projections(model: ir.Model) -> dict[str, str]:
    """{checkpoint weight: the op that multiplies by it} for every 2-D checkpoint weight a traced graph
    still multiplies in float after the quantize pass: it rewrites ``MatMul(x, W_T)`` on a transposed
    recipe only, and transformers' graphs also multiply through ``Gemm`` (GPT-2's Conv1D, a 2-D
    ``addmm``) and ``com.microsoft::FusedMatMul`` (a tied LM head read as ``transB``)."""
    from exporter.packaging.checkpoint import CheckpointTensor

    found = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in ("MatMul", "Gemm", "FusedMatMul"):
            continue
        for value in node.inputs[:2]:
            tensor = value.const_value if value is not None else None
            if isinstance(tensor, CheckpointTensor) and len(tensor.shape) == 2:
                found[value.name] = f"{node.domain + '::' if node.domain else ''}{node.op_type}"
    return found


def check_traced_quantization(model: ir.Model, decisions: dict | None, dtype: str) -> dict[str, str]:
    """The float projections a quantized traced export keeps (``unquantized_projections``); ExportError
    when the quantize pass found nothing to quantize, which would publish a float model as int4 / int8."""
    kept = unquantized_projections(model)
    if not any(d.get("quantized") for d in (decisions or {}).values()):
        ops = sorted(set(kept.values()))
        raise ExportError(f"none of this traced graph's weights could be quantized to {dtype}: MatMulNBits replaces "
                          f"MatMul(x, W_T) on a checkpoint weight, and transformers.exporters' graph multiplies by its "
                          f"{len(kept)} weights through {', '.join(ops) or 'no MatMul at all'}: export fp32 or fp16")
    return kept
