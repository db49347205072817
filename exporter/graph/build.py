"""Stage 2: config.json + lazy weights -> an onnx-ir model of the requested variant."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx_ir as ir

from exporter import __version__, contract
from exporter.graph.architectures import ARCHITECTURES
from exporter.graph.architectures.base import Architecture
from exporter.packaging.checkpoint import Checkpoint
from exporter.graph.components.graph import GraphBuilder
from exporter.graph.config import ModelConfig, load_model_config
from exporter.errors import ExportError
from exporter.request import DType, ExportRequest, Variant
from exporter.packaging.resolve import ResolvedSource
from exporter.graph.task import build_graph

IR_DTYPES = {DType.FP32: ir.DataType.FLOAT, DType.FP16: ir.DataType.FLOAT16, DType.BF16: ir.DataType.BFLOAT16}
# Graph-wide metadata the runtime drivers read back (model.onnx is self-describing).


@dataclasses.dataclass
class BuildResult:
    model: ir.Model
    config: ModelConfig
    architecture: Architecture
    variant: Variant
    checkpoint: Checkpoint
    activations: DType  # what the graph computes in (request.activations_for the checkpoint)


def check_request_against_config(request: ExportRequest, variant: Variant, cfg: ModelConfig) -> None:
    """Refuse what this checkpoint cannot do, before any graph is built."""
    if request.max_seq_len is not None and request.max_seq_len > cfg.max_position_embeddings:
        raise ExportError(
            f"max_seq_len {request.max_seq_len} is above the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}: use max_seq_len {cfg.max_position_embeddings} or less"
        )
    if variant is Variant.GQA:
        for i in range(cfg.num_layers):
            if not cfg.uses_rope(i):
                continue
            half = cfg.layer_rope(i).rotary_dim // 2
            if half % 8 or half > cfg.head_dim // 2:
                raise ExportError(
                    f"GroupQueryAttention's fused rotary needs rotary_dim / 2 to be a multiple of 8 and at most "
                    f"head_dim / 2; layer {i} of this model rotates {2 * half} of {cfg.head_dim} dims "
                    f"(rotary_dim / 2 = {half}): use --variant attn_dynamic or attn_static, which apply rotary "
                    "with RotaryEmbedding"
                )


def build_model(request: ExportRequest, source: ResolvedSource, on_layer=None, rope_cache: Path | None = None) -> BuildResult:
    """config.json + lazy weights -> the variant's graph; ``rope_cache`` keeps rope tables between exports."""
    variant = request.resolved_variant()
    cfg = load_model_config(source.path, ARCHITECTURES)
    check_request_against_config(request, variant, cfg)
    arch = ARCHITECTURES[cfg.architecture]
    checkpoint = Checkpoint(source.path)
    activations = request.activations_for(source.path)
    builder = GraphBuilder(checkpoint, IR_DTYPES[activations], rope_cache)
    table_len = request.max_seq_len or cfg.max_position_embeddings
    graph = build_graph(builder, arch, cfg, variant, table_len, request.max_seq_len, on_layer)
    model = ir.Model(graph, ir_version=11, producer_name="exportfarm", producer_version=__version__)
    model.metadata_props.update(
        {
            contract.META_VARIANT: variant.value,
            contract.META_DTYPE: request.dtype.value,
            contract.META_EP: request.ep.value,
            contract.META_CONFIG: json.dumps(
                {
                    "architecture": cfg.architecture,
                    "num_layers": cfg.num_layers,
                    "num_heads": cfg.num_heads,
                    "num_kv_heads": cfg.num_kv_heads,
                    "head_dim": cfg.head_dim,
                    "vocab_size": cfg.vocab_size,
                    "max_seq_len": request.max_seq_len,
                    "context_length": table_len,
                    "sliding_window": cfg.sliding_window,
                    "sliding_layers": [i for i in range(cfg.num_layers) if cfg.window(i)],
                    "activations": activations.value,
                    **({"quant": request.quant.to_dict()} if request.quant else {}),
                }
            ),
        }
    )
    return BuildResult(model, cfg, arch, variant, checkpoint, activations)
