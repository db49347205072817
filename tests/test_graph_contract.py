"""The graph contracts of docs/graph-contracts.md, read back from the written model.onnx."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from exporter.graph.architectures import ARCHITECTURES as ARCHITECTURE_REGISTRY
from exporter.graph.config import load_model_config
from tests.conftest import ARCHITECTURES, MAX_SEQ_LEN, VARIANTS


def _load(export_dir):
    return onnx.load(str(export_dir / "model.onnx"), load_external_data=False)


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _io(model):
    return {v.name: v for v in model.graph.input}, {v.name: v for v in model.graph.output}


def test_attn_dynamic_contract(exported):
    model = _load(exported("llama", "attn_dynamic"))
    inputs, outputs = _io(model)
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert _dims(inputs["past_key_values.0.key"]) == ["batch_size", 2, "past_sequence_length", 16]
    assert _dims(outputs["present.1.value"]) == ["batch_size", 2, "total_sequence_length", 16]
    assert _dims(outputs["logits"]) == ["batch_size", "sequence_length", 256]
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(attention) == 2 and all(n.input[3] for n in attention)  # explicit mask input


def test_gqa_contract_and_stamped_present_shapes(exported):
    model = _load(exported("qwen3", "gqa"))
    inputs, outputs = _io(model)
    assert "position_ids" not in inputs  # rotary is fused into the op
    for i in range(2):
        for kind in ("key", "value"):
            past, present = _dims(inputs[f"past_key_values.{i}.{kind}"]), _dims(outputs[f"present.{i}.{kind}"])
            # Same batch, heads and head_dim; only the sequence axis grows (GQA's inference gets head_dim wrong).
            assert present[:2] + present[3:] == past[:2] + past[3:] == ["batch_size", 2, 16]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.domain == "com.microsoft" for n in gqa)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}
    assert attrs["do_rotary"] == 1 and attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 2


@pytest.mark.parametrize("arch", ["llama", "phimoe"])
def test_fused_residual_norms_leave_their_statistics_outputs_unnamed(arch, exported):
    """Mean and inverse std (outputs 1, 2) are training's: unnamed, the kernel skips them (issue 30's
    CPU profile: 40% of the op's time); the normed output and the residual sum stay."""
    norms = [n for n in _load(exported(arch, "gqa")).graph.node
             if n.op_type in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")]
    assert norms and all(list(n.output[1:3]) == ["", ""] and n.output[0] and n.output[3] for n in norms)


def test_gqa_packs_qkv_into_one_initializer(exported):
    model = _load(exported("llama", "gqa"))
    names = {i.name for i in model.graph.initializer}
    assert "model.layers.0.self_attn.q_k_v_proj.weight.T" in names
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in names)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_attn_static_contract(arch, exported, checkpoint):
    model = _load(exported(arch, "attn_static"))
    inputs, outputs = _io(model)
    assert "attention_mask" not in inputs
    assert _dims(inputs["key_cache.0"]) == _dims(outputs["updated_key_cache.0"]) == ["batch_size", "max_seq_len", 32]
    config = json.loads({p.key: p.value for p in model.metadata_props}["exportfarm.config"])
    assert config["max_seq_len"] == MAX_SEQ_LEN
    assert _dims(inputs["write_indices"]) == _dims(inputs["nonpad_kv_seqlen"]) == ["batch_size"]
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"If", "Loop", "Scan"}
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    windowed = [n for n in attention if len(n.input) > 3 and n.input[3]]
    for node in attention:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node in windowed:  # a sliding layer: the in-graph window mask, no causal flag, no count
            assert attrs["is_causal"] == 0 and len(node.input) == 4
        else:
            assert attrs["is_causal"] == 1
            assert node.input[3] == "" and node.input[6] == "nonpad_kv_seqlen"  # no mask; count after scatter
    cfg = load_model_config(checkpoint(arch), ARCHITECTURE_REGISTRY)
    assert len(windowed) == sum(cfg.window(i) is not None for i in range(cfg.num_layers))
    assert sum(n.op_type == "TensorScatter" for n in model.graph.node) == 4
    assert {o.domain or "": o.version for o in model.opset_import}[""] == 24


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_build_has_no_float32_initializer(variant, exported):
    model = _load(exported("phi3", variant, "fp16"))
    fp32 = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert fp32 == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_unused_initializers(variant, exported):
    model = _load(exported("qwen2", variant))
    used = {name for node in model.graph.node for name in node.input}
    assert [i.name for i in model.graph.initializer if i.name not in used] == []


def test_onnx_checker_passes_with_external_data(exported):
    for variant in VARIANTS:
        onnx.checker.check_model(str(exported("qwen3", variant) / "model.onnx"), full_check=False)


def test_manifest_records_what_the_issue_asks(exported):
    export_dir = exported("qwen2", "attn_static")
    manifest = json.loads((export_dir / "manifest.json").read_text())
    assert manifest["variant"] == "attn_static"
    assert manifest["request"]["max_seq_len"] == MAX_SEQ_LEN
    assert manifest["source"]["kind"] == "local" and manifest["source"]["revision"].startswith("local-")
    for name in ("model.onnx", "model.onnx.data"):
        from exporter.packaging.package import sha256_file

        entry = manifest["files"][name]
        assert entry["sha256"] == sha256_file(export_dir / name)
        assert entry["size"] == (export_dir / name).stat().st_size
    for package in ("exporter", "onnx", "onnx-ir", "onnxruntime", "torch", "transformers"):
        assert manifest["versions"][package], package
    assert manifest["opset_imports"][""] == 24
    assert manifest["op_census"]["TensorScatter"] == 4
    assert {i["name"] for i in manifest["graph"]["inputs"]} >= {"input_ids", "write_indices", "nonpad_kv_seqlen"}
    logits = next(o for o in manifest["graph"]["outputs"] if o["name"] == "logits")
    assert logits == {"name": "logits", "dtype": "FLOAT", "shape": ["batch_size", "sequence_length", 256]}
    assert len(manifest["cache_key"]) == 64


def test_an_export_whose_values_are_as_wide_as_its_keys_names_one_head_size(exported):
    """contract.VALUE_HEAD_DIM is written only where the values' head size differs from the keys' (a traced
    latent-attention cache: tests/test_traced.py); a hand-built export's metadata and manifest are as they were."""
    from exporter.contract import (
        MANIFEST_CACHE, VALUE_HEAD_DIM, cache_kind, head_dim_entries, split_cache, value_head_dim,
    )
    from exporter.runtime.session import read_metadata

    export_dir = exported("llama", "attn_dynamic")
    config = read_metadata(export_dir / "model.onnx")["config"]
    assert VALUE_HEAD_DIM not in config and not split_cache(config) and value_head_dim(config) == config["head_dim"]
    assert MANIFEST_CACHE not in json.loads((export_dir / "manifest.json").read_text())
    assert head_dim_entries(16, 16) == head_dim_entries(16) == {"head_dim": 16}
    assert head_dim_entries(512, 64) == {"head_dim": 512, VALUE_HEAD_DIM: 64} and split_cache(head_dim_entries(512, 64))
    names = ("past_key_values.0.value", "present.3.key", "value_cache.1", "updated_key_cache.0")
    assert [cache_kind(name) for name in names] == ["value", "key", "value", "key"]


def test_packed_weights_hold_the_checkpoint_values(exported, checkpoint):
    """Read model.onnx.data back: each slice of the packed, transposed QKV is its source tensor."""
    from safetensors.numpy import load_file

    export_dir = exported("qwen2", "gqa")
    source = load_file(str(checkpoint("qwen2") / "model.safetensors"))
    model = onnx.load(str(export_dir / "model.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    packed = inits["model.layers.1.self_attn.q_k_v_proj.weight.T"]
    q, k, v = (source[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    np.testing.assert_array_equal(packed, np.concatenate([q, k, v]).T)
    bias = inits["model.layers.1.self_attn.q_k_v_proj.bias"]
    np.testing.assert_array_equal(bias, np.concatenate([source[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]))


def test_the_dtype_table_matches_onnx_onnx_ir_and_onnxruntime():
    import ml_dtypes
    import onnx_ir as ir

    from exporter.contract import DTYPES, numpy_of_ort

    for name, onnx_type, ir_type, np_type in [("fp32", onnx.TensorProto.FLOAT, ir.DataType.FLOAT, np.float32),
                                                ("fp16", onnx.TensorProto.FLOAT16, ir.DataType.FLOAT16, np.float16),
                                                ("bf16", onnx.TensorProto.BFLOAT16, ir.DataType.BFLOAT16, ml_dtypes.bfloat16)]:
        entry = DTYPES[name]
        assert entry.onnx == onnx_type and entry.ir == ir_type and entry.numpy == np_type
        assert numpy_of_ort(entry.ort) == np_type
    with pytest.raises(ValueError, match="tensor"):
        numpy_of_ort("tensor(float8e4m3fn)")
