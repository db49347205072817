"""What an export job needs before it starts: host memory, GPU memory and disk, from config.json.

A job that needs more than its worker has must be refused before it is claimed (a worker killed
for memory would be retried MAX_ATTEMPTS times for nothing), and a job no worker class can ever
run must be refused by the API. ``estimate_resources`` predicts each stage's peak from the
model's geometry and the request, term by term, each term named so a refusal can say what it is:

- host memory (resident, anonymous: what the kernel cannot drop under pressure) is the worker's
  own process (Python, torch, transformers, onnxruntime, CUDA), plus the largest of
  - the export: a few bounded blocks, whatever the model's size, and the rope tables (positions x
    rotary width, in fp32 and in the export's activations);
  - validation: the export's own session where it holds weights on the host (the CPU EP makes
    fp32 copies of fp16 / bf16 weights, 4 bytes a parameter, and repacks quantized ones), the
    streamed reference (one decoder layer in fp32, two while the next is read ahead on a GPU, a
    block of LM-head rows, the logits it returns; a GPTQ / AWQ checkpoint's linear or block of
    one beside its codes while it is decoded), the weight check's blocks, the quality
    gate's logits; parity holds the session and the reference at once, the quality gate one
    after the other;
  - the benchmark (CPU EP: a serving session, weights repacked);
- GPU memory (CUDA EP): the export's weights with onnxruntime's allocator overhead, the CUDA
  context, the caches the benchmark fills, and the streamed reference where torch runs on that GPU;
- disk: the checkpoint when it is downloaded, the export (its size follows from the shapes the
  exporter writes, tested against real exports), a local store's copy, the reference and rope caches.

``benchmarks/scale.py`` measures the same stages on depth-truncated checkpoints of real
geometries (8B, 32B, 70B) and prints these predictions beside the measured peaks.
"""

from __future__ import annotations

import dataclasses
import math

from exporter.graph.config import GATED_DELTANET, MAMBA2, ModelConfig
from exporter.packaging.prequantized import decode_bytes, read_format
from exporter.request import DType, EP, ExportRequest, QuantSpec, activation_dtype
from exporter.validation.gates.quality import MAX_TOKENS as QUALITY_TOKENS, WINDOW as QUALITY_WINDOW
from exporter.validation.streamed import VOCAB_BLOCK_BYTES  # the LM head's blocks, two at once
from exporter.validation.validate import PARITY_PROMPT_LEN, PARITY_STEPS

GiB = 1024 ** 3
_BYTES = {DType.FP32: 4, DType.FP16: 2, DType.BF16: 2}

# The worker process before any job (Python, torch, transformers, onnxruntime, the farm), and on a
# GPU the CUDA context, cuDNN and cuBLAS handles on the host. Measured 0.22 GiB here (CPU) and about
# 1 GiB on the H200 host; rounded up.
PROCESS_HOST = {EP.CPU: 0.5 * GiB, EP.CUDA: 1.5 * GiB}
# What the export stage holds beyond that: its writer's queue of bounded blocks (0.49 GB RssAnon for
# an 8B fp16 export on the H200, all of it included).
EXPORT_HOST = 0.75 * GiB
# The weight check: a few blocks per thread (up to 16 threads, 80-90 MiB each measured on 4 layers of
# the 8B geometry in int4) and float64 statistics on slices that are not bit-exact; measured on the
# 16-core H200 host with 8 threads and the heavier statistics of before, an int4 check held about 2 GiB.
WEIGHT_CHECK_HOST = 2 * GiB
# onnxruntime's CUDA allocator rounds every allocation up, and the CUDA context and cuBLAS
# workspaces come on top: 16.8 GB of GPU memory held for the 16 GB of an 8B fp16 export.
CUDA_WEIGHT_OVERHEAD, CUDA_CONTEXT = 1.06, 1.5 * GiB
# Validation's sequences: parity's prompt and steps; the quality gate's windows of text.
PARITY_TOKENS = PARITY_PROMPT_LEN + PARITY_STEPS
# Decode steps and warm-up the benchmark adds to each context's buffer.
BENCH_EXTRA_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Parameter counts of a decoder-only model, from its config."""

    embedding: int  # vocab x hidden
    lm_head: int  # vocab x hidden; 0 where the checkpoint ties it to the embedding (one table serves both)
    layer: int  # the projections of the largest decoder layer (norms and biases are a rounding error)
    layers: int
    kv_per_token: int  # key + value elements one token adds to the cache, over every layer
    all_layers: int  # every layer's projections (layers differ: experts or a dense MLP)

    @classmethod
    def of(cls, config: ModelConfig) -> Geometry:
        sizes = [sum(k * n for k, n, _ in layer_matmuls(config, i)) for i in range(config.num_layers)]
        head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
        return cls(config.vocab_size * config.hidden_size, head, max(sizes), config.num_layers,
                   config.num_layers * (config.kv_size + config.value_size), sum(sizes))

    @property
    def parameters(self) -> int:
        return self.embedding + self.lm_head + self.all_layers


@dataclasses.dataclass(frozen=True)
class ResourceEstimate:
    """Peak needs of one job, in bytes, with the terms they are made of."""

    host_bytes: int
    gpu_bytes: int
    disk_bytes: int
    export_bytes: int  # model.onnx.data
    terms: dict[str, dict[str, int]]  # {"host": {term: bytes}, "gpu": {...}, "disk": {...}}

    def to_dict(self) -> dict:
        return {"host_gib": _gib(self.host_bytes), "gpu_gib": _gib(self.gpu_bytes), "disk_gib": _gib(self.disk_bytes),
                "export_gib": _gib(self.export_bytes),
                "terms_gib": {k: {t: _gib(v) for t, v in terms.items()} for k, terms in self.terms.items()}}

    def shortfalls(self, capacity: Capacity) -> list[str]:
        """What ``capacity`` lacks for this job, one phrase each (empty: it fits)."""
        found = []
        for what, need, have in (("host memory", self.host_bytes, capacity.host_bytes),
                                 ("GPU memory", self.gpu_bytes, capacity.gpu_bytes),
                                 ("disk", self.disk_bytes, capacity.disk_bytes)):
            if need and have is not None and need > have:
                found.append(f"{_gib(need)} GiB {what} ({self.largest(what)}), {capacity.holder} has {_gib(have)} GiB")
        return found

    def largest(self, what: str) -> str:
        """The two biggest terms of one resource, as words."""
        key = {"host memory": "host", "GPU memory": "gpu", "disk": "disk"}[what]
        top = sorted(self.terms.get(key, {}).items(), key=lambda kv: -kv[1])[:2]
        return ", ".join(f"{name} {_gib(value)}" for name, value in top)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a worker (or a worker class) has; None: not known, not limiting."""

    holder: str  # "this worker", "worker class gpu", ...
    host_bytes: int | None = None
    gpu_bytes: int | None = None
    disk_bytes: int | None = None

    def to_dict(self) -> dict:
        return {"holder": self.holder, "host_gib": _gib(self.host_bytes), "gpu_gib": _gib(self.gpu_bytes),
                "disk_gib": _gib(self.disk_bytes)}


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GiB, 1)


def export_bytes(config: ModelConfig, request: ExportRequest) -> int:
    """The size of model.onnx.data the exporter writes for ``request`` (within a fraction of a
    percent: norms, biases and small constants are left out)."""
    geometry = Geometry.of(config)
    dtype, ep = request.dtype, request.ep
    act = _BYTES[activation_dtype(dtype, ep)]
    rope = _rope_bytes(config, request, act)
    if not dtype.quantized:
        return geometry.parameters * _BYTES[dtype] + rope
    spec = request.quant or QuantSpec()
    h = config.hidden_size
    kept = {i for role, i in (("first_layer", 0), ("last_layer", config.num_layers - 1)) if role in spec.keep}
    total = geometry.embedding * act + rope
    for i in range(config.num_layers):
        if i in kept:
            total += sum(k * n for k, n, _ in layer_matmuls(config, i)) * act
        else:
            bits = 8 if dtype.bits == 4 and i in spec.int8_layers else dtype.bits
            total += _layer_quantized_bytes(config, i, bits, spec, act, dtype.bits)
    # A quantized export has its own LM head even where the checkpoint ties it to the embedding
    # (the embedding's gather needs the float table).
    if "lm_head" in spec.keep:
        total += geometry.embedding * act if not geometry.lm_head else geometry.lm_head * act
    else:
        total += _quantized_bytes(h, config.vocab_size, spec.lm_head_bits or dtype.bits, spec, act)
    return total


def layer_matmuls(config: ModelConfig, i: int) -> list[tuple[int, int, str]]:
    """Layer ``i``'s weights as (K, N, kind): packed Q/K/V, O, then its MLP: packed gate/up and
    down ("matmul"), or the experts' fc1 / fc2 ("experts", N counting every expert), the router
    ("router", kept in float) and a shared expert's."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    attention = [(h, (2 * q if config.attention_output_gate else q) + 2 * kv, "matmul"), (q, h, "matmul")]
    if config.is_recurrent(i):  # falcon_h1's parallel layers: both
        attention = recurrent_matmuls(config) + (attention if config.is_attention(i) else [])
    moe = config.moe
    dense = [(h, 2 * config.intermediate_size, "matmul"), (config.intermediate_size, h, "matmul")]
    if config.single_mixer:  # nemotron_h: a block is its one mixer; its MLP ungated (up, down)
        if moe is not None and moe.sparse_layers[i]:
            attention = []
        elif config.is_feed_forward(i):
            return [(h, config.intermediate_size, "matmul"), (config.intermediate_size, h, "matmul")]
        else:
            return attention
    if moe is None or not moe.sparse_layers[i]:
        return attention + dense
    width, inner = moe.expert_intermediate, moe.latent or h
    # fc1 is [gate | up] interleaved: nemotron_h's ungated relu^2 experts store their up rows twice (components/moe.py)
    mlp = [(inner, moe.num_experts * 2 * width, "experts"), (width, moe.num_experts * inner, "experts"),
           (h, moe.num_experts, "router")]
    if moe.latent:
        mlp += [(h, moe.latent, "matmul"), (moe.latent, h, "matmul")]
    if moe.relu2_experts and moe.shared_expert_intermediate:
        shared = moe.shared_expert_intermediate
        mlp += [(h, shared, "matmul"), (shared, h, "matmul")]
    elif moe.shared_expert_intermediate:
        shared = moe.shared_expert_intermediate
        mlp += [(h, 2 * shared, "matmul"), (shared, h, "matmul"), (h, 1, "router")]
    # a dense MLP beside the experts: granitemoehybrid's shared one (intermediate_size's width), gemma4's own
    if config.architecture == "granitemoehybrid" or moe.beside_dense_mlp:
        mlp += dense
    return attention + mlp


def recurrent_matmuls(config: ModelConfig) -> list[tuple[int, int, str]]:
    """A hybrid's recurrent layer in place of attention: its projections (the DeltaNet gates' in float,
    as the quantize pass keeps them; "router" counts a float weight), convolution and small vectors."""
    rc, h = config.recurrent, config.hidden_size
    values = rc.value_heads * rc.value_dim
    if rc.kind == GATED_DELTANET:
        return [(h, rc.channels + values, "matmul"), (h, 2 * rc.value_heads, "router"), (values, h, "matmul"),
                (rc.conv_kernel, rc.channels, "router"), (1, 2 * rc.value_heads + rc.value_dim, "router")]
    if rc.kind == MAMBA2:
        return [(h, values + rc.channels + rc.value_heads, "matmul"), (values, h, "matmul"),
                (rc.conv_kernel + 1, rc.channels, "router"), (1, 3 * rc.value_heads + values, "router")]
    return [(h, 3 * h, "matmul"), (h, h, "matmul"), (rc.conv_kernel, h, "router")]


def _layer_quantized_bytes(config: ModelConfig, i: int, bits: int, spec: QuantSpec, act: int,
                           expert_bits: int | None = None) -> int:
    """One layer quantized: MatMulNBits weights at ``bits``, QMoE experts at ``expert_bits`` (default
    ``bits``; int8: a scale per row), float routers."""
    total = 0
    for k, n, kind in layer_matmuls(config, i):
        if kind == "router":
            total += k * n * act
        elif kind == "experts" and (expert_bits or bits) == 8:
            total += k * n + n * act
        else:
            total += _quantized_bytes(k, n, (expert_bits or bits) if kind == "experts" else bits, spec, act)
    return total


def _quantized_bytes(k: int, n: int, bits: int, spec: QuantSpec, scale_bytes: int) -> int:
    """MatMulNBits' packed weight, scales and zero points of one [K, N] weight."""
    blocks = math.ceil(k / spec.block_size)
    packed = n * blocks * spec.block_size * bits // 8
    zero_points = 0 if spec.symmetric else n * math.ceil(blocks * bits / 8)
    return packed + n * blocks * scale_bytes + zero_points


def _packed_decode(config: ModelConfig, geometry: Geometry) -> tuple[int, int] | None:
    """For a GPTQ / AWQ checkpoint, the most weights the streamed reference decodes at once (a
    layer's largest linear, or a block of vocabulary rows of a packed LM head) and the group size;
    None for a float checkpoint."""
    quant = getattr(config.hf_config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
    fmt = read_format({"quantization_config": quant}) if isinstance(quant, dict) else None
    if fmt is None:
        return None
    moe = config.moe
    widths = [config.q_size, config.intermediate_size, *((moe.expert_intermediate, moe.shared_expert_intermediate or 0)
                                                         if moe else ())]
    values = config.hidden_size * max(widths)
    if quant.get("lm_head") and geometry.lm_head:  # GPTQModel's lm_head: the head is packed too
        values = max(values, min(VOCAB_BLOCK_BYTES // (4 * config.hidden_size) * config.hidden_size, geometry.lm_head))
    return values, fmt.group_size


def _rope_bytes(config: ModelConfig, request: ExportRequest, elem: int) -> int:
    if not any(config.uses_rope(i) for i in range(config.num_layers)):
        return 0  # no layer rotates (Granite 4.0-H's NoPE attention): no tables are written
    positions = request.max_seq_len or config.max_position_embeddings
    # One cos / sin pair per rope (gemma3: local and global), two for longrope (short and long factors).
    tables = max(1, len(config.rope_by_layer_type)) * (2 if config.rope.rope_type == "longrope" else 1)
    return tables * 2 * positions * (config.rope.rotary_dim // 2) * elem


def estimate_resources(config: ModelConfig, request: ExportRequest, *, validate_ep: EP | str | None = None,
                       checkpoint_bytes: int | None = None, download: bool = False, local_store: bool = False,
                       bench_contexts=(128, 512), bench_batches=(1,), reference_on_gpu: bool = False,
                       reference_prefetch: bool | None = None,
                       whole_reference_parameters: int | None = None) -> ResourceEstimate:
    """The job's peak host memory, GPU memory and disk, each term named.

    ``validate_ep``: where validation and the benchmark run (the farm's VALIDATE_EP), by default the
    request's EP. ``checkpoint_bytes``: the checkpoint's safetensors, counted on disk when it is
    downloaded (``download``); ``local_store``: the artifact store is a directory on the same disk.
    ``reference_on_gpu``: the streamed reference runs on the GPU (a CUDA build of torch), which then
    reads the next layer ahead (``reference_prefetch``). ``whole_reference_parameters``: an image-text export's
    checkpoint, whose reference is transformers' whole image-text model in fp32 on the host (validation and the
    activation measurement hold it whole, its tower included: validation/image_text.py), not a streamed layer."""
    geometry = Geometry.of(config)
    ep = EP(validate_ep) if validate_ep else request.ep
    dtype = request.dtype
    data = export_bytes(config, request)
    act = _BYTES[activation_dtype(dtype, request.ep)]
    prefetch = reference_on_gpu if reference_prefetch is None else reference_prefetch
    positions = QUALITY_TOKENS if dtype.quantized else PARITY_TOKENS
    # The reference's fp32 layer (two with read-ahead) and LM-head blocks, its activations, the
    # logits it hands back (on the device, the host copy, numpy's) and what the gate computes from them.
    layer = geometry.layer * 4 * (2 if prefetch else 1)
    head = min(2 * VOCAB_BLOCK_BYTES, 2 * geometry.embedding * 4)  # a tied head reads the embedding's rows
    activations = positions * 4 * (3 * config.intermediate_size + 4 * config.hidden_size) * 2
    logits = positions * config.vocab_size * 4
    scoring = (2 * logits + 4 * QUALITY_WINDOW * config.vocab_size * 8) if dtype.quantized else 2 * logits
    reference = {"reference layer (fp32)": layer, "reference LM head blocks": head,
                 "reference activations": activations, "reference logits": 3 * logits}
    if whole_reference_parameters:  # an image-text checkpoint: the whole fp32 model, on the host wherever torch runs
        reference = {"reference (whole image-text model, fp32)": 4 * whole_reference_parameters,
                     "reference activations": activations, "reference logits": 3 * logits}
        reference_on_gpu = False
    if ep is EP.CPU:
        # The CPU EP makes fp32 copies of fp16 / bf16 weights (4 bytes a parameter) and repacks
        # quantized ones; a validation session of fp32 weights maps the file instead (no repacking).
        if dtype.quantized:
            validation_session = serving_session = data - geometry.embedding * act
        else:
            validation_session = 0 if dtype is DType.FP32 else geometry.parameters * 4
            serving_session = geometry.parameters * 4
    else:
        # onnxruntime's host side of a CUDA session: 30 MB a layer of a 70B int4 export (7% of the
        # layer's bytes), about 0.1 GiB for the 15 GiB of an 8B fp16 one (benchmarks/results/h200/scale_*).
        validation_session = serving_session = int((0.1 if dtype.quantized else 0.02) * data)
    host_reference = {} if reference_on_gpu else reference
    if (packed := _packed_decode(config, geometry)) is not None:
        # A GPTQ / AWQ linear is decoded on the host, held beside its codes while it is: on top of
        # the fp32 counted above, or whole where the reference then copies it to the GPU.
        values, group_size = packed
        decoding = decode_bytes(values, group_size) - (0 if reference_on_gpu else 4 * values)
        host_reference = {**host_reference, "decoding packed weights": decoding}
    weight_check = {"weight check": int(WEIGHT_CHECK_HOST)}
    if dtype.quantized:
        # The quality gate computes the reference's logits first and makes the export's session
        # after: the two never hold the host's memory at once.
        validate = {"reference": {**host_reference, **weight_check, "gate's logits": logits},
                    "session": {"export's session": validation_session, **weight_check, "gate's logits": scoring}}
    else:
        # Parity keeps the export's session beside the reference (it drafts again where the
        # reference departs from the export's tokens).
        validate = {"parity": {"export's session": validation_session, **host_reference, **weight_check,
                               "gate's logits": scoring}}
    # The rope tables are computed in fp32 and held by the graph in the export's activations (a cast
    # copy beside the fp32 ones where those are narrower) until the weights are written.
    rope = _rope_bytes(config, request, 4) + (_rope_bytes(config, request, act) if act != 4 else 0)
    stages = {"export": {"export blocks": int(EXPORT_HOST), "rope tables": rope},
              **{f"validate ({phase})": terms for phase, terms in validate.items()},
              "bench": {"benchmark session": serving_session}}
    peak = max(stages, key=lambda stage: sum(stages[stage].values()))
    host_terms = {"worker process": int(PROCESS_HOST[ep]), **stages[peak]}
    host = sum(host_terms.values())

    gpu_terms: dict[str, int] = {}
    if ep is EP.CUDA:
        buffer = max(bench_contexts or (PARITY_TOKENS,)) + BENCH_EXTRA_TOKENS
        if request.static_cache and request.max_seq_len:
            buffer = max(buffer, request.max_seq_len)
        gpu_terms = {"export weights": int(data * CUDA_WEIGHT_OVERHEAD), "CUDA context": int(CUDA_CONTEXT),
                     "KV caches (bench)": geometry.kv_per_token * act * buffer * max(bench_batches or (1,)),
                     "logits": 3 * logits}
        if reference_on_gpu:
            gpu_terms.update(reference)
    gpu = sum(gpu_terms.values())

    disk_terms = {"export": data, "reference caches": QUALITY_TOKENS * config.vocab_size * 4 + 64 * 1024 * 1024,
                  "rope table cache": _rope_bytes(config, request, 4)}
    if download and checkpoint_bytes:
        disk_terms["checkpoint download"] = checkpoint_bytes
    if local_store:
        disk_terms["local artifact store copy"] = data
    disk = sum(disk_terms.values())
    return ResourceEstimate(host, gpu, disk, data,
                            {"host": host_terms, "gpu": gpu_terms, "disk": disk_terms})
