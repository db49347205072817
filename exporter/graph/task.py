"""The causal-LM task: graph inputs and outputs per variant, and the model around the layers.

Names, dims and cache layouts come from exporter.contract (docs/graph-contracts.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from exporter import contract as io
from exporter.graph.architectures.base import POST_NORM, Architecture
from exporter.graph.components.attention import StepInputs
from exporter.graph.components.decoder import decoder_layer, end_layer, norm
from exporter.graph.components.per_layer_input import per_layer_inputs
from exporter.graph.components.gated_deltanet import LINEAR_ATTENTION
from exporter.graph.components.graph import GraphBuilder, linear
from exporter.graph.components.rotary import (
    MROPE_INTERLEAVED, Rotary, longrope_row_offset, mrope_rotary, mrope_section, rope_constants,
)
from exporter.graph.config import GATED_DELTANET, MAMBA2, ModelConfig, RopeConfig
from exporter.errors import ExportError
from exporter.request import Variant
from exporter.graph.rope import rope_tables

BATCH, SEQ, TOTAL = io.BATCH, io.SEQ, io.TOTAL
I64 = ir.DataType.INT64


def _input(name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))


def _name_output(value: ir.Value, name: str, dtype: ir.DataType, dims: list) -> ir.Value:
    """Name a graph output and stamp its type and shape (never trust op shape inference here)."""
    value.name = name
    value.type = ir.TensorType(dtype)
    value.shape = ir.Shape(dims)
    return value


def _dim_scalar(b: GraphBuilder, x: ir.Value, axis: int) -> ir.Value:
    return b.op("Squeeze", [b.op("Shape", [x], {"start": axis, "end": axis + 1}), b.ints(0)])


def causal_padding_mask(b: GraphBuilder, input_ids: ir.Value, attention_mask: ir.Value, window: int | None = None,
                        chunk: int | None = None) -> ir.Value:
    """bool [batch, 1, seq, total]: key j visible to query i iff j <= its position and not padding
    (and, with a sliding ``window``, j > i - window: padding is on the left, so distances between
    real tokens are the same in padded coordinates; with a ``chunk``, j in i's chunk of positions).

    The diagonal stays visible even for padding queries so no softmax row is empty (no NaN).
    """
    seq, total = _dim_scalar(b, input_ids, 1), _dim_scalar(b, attention_mask, 1)
    one = b.scalar_i64(1)
    q_pos = b.op("Range", [b.op("Sub", [total, seq]), total, one])
    k_pos = b.op("Range", [b.scalar_i64(0), total, one])
    q_col, k_row = b.op("Unsqueeze", [q_pos, b.ints(1)]), b.op("Unsqueeze", [k_pos, b.ints(0)])
    causal = b.op("LessOrEqual", [k_row, q_col])
    if window:
        causal = b.op("And", [causal, b.op("Greater", [k_row, b.op("Sub", [q_col, b.scalar_i64(window)])])])
    if chunk:
        causal = b.op("And", [causal, _same_chunk(b, q_col, k_row, chunk, attention_mask, total)])
    diagonal = b.op("Equal", [k_row, q_col])
    keys = b.op("Unsqueeze", [b.op("Cast", [attention_mask], {"to": ir.DataType.BOOL}), b.ints(1, 2)])
    return b.op("Or", [b.op("And", [causal, keys]), diagonal])


def _same_chunk(b: GraphBuilder, q_col: ir.Value, k_row: ir.Value, chunk: int, attention_mask: ir.Value,
                total: ir.Value) -> ir.Value:
    """bool [batch, 1, seq, total]: key and query in the same chunk of ``chunk`` positions, counted from each row's
    first real token (a left-padded row's padding shifts its coordinates; transformers' chunked mask corrects the
    same way)."""
    padding = b.op("Sub", [total, b.op("ReduceSum", [attention_mask, b.ints(1)], {"keepdims": 0})])
    padding = b.op("Unsqueeze", [padding, b.ints(1, 2, 3)])  # [batch, 1, 1, 1]
    # Shifted by a whole number of chunks so padding keys stay non-negative (integer Div truncates).
    shift = b.op("Sub", [b.scalar_i64(chunk * (1 << 20)), padding])
    size = b.scalar_i64(chunk)
    return b.op("Equal", [b.op("Div", [b.op("Add", [q_col, shift]), size]), b.op("Div", [b.op("Add", [k_row, shift]), size])])


def attention_bias(b: GraphBuilder, mask: ir.Value, num_heads: int) -> ir.Value:
    """A boolean mask as the additive bias MultiHeadAttention takes (compat), [batch, heads, seq, total]:
    0 where visible, the dtype's lowest where not (transformers' own masked value, finite so no row
    ever sums to NaN).

    Expanded to every head: onnxruntime 1.21's CPU MultiHeadAttention reads a bias broadcast over
    heads ([batch, 1, seq, total]) wrongly for every row after the first (measured: row 0 exact,
    row 1 off by up to 4 in the logits). One expanded copy serves all layers."""
    lowest = float(np.finfo(b.dtype.numpy()).min)
    bias = b.op("Where", [mask, b.scalar(0.0), b.scalar(lowest)])
    return b.op("Expand", [bias, b.ints(1, num_heads, 1, 1)])


def static_window_mask(b: GraphBuilder, position_ids: ir.Value, key_cache: ir.Value, window: int) -> ir.Value:
    """attn_static's sliding layers: bool [batch, 1, seq, cache] where cache slot j is visible to the
    query at position p iff p - window < j <= p (slot j holds position j; later slots are not yet
    written, so no count of cached tokens is needed)."""
    slots = b.op("Range", [b.scalar_i64(0), _dim_scalar(b, key_cache, 1), b.scalar_i64(1)])
    k_row = b.op("Unsqueeze", [slots, b.ints(0, 1, 2)])  # [1, 1, 1, cache]
    q_col = b.op("Unsqueeze", [position_ids, b.ints(1, 3)])  # [batch, 1, seq, 1]
    seen = b.op("LessOrEqual", [k_row, q_col])
    return b.op("And", [seen, b.op("Greater", [k_row, b.op("Sub", [q_col, b.scalar_i64(window)])])])


def static_chunk_mask(b: GraphBuilder, position_ids: ir.Value, key_cache: ir.Value, chunk: int) -> ir.Value:
    """attn_static's chunked layers: bool [batch, 1, seq, cache] where cache slot j is visible to the query at
    position p iff j <= p and j // chunk == p // chunk (slot j holds position j)."""
    slots = b.op("Range", [b.scalar_i64(0), _dim_scalar(b, key_cache, 1), b.scalar_i64(1)])
    k_row = b.op("Unsqueeze", [slots, b.ints(0, 1, 2)])  # [1, 1, 1, cache]
    q_col = b.op("Unsqueeze", [position_ids, b.ints(1, 3)])  # [batch, 1, seq, 1]
    size = b.scalar_i64(chunk)
    same = b.op("Equal", [b.op("Div", [k_row, size]), b.op("Div", [q_col, size])])
    return b.op("And", [b.op("LessOrEqual", [k_row, q_col]), same])


def state_layout(cfg: ModelConfig, dtype: ir.DataType, key_major: bool = False) -> list[tuple[str, ir.DataType, list]]:
    """(kind, dtype, dims) of each state a recurrent layer of ``cfg`` carries, in graph order: the
    convolution's in the model dtype, gated DeltaNet's recurrence in fp32 (GatedDeltaNet's state type,
    and what transformers keeps); ``key_major``: LinearAttention's [.., key_dim, value_dim]."""
    rc = cfg.recurrent
    layout = [(io.CONV_STATE, dtype, io.state_dims(io.CONV_STATE, taps=rc.conv_kernel, channels=rc.channels))]
    if rc.kind == GATED_DELTANET:
        layout.append((io.RECURRENT_STATE, ir.DataType.FLOAT, io.state_dims(
            io.RECURRENT_STATE, heads=rc.value_heads, key_dim=rc.key_dim, value_dim=rc.value_dim, key_major=key_major)))
    elif rc.kind == MAMBA2:  # [batch, heads, head_dim, d_state]: GatedDeltaNet's layout is transformers' here
        layout.append((io.SSM_STATE, ir.DataType.FLOAT, io.state_dims(
            io.SSM_STATE, heads=rc.value_heads, key_dim=rc.key_dim, value_dim=rc.value_dim)))
    return layout


def step_token_mask(b: GraphBuilder, input_ids: ir.Value, attention_mask: ir.Value) -> ir.Value:
    """[batch, seq, 1] in the model dtype: 1 where this step's token is real, 0 at padding (the mask's
    last seq columns)."""
    seq = b.op("Shape", [input_ids], {"start": 1, "end": 2})
    step_mask = b.op("Slice", [attention_mask, b.op("Neg", [seq]), b.ints(2**62), b.ints(1)])
    return b.op("Unsqueeze", [b.op("Cast", [step_mask], {"to": b.dtype}), b.ints(2)])


def gqa_lengths(b: GraphBuilder, attention_mask: ir.Value, step: StepInputs) -> ir.Value:
    """GroupQueryAttention's per-row ``seqlens_k`` (real tokens - 1, int32) and ``total_sequence_length``
    (the mask's width, int32 scalar), from the attention mask; returns the per-row lengths (int64)."""
    lengths = b.op("ReduceSum", [attention_mask, b.ints(1)], {"keepdims": 0})
    step.seqlens_k = b.op("Cast", [b.op("Sub", [lengths, b.scalar_i64(1)])], {"to": ir.DataType.INT32})
    step.total_seq_len = b.op("Cast", [_dim_scalar(b, attention_mask, 1)], {"to": ir.DataType.INT32})
    return lengths


def _rotary(b: GraphBuilder, cfg: ModelConfig, rope: RopeConfig, table_len: int, variant: Variant,
            lengths: ir.Value | None, position_ids: ir.Value | None, mrope: bool = False) -> Rotary:
    """cos/sin tables of ``rope`` and this step's way into them (longrope picks its half in-graph)."""
    tables = rope_tables(cfg, table_len, rope, b.rope_cache)
    cos, sin = rope_constants(b, tables, rope.layer_type)
    section = mrope_section(rope) if mrope else None
    if section is not None:  # every variant takes position_ids [3, batch, seq] and rotates per token
        if sum(section) * 2 != rope.rotary_dim or len(section) != 3 or tables.switch_at is not None or cfg.rotary_interleaved:
            raise ExportError(f"{cfg.architecture}'s mrope_section {list(section)} is exported as three sections "
                              f"filling half the rotary dims ({rope.rotary_dim // 2}) of a rope without longrope: fix "
                              "config.json's rope_parameters")
        interleaved = {cfg.architecture, getattr(cfg.hf_config, "model_type", None)} & set(MROPE_INTERLEAVED)
        return mrope_rotary(b, cos, sin, position_ids, section, rope.rotary_dim, cfg.head_dim,
                            interleaved=bool(interleaved))
    rotary = Rotary(cos, sin, rope.rotary_dim, cfg.head_dim, interleaved=cfg.rotary_interleaved)
    if variant is Variant.GQA:
        if tables.switch_at is not None:
            # The longest real sequence, not the mask width: with a shared max-length buffer the mask
            # is as wide as the buffer while the tokens seen are far fewer. Where (not Slice: its
            # starts would pull the index math onto the CPU and block CUDA graph capture).
            longest = b.op("ReduceMax", [lengths], {"keepdims": 0})
            use_long = b.op("Greater", [longest, b.scalar_i64(tables.switch_at)])
            half = tables.table_len
            short = [b.op("Slice", [t, b.ints(0), b.ints(half), b.ints(0)]) for t in (cos, sin)]
            long_ = [b.op("Slice", [t, b.ints(half), b.ints(2 * half), b.ints(0)]) for t in (cos, sin)]
            rotary.cos = b.op("Where", [use_long, long_[0], short[0]])
            rotary.sin = b.op("Where", [use_long, long_[1], short[1]])
        return rotary
    rotary.position_ids = position_ids
    if tables.switch_at is not None:
        longest = b.op("Add", [b.op("ReduceMax", [position_ids], {"keepdims": 0}), b.scalar_i64(1)])
        rotary.position_ids = b.op("Add", [position_ids, longrope_row_offset(b, longest, tables)])
    return rotary


def build_graph(
    b: GraphBuilder,
    arch: Architecture,
    cfg: ModelConfig,
    variant: Variant,
    table_len: int,
    max_seq_len: int | None,
    on_layer=None,
    inputs_embeds: bool = False,
    deepstack: int = 0,
) -> ir.Graph:
    """The decoder graph of ``variant``; ``inputs_embeds``: it takes the embeddings (an image-text export's
    embedding graph merges image features into them) where a text export takes ``input_ids``. ``deepstack``
    (Qwen3-VL's): the embeddings are hidden x (1 + deepstack) wide (contract.image_text_width), the hidden states
    first, then one deepstack map per slice, which the decoder adds after its layers 0 .. deepstack - 1."""
    dtype = b.dtype
    # The compat target's attention takes the mask as an additive bias; the current one a boolean.
    as_mask = (lambda mask: attention_bias(b, mask, cfg.num_heads)) if b.target.contrib_ops else (lambda mask: mask)
    if inputs_embeds and cfg.per_layer_input:
        raise ExportError(f"{cfg.architecture} reads its token ids inside the decoder (per-layer inputs): it cannot "
                          "take inputs_embeds")
    if deepstack and (not inputs_embeds or deepstack > cfg.num_layers or cfg.per_layer_input
                      or arch.norm_layout == POST_NORM):
        raise ExportError(f"{deepstack} deepstack maps are added after the first layers of a pre-norm decoder taking "
                          f"inputs_embeds; {cfg.architecture} here has {cfg.num_layers} layers, norm layout "
                          f"{arch.norm_layout}: no Qwen3-VL checkpoint is built so")
    # (the masks read only the sequence length off it: axis 1 of either input)
    input_ids = (_input(io.INPUTS_EMBEDS, dtype, [BATCH, SEQ, io.image_text_width(cfg.hidden_size, deepstack)])
                 if inputs_embeds else _input(io.INPUT_IDS, I64, [BATCH, SEQ]))
    inputs = [input_ids]
    step = StepInputs(rotary=None)
    lengths = position_ids = attention_mask = None
    # M-RoPE (qwen2_5_vl's language model): position_ids [3, batch, seq] in every variant, gqa's too. Only where the
    # decoder takes images' embeddings: a text-only export of a model with M-RoPE (qwen3_5's language model) sees
    # text alone, whose three position streams are equal, and takes plain positions (its rope the plain partial one).
    mrope = inputs_embeds and mrope_section(cfg.rope) is not None
    if mrope and variant is Variant.ATTN_STATIC and any(cfg.window(i) or cfg.chunk(i) for i in range(cfg.num_layers)):
        raise ExportError(f"{cfg.architecture}'s sliding layers under attn_static find their window from position_ids "
                          "as cache slots, which M-RoPE's positions are not: use the attn_dynamic or gqa variant")
    if variant is Variant.GQA:
        attention_mask = _input(io.ATTENTION_MASK, I64, [BATCH, TOTAL])
        inputs.append(attention_mask)
        lengths = gqa_lengths(b, attention_mask, step)
        if mrope:
            position_ids = _input(io.POSITION_IDS, I64, io.position_ids_dims(mrope))
            inputs.append(position_ids)
    else:
        position_ids = step.position_ids = _input(io.POSITION_IDS, I64, io.position_ids_dims(mrope))
        if variant is Variant.ATTN_DYNAMIC:
            attention_mask = _input(io.ATTENTION_MASK, I64, [BATCH, TOTAL])
            inputs += [attention_mask, position_ids]
            step.attn_mask = as_mask(causal_padding_mask(b, input_ids, attention_mask))
        else:
            inputs.append(position_ids)

    # attn_static: [batch, positions, kv_heads*head_dim] (BSNH), the layout the attention kernels read
    # natively; the runtime picks the buffer length (at most max_seq_len: the rope table covers that).
    # Per layer: gemma4's global layers have their own head size and KV heads.
    def cache_dims(i: int, output: bool = False) -> list:
        own = cfg.for_layer(i)
        return io.cache_dims(variant, own.num_kv_heads, own.head_dim, output=output)

    caches_in = []
    key_major = b.deltanet_op == LINEAR_ATTENTION
    for i in range(cfg.num_layers):
        # An attention layer's KV cache, a recurrent layer's states (falcon_h1's parallel layers: both, in that
        # order); nemotron_h's MLP / experts blocks and gemma4's KV-shared layers carry nothing.
        layer = ()
        if cfg.has_cache(i):
            names = io.cache_names(variant, i)
            layer += (_input(names[0], dtype, cache_dims(i)), _input(names[1], dtype, cache_dims(i)))
        if cfg.is_recurrent(i):
            layer += tuple(_input(io.state_names(i, kind)[0], dt, dims) for kind, dt, dims in state_layout(cfg, dtype, key_major))
        caches_in.append(layer)
        inputs += caches_in[-1]
    if variant is Variant.ATTN_STATIC:
        step.write_indices = _input(io.WRITE_INDICES, I64, [BATCH])
        step.nonpad_kv_seqlen = _input(io.NONPAD_KV_SEQLEN, I64, [BATCH])
        inputs += [step.write_indices, step.nonpad_kv_seqlen]

    # Each kind of layer (its rope, whether it has one, its window) gets one set of step inputs.
    rotaries: dict[RopeConfig, Rotary] = {}
    masks: dict[int, ir.Value] = {}
    layer_steps: dict[tuple, StepInputs] = {}

    def step_for(i: int) -> StepInputs:
        rope, window, chunk = (cfg.layer_rope(i) if cfg.uses_rope(i) else None), cfg.window(i), cfg.chunk(i)
        if (rope, window, chunk) not in layer_steps:
            if rope is not None and rope not in rotaries:  # (a rope per layer type: the head size of its layers)
                rotaries[rope] = _rotary(b, cfg.for_layer(i), rope, table_len, variant, lengths, position_ids, mrope)
            extra = {"rotary": rotaries.get(rope), "window": window}
            if chunk and variant is Variant.GQA:
                raise ExportError(f"{cfg.architecture}'s chunked attention (attention_chunk_size {chunk}) has no "
                                  "GroupQueryAttention form (its local window slides, a chunk does not): use the "
                                  "attn_dynamic or attn_static variant")
            if chunk and variant is Variant.ATTN_DYNAMIC:
                extra["attn_mask"] = as_mask(causal_padding_mask(b, input_ids, attention_mask, chunk=chunk))
            elif chunk and variant is Variant.ATTN_STATIC:
                extra["window_mask"] = static_chunk_mask(b, position_ids, caches_in[cfg.attention_layers[0]][0], chunk)
            if window and variant is Variant.ATTN_DYNAMIC:
                if window not in masks:
                    masks[window] = as_mask(causal_padding_mask(b, input_ids, attention_mask, window))
                extra["attn_mask"] = masks[window]
            elif window and variant is Variant.ATTN_STATIC:
                if window not in masks:
                    masks[window] = static_window_mask(b, position_ids, caches_in[cfg.attention_layers[0]][0], window)
                extra["window_mask"] = masks[window]
            layer_steps[(rope, window, chunk)] = dataclasses.replace(step, **extra)
        return layer_steps[(rope, window, chunk)]

    if cfg.recurrent is not None and variant is Variant.ATTN_DYNAMIC:
        # Left-padded rows: the recurrent layers zero their input at this step's padding.
        step.token_mask = step_token_mask(b, input_ids, attention_mask)

    embed = b.weight(arch.embed_tokens) if cfg.tie_word_embeddings or not inputs_embeds else None
    if cfg.tie_word_embeddings:
        # One [hidden, vocab] copy serves both ends: the LM head's MatMul reads it as is and the
        # embedding gathers its columns, instead of storing the table twice (file and device memory).
        embed_t = b.op("Transpose", [embed], {"perm": [1, 0]})
    deepstack_maps = []
    if inputs_embeds and deepstack:  # [hidden states | map 0 | ... ], each hidden wide; a text token's maps are zeros
        x, *deepstack_maps = b.op_multi("Split", [input_ids, b.ints(*[cfg.hidden_size] * (1 + deepstack))],
                                        {"axis": -1}, num_outputs=1 + deepstack)
    elif inputs_embeds:
        x = input_ids  # embedded and scaled already, by the embedding graph
    elif cfg.tie_word_embeddings:
        x = b.op("Transpose", [b.op("Gather", [embed_t, input_ids], {"axis": 1})], {"perm": [1, 2, 0]})
    else:
        x = b.op("Gather", [embed, input_ids], {"axis": 0})
    if cfg.embedding_scale is not None and cfg.embedding_scale != 1.0 and not inputs_embeds:
        x = b.op("Mul", [x, b.scalar(cfg.embedding_scale)])  # gemma: sqrt(hidden); granite: its multiplier
    per_layer = per_layer_inputs(b, arch, cfg, input_ids, x) if cfg.per_layer_input else None
    outputs = []
    post_norm = arch.norm_layout == POST_NORM
    h = x if post_norm else norm(b, arch, x, arch.names(0)["input_norm"], cfg.rms_norm_eps)
    shared_kv = {}  # gemma4: each layer's keys and values, for the layers that share them
    for i in range(cfg.num_layers):
        mlp_out, x, cache_out = decoder_layer(b, h, x, arch, cfg.for_layer(i), i, variant, step_for(i), caches_in[i],
                                              shared_kv)
        last = i + 1 == cfg.num_layers
        if post_norm and not last:
            x = h = b.op("Add", [x, mlp_out])
        else:
            next_norm = arch.final_norm if last else arch.names(i + 1)["input_norm"]
            if i < len(deepstack_maps):
                # transformers' _deepstack_process: the layer's output, then map i added at the image positions (the
                # map is zeros at text positions, so adding it everywhere is that masked add), before the next norm
                x, mlp_out = b.op("Add", [x, mlp_out]), deepstack_maps[i]
            h, x = end_layer(b, arch, cfg, i, x, mlp_out, next_norm, per_layer)
        if cfg.has_cache(i):
            names = io.cache_names(variant, i)
            outputs += [
                _name_output(cache_out[0], names[2], dtype, cache_dims(i, output=True)),
                _name_output(cache_out[1], names[3], dtype, cache_dims(i, output=True)),
            ]
            cache_out = cache_out[2:]
        if cfg.is_recurrent(i):
            outputs += [_name_output(value, io.state_names(i, kind)[1], dt, dims)
                        for value, (kind, dt, dims) in zip(cache_out, state_layout(cfg, dtype, key_major))]
        if on_layer:
            on_layer(i + 1, cfg.num_layers)
    if cfg.tie_word_embeddings:
        head = b.op("MatMul", [h, embed_t])
    else:
        head = linear(b, h, b.weight(arch.lm_head), b.weight(arch.lm_head_bias) if cfg.lm_head_bias else None)
    if cfg.logits_divisor is not None and cfg.logits_divisor != 1.0:
        head = b.op("Div", [head, b.scalar(cfg.logits_divisor)])  # granite's logits_scaling
    if cfg.final_softcap:
        cap = b.scalar(cfg.final_softcap)
        head = b.op("Mul", [b.op("Tanh", [b.op("Div", [head, cap])]), cap])
    logits = _name_output(head, io.LOGITS, dtype, [BATCH, SEQ, cfg.vocab_size])
    return ir.Graph(
        inputs,
        [logits, *outputs],
        nodes=b.tape.nodes,
        initializers=b.tape.initializers,
        opset_imports={"": b.target.opset, "com.microsoft": 1},
        name=f"{cfg.architecture}_{variant.value}",
    )
