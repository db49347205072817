"""bf16 image-text exports (issue 48): the runtime hands image features and embeddings from session to session as
bfloat16 host arrays (exporter.runtime.session.run_declared; onnxruntime's numpy bridge has no bfloat16), exactly,
through every path the decoder takes (host arrays, device buffers, the bench); and a bf16 export (gemma3's, and the
Qwen3.5 hybrid's with its recurrent states) builds with its graphs in bf16 where the runtime and onnxruntime-genai
expect it.

onnxruntime's CPU EP has no bf16 MatMul, Add or Where, so a real bf16 export runs on CUDA only
(benchmarks/vlm_cuda.py --dtypes bf16, and the last test here where CUDA is present). Here the plumbing runs on
hand-made bf16 graphs of the three kinds of vision graph, built of the ops the CPU EP has in bf16 (Cast, Reshape,
Concat, Gather, Identity): vision casts the pixels to bf16 feature rows, embedding merges them into a bf16 table's rows
as the real embedding graph does, and the decoder's logits are its inputs_embeds, so each step shows exactly what
reached it.
"""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from exporter import contract
from exporter.errors import ExportError
from exporter.runtime.bench import run_bench
from exporter.runtime.image_text import (
    ImageTextModel, PaddedImagesModel, PatchSequenceModel, image_text_decode, open_image_text,
)
from exporter.runtime.session import run_declared
from tests.conftest import needs_cuda

BF16 = TensorProto.BFLOAT16
HIDDEN = VOCAB = 12  # the decoder's logits are its inputs_embeds: as wide as its vocabulary
IMAGE_TOKEN = VOCAB  # past the table, as gemma3's: never a text token the bench draws (ids 3 .. vocab - 1)
SLOTS = 48
# Each kind's vision graph casts its pixels to bf16 and reads them HIDDEN values to a feature row: what the runtime
# counts as each image's tokens. fixed: 3 x 4 x 4 pixels = 4 tokens of 12; patch_sequence: patches of 3 values, 2 x 2
# merged; padded: 3 channels of 2 x 2 pixels a token (patch 1, merge 2).
KINDS = {"fixed": ImageTextModel, "patch_sequence": PatchSequenceModel, "padded": PaddedImagesModel}


def _save(graph, path, metadata: dict) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    helper.set_model_props(model, metadata)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _vision_graph(kind: str):
    const = [helper.make_tensor("row", TensorProto.INT64, [2], [-1, HIDDEN])]
    nodes = [helper.make_node("Cast", [contract.PIXEL_VALUES], ["bf"], to=BF16)]
    metadata = {contract.META_TOKENS_PER_IMAGE: "0", contract.META_IMAGE_TOKEN_ID: str(IMAGE_TOKEN),
                contract.META_IMAGE_SIZE: "0"}
    if kind == "fixed":
        inputs = [helper.make_tensor_value_info(contract.PIXEL_VALUES, TensorProto.FLOAT, ["num_images", 3, 4, 4])]
        metadata.update({contract.META_TOKENS_PER_IMAGE: "4", contract.META_IMAGE_SIZE: "4"})
        nodes.append(helper.make_node("Reshape", ["bf", "row"], [contract.IMAGE_FEATURES]))
    elif kind == "patch_sequence":
        inputs = [helper.make_tensor_value_info(contract.PIXEL_VALUES, TensorProto.FLOAT, ["num_patches", 3]),
                  helper.make_tensor_value_info(contract.IMAGE_GRID_THW, TensorProto.INT64, ["num_images", 3])]
        metadata[contract.META_SPATIAL_MERGE_SIZE] = "2"
        nodes.append(helper.make_node("Reshape", ["bf", "row"], [contract.IMAGE_FEATURES]))
    else:  # image_sizes: an overridable initializer, as the real graph's, read (so that onnxruntime keeps it)
        inputs = [helper.make_tensor_value_info(contract.PIXEL_VALUES, TensorProto.FLOAT, ["num_images", 3, "h", "w"]),
                  helper.make_tensor_value_info(contract.IMAGE_SIZES, TensorProto.INT64, ["num_images", 2])]
        const += [helper.make_tensor(contract.IMAGE_SIZES, TensorProto.INT64, [1, 2], [0, 0]),
                  helper.make_tensor("zero", TensorProto.INT64, [], [0])]
        metadata.update({contract.META_SPATIAL_MERGE_SIZE: "2", contract.META_PATCH_SIZE: "1"})
        nodes += [helper.make_node("ReduceMax", [contract.IMAGE_SIZES], ["largest"], keepdims=0),
                  helper.make_node("Mul", ["largest", "zero"], ["nothing"]),
                  helper.make_node("Add", ["row", "nothing"], ["shape"]),
                  helper.make_node("Reshape", ["bf", "shape"], [contract.IMAGE_FEATURES])]
    out = helper.make_tensor_value_info(contract.IMAGE_FEATURES, BF16, ["num_image_tokens", HIDDEN])
    return helper.make_graph(nodes, "vision", inputs, [out], const), metadata


def _embedding_graph(table: np.ndarray):
    """The real embedding graph's merge in ops the CPU has in bf16: the k-th image token takes feature row k (rows
    after the table's), every other token its table row."""
    ids, features = contract.INPUT_IDS, contract.IMAGE_FEATURES
    nodes = [
        helper.make_node("Concat", ["table", features], ["rows"], axis=0),
        helper.make_node("Equal", [ids, "image_token"], ["is_image"]),
        helper.make_node("Cast", ["is_image"], ["flags"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["flags", "flat"], ["flat_flags"]),
        helper.make_node("CumSum", ["flat_flags", "axis0"], ["flat_order"]),
        helper.make_node("Shape", [ids], ["ids_shape"]),
        helper.make_node("Reshape", ["flat_order", "ids_shape"], ["order"]),
        helper.make_node("Add", ["order", "past_table"], ["feature_row"]),  # vocab + k - 1
        helper.make_node("Sub", ["feature_row", ids], ["jump"]),
        helper.make_node("Mul", ["jump", "flags"], ["image_jump"]),
        helper.make_node("Add", [ids, "image_jump"], ["index"]),
        helper.make_node("Gather", ["rows", "index"], [contract.INPUTS_EMBEDS], axis=0),
    ]
    const = [helper.make_tensor("table", BF16, list(table.shape), table.view(np.uint16).tobytes(), raw=True),
             helper.make_tensor("image_token", TensorProto.INT64, [], [IMAGE_TOKEN]),
             helper.make_tensor("flat", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("axis0", TensorProto.INT64, [], [0]),
             helper.make_tensor("past_table", TensorProto.INT64, [], [VOCAB - 1])]
    inputs = [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info(features, BF16, ["num_image_tokens", HIDDEN])]
    out = helper.make_tensor_value_info(contract.INPUTS_EMBEDS, BF16, ["batch_size", "sequence_length", HIDDEN])
    return helper.make_graph(nodes, "embedding", inputs, [out], const)


def _decoder_graph(mrope: bool):
    """attn_static's contract on inputs_embeds: logits = inputs_embeds, each cache passed through."""
    positions = [3, "batch_size", "sequence_length"] if mrope else ["batch_size", "sequence_length"]
    inputs = [helper.make_tensor_value_info(contract.INPUTS_EMBEDS, BF16, ["batch_size", "sequence_length", HIDDEN]),
              helper.make_tensor_value_info(contract.POSITION_IDS, TensorProto.INT64, positions)]
    outputs = [helper.make_tensor_value_info(contract.LOGITS, BF16, ["batch_size", "sequence_length", VOCAB])]
    nodes = [helper.make_node("Identity", [contract.INPUTS_EMBEDS], [contract.LOGITS])]
    k_in, v_in, k_out, v_out = contract.cache_names("attn_static", 0)
    for name_in, name_out in ((k_in, k_out), (v_in, v_out)):
        inputs.append(helper.make_tensor_value_info(name_in, BF16, ["batch_size", "max_seq_len", 4]))
        outputs.append(helper.make_tensor_value_info(name_out, BF16, ["batch_size", "max_seq_len", 4]))
        nodes.append(helper.make_node("Identity", [name_in], [name_out]))
    inputs += [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch_size"])
               for name in (contract.WRITE_INDICES, contract.NONPAD_KV_SEQLEN)]
    return helper.make_graph(nodes, "decoder", inputs, outputs)


def fake_bf16_image_text_export(directory, kind: str = "fixed", seed: int = 0):
    """An export folder of ``kind``'s three graphs in bf16 (KINDS); returns (folder, the embedding table)."""
    directory.mkdir(parents=True)
    table = np.random.default_rng(seed).standard_normal((VOCAB, HIDDEN)).astype(ml_dtypes.bfloat16)
    vision, metadata = _vision_graph(kind)
    _save(vision, directory / contract.VISION_FILE, metadata)
    _save(_embedding_graph(table), directory / contract.EMBEDDING_FILE, metadata)
    _save(_decoder_graph(kind == "patch_sequence"), directory / contract.MODEL_FILE, {
        contract.META_VARIANT: "attn_static", contract.META_DTYPE: "bf16", contract.META_EP: "cpu",
        contract.META_CONFIG: json.dumps({"num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 4,
                                          "vocab_size": VOCAB, "max_seq_len": SLOTS, "context_length": SLOTS})})
    return directory, table


def two_images(kind: str, seed: int = 1) -> tuple[dict, list[int]]:
    """``encode``'s arguments for two images of ``kind``, and each image's tokens."""
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        return {"pixel_values": rng.standard_normal((2, 3, 4, 4)).astype(np.float32)}, [4, 4]
    if kind == "patch_sequence":  # 4 x 4 and 4 x 8 patches, 2 x 2 merged
        grids = np.array([[1, 4, 4], [1, 4, 8]], np.int64)
        return {"pixel_values": rng.standard_normal((48, 3)).astype(np.float32), "image_grid_thw": grids}, [4, 8]
    return {"pixel_values": rng.standard_normal((2, 3, 4, 6)).astype(np.float32),  # 2 x 3 tokens of 2 x 2 pixels
            "image_sizes": np.array([[4, 6], [4, 6]], np.int64)}, [6, 6]


def image_prompt(counts: list[int]) -> list[int]:
    """Text tokens 3, 5, 7 around two images' tokens."""
    return [3, *[IMAGE_TOKEN] * counts[0], 5, *[IMAGE_TOKEN] * counts[1], 7]


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_features_and_embeddings_pass_between_the_sessions_exactly(kind, tmp_path):
    export_dir, table = fake_bf16_image_text_export(tmp_path / kind, kind)
    model = open_image_text(export_dir)
    assert type(model) is KINDS[kind] and model.features_dtype == ml_dtypes.bfloat16
    images, counts = two_images(kind)
    features = model.encode(**images)
    # the vision graph's bf16 rows, bit for bit: the pixels cast, HIDDEN values a row
    want = images["pixel_values"].astype(ml_dtypes.bfloat16).reshape(-1, HIDDEN)
    assert features.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(features.reshape(-1, HIDDEN)), bits(want))
    prompt = image_prompt(counts)
    embeds = model.embed(np.array([prompt]), features)
    assert embeds.dtype == ml_dtypes.bfloat16 and embeds.shape == (1, len(prompt), HIDDEN)
    first = counts[0]
    np.testing.assert_array_equal(bits(embeds[0]), bits(np.concatenate([table[[3]], want[:first], table[[5]],
                                                                         want[first:], table[[7]]])))
    # what the runtime ran them through before: session.run, whose numpy bridge has no bfloat16
    with pytest.raises(Exception, match="bfloat16"):
        model.vision.run(None, {name: value for name, value in images.items()
                                if name != contract.IMAGE_SIZES})


def test_a_vision_graph_giving_other_rows_than_the_runtime_counts_fails_the_run(tmp_path):
    export_dir, _ = fake_bf16_image_text_export(tmp_path / "fixed")
    model = ImageTextModel(export_dir)
    with pytest.raises(Exception, match="[Ss]hape"):
        run_declared(model.vision, {contract.PIXEL_VALUES: np.zeros((1, 3, 4, 4), np.float32)},
                     {contract.IMAGE_FEATURES: (5, HIDDEN)})


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoder_takes_bf16_embeddings_on_host_arrays_and_device_buffers(kind, tmp_path):
    """The decoder's logits are its inputs_embeds here: each path must hand it the embedding graph's bf16 rows."""
    export_dir, table = fake_bf16_image_text_export(tmp_path / kind, kind)
    model = open_image_text(export_dir)
    images, counts = two_images(kind)
    prompt = image_prompt(counts)
    want = model.embed(np.array([prompt]), model.encode(**images)).astype(np.float32)[0]
    model.clear()

    model.encode(**images)  # host arrays: a bf16 cache state, logits back as bf16
    logits = model.decoder.forward(np.array([prompt], np.int64), model.decoder.new_state())
    assert logits.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(logits.astype(np.float32)[0], want)
    model.clear()

    # device buffers, as validation runs an export (the prompt and teacher-forced steps, each embedded on the host)
    run = image_text_decode(model, prompt, images["pixel_values"], 2, feed=[4, 6],
                            image_grid_thw=images.get("image_grid_thw"), image_sizes=images.get("image_sizes"))
    np.testing.assert_array_equal(run.prefill_logits, want[-1])
    np.testing.assert_array_equal(np.stack(run.logits[1:]), table[[4, 6]].astype(np.float32))

    # and as the bench runs it: the prefill uncaptured, then decode steps updating inputs_embeds' buffer in place
    model.encode(**images)
    buffer = len(prompt) + 4
    caches = model.decoder.new_caches(buffer)
    _, value = model.decoder.prefill_bound(np.array([prompt]), caches, buffer)
    np.testing.assert_array_equal(model.decoder.to_host(value)[0], want)
    _, last = model.decoder.decode_bound(caches, len(prompt), buffer, steps=2, warmup=1)
    np.testing.assert_array_equal(last[0, 0], table[1].astype(np.float32))  # the bench decodes token 1
    model.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_the_bench_times_a_bf16_image_and_its_first_token(kind, tmp_path):
    export_dir, _ = fake_bf16_image_text_export(tmp_path / kind, kind)
    result = run_bench(export_dir, "cpu", contexts=[4], steps=2, warmup=1, prefill_lengths=[8])
    assert result.dtype == "bf16" and [c.ctx for c in result.contexts] == [4]
    assert result.image["encode_ms_median"] > 0 and result.image["time_to_first_token_ms_median"] > 0
    # padded: 6 x 6 tokens fit 48 slots; patch_sequence: a 1 x 12 x 12 grid of patches, 2 x 2 merged, likewise
    assert result.image["tokens_per_image"] == {"fixed": 4, "padded": 36, "patch_sequence": 36}[kind]


@dataclasses.dataclass(frozen=True)
class Bf16Case:
    """A tiny image-text checkpoint with its tokenizer and processor, exported in bf16 for cuda."""

    model_type: str  # the image-text type, which its genai package names
    checkpoint: str  # exporter.vision.tiny_checkpoint's name for it
    max_seq_len: int  # validation's two-image prompt and its steps fit (where CUDA runs it), and the genai run's
    image_prompt: str  # a one-image prompt in the placeholder genai's processor expands
    vision_inputs: dict  # the vision graph's inputs and their types (pixels fp32, as every export takes them)
    states: dict  # a hybrid's recurrent states: kind -> their type, as its decoder declares them


BF16_CASES = [
    # 640 positions: validation's two-image prompt of 2 x 256 image tokens and its steps (548)
    Bf16Case("gemma3", "gemma3_genai", 640, "hello <start_of_image> the quick brown fox",
             {contract.PIXEL_VALUES: "FLOAT"}, {}),
    # 256: validation's two-image prompt and its steps take 66 positions, the genai run's 64 x 64 image 64 tokens. The
    # convolution's state is in the model dtype, gated DeltaNet's in fp32 (GatedDeltaNet's state type: task.state_layout)
    Bf16Case("qwen3_5", "qwen3_5_genai", 256, "hello <|vision_start|><|image_pad|><|vision_end|> the quick brown fox",
             {contract.PIXEL_VALUES: "FLOAT", contract.IMAGE_GRID_THW: "INT64"},
             {contract.CONV_STATE: "BFLOAT16", contract.RECURRENT_STATE: "FLOAT"}),
]


@pytest.fixture(scope="module", params=BF16_CASES, ids=lambda case: case.model_type)
def bf16_export(request, tmp_path_factory):
    """(the case, its checkpoint, its export in bf16 for cuda), not validated (onnxruntime's CPU EP cannot run its
    graphs)."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.vision.tiny_checkpoint import make_tiny_vlm_checkpoint

    case = request.param
    root = tmp_path_factory.mktemp(f"vlm-bf16-{case.model_type}")
    source = make_tiny_vlm_checkpoint(case.checkpoint, root / "ckpt")
    return case, source, export_model(ExportRequest(model=str(source), dtype="bf16", ep="cuda",
                                                    max_seq_len=case.max_seq_len), root / "out", validate=False)


def test_a_bf16_export_writes_its_graphs_in_bf16_and_a_genai_package(bf16_export):
    """Pixels stay fp32 as every export takes them (image processors give fp32; the graph casts, as transformers
    does, and onnxruntime-genai converts its processor's pixels to the vision graph's declared type anyway); features,
    embeddings, caches and logits are bf16, a hybrid's recurrent states what its decoder keeps them in. The genai
    package names the image-text type, and a hybrid's states: genai passes OrtValues between its sessions, whatever
    their element type."""
    case, _, result = bf16_export

    def types(file):
        graph = onnx.load(str(result.out_dir / file), load_external_data=False).graph
        return {v.name: TensorProto.DataType.Name(v.type.tensor_type.elem_type) for v in [*graph.input, *graph.output]}

    files = (contract.VISION_FILE, contract.EMBEDDING_FILE, contract.MODEL_FILE)
    vision, embedding, decoder = (types(f) for f in files)
    assert vision == {**case.vision_inputs, contract.IMAGE_FEATURES: "BFLOAT16"}
    assert embedding == {contract.INPUT_IDS: "INT64", contract.IMAGE_FEATURES: "BFLOAT16",
                         contract.INPUTS_EMBEDS: "BFLOAT16"}
    assert decoder[contract.INPUTS_EMBEDS] == decoder[contract.LOGITS] == "BFLOAT16"
    assert {t for name, t in decoder.items() if name.startswith(("past_key_values.", "present."))} == {"BFLOAT16"}
    states = {kind: {t for name, t in decoder.items() if name.startswith((f"past_{kind}.", f"present_{kind}."))}
              for kind in contract.STATE_KINDS}
    assert {kind: found for kind, found in states.items() if found} == {k: {t} for k, t in case.states.items()}
    manifest = result.manifest.data
    assert manifest["task"] == contract.IMAGE_TEXT_TASK and manifest["image_text"]["model_type"] == case.model_type
    components = manifest["image_text"]["components"]
    assert {components[c]["dtype"] for c in (contract.VISION, contract.EMBEDDING)} == {"BFLOAT16"}
    genai = json.loads((result.out_dir / contract.GENAI_CONFIG_FILE).read_text())["model"]
    assert manifest["genai"]["package"] is True and genai["type"] == case.model_type
    assert [genai[c]["filename"] for c in ("vision", "embedding")] == [contract.VISION_FILE, contract.EMBEDDING_FILE]
    assert genai["decoder"]["inputs"]["inputs_embeds"] == contract.INPUTS_EMBEDS
    for kind in case.states:  # without them genai feeds the decoder no state (tests/test_genai_vlm_qwen3_5.py)
        assert genai["decoder"]["inputs"][f"past_{kind}_names"] == f"past_{kind}.%d"
        assert genai["decoder"]["outputs"][f"present_{kind}_names"] == f"present_{kind}.%d"
    assert genai["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]


def test_a_bf16_exports_vision_and_embedding_weights_are_the_checkpoints_in_bf16(bf16_export):
    """The weight gate's by-value check of the two graphs, which validation runs beside the CUDA-only parity."""
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.validation.image_text import component_weight_gates

    _, source, result = bf16_export
    gates = component_weight_gates(result.out_dir, result.manifest.data, Checkpoint(source), "bf16")
    assert len(gates) == 2 and all(g.passed for g in gates), [g.message for g in gates]


def test_a_bf16_hf_layout_is_refused_as_a_text_one_is(bf16_export, tmp_path):
    """transformers.js has no bf16: the words a bf16 text export's hf layout is refused in, before anything is read."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    _, source, _ = bf16_export
    with pytest.raises(ExportError, match="transformers.js has no file name for bf16 weights"):
        export_model(ExportRequest(model=str(source), dtype="bf16", ep="cuda", layout="hf"), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@needs_cuda
def test_a_bf16_export_validates_benches_and_runs_in_genai_on_cuda(bf16_export, tmp_path):
    """On a CUDA machine: the pipeline's own validation of the bf16 export (its vision features and merged embeddings
    within FEATURE_TOLERANCE["bf16"] of transformers' fp32, end to end within the bf16 parity gates), the bench's image
    figures, and onnxruntime-genai's own processor and generator on the package (fp32 pixels, bf16 features, embeddings
    and logits from session to session as OrtValues; a hybrid's recurrent states too): its greedy tokens on an image
    prompt are the farm runtime's on genai's own ids and pixels (and image grid, where the vision graph takes one)."""
    from PIL import Image

    from exporter.validation.validate import validate_export
    from tests.genai_greedy import genai_multimodal_run, worst_of_range

    case, source, result = bf16_export
    report = validate_export(result.out_dir, str(source), "cuda")
    assert report.passed, [(g.check, g.message) for g in report.failed]
    bench = run_bench(result.out_dir, "cuda", contexts=[16], steps=4, warmup=1, prefill_lengths=[8])
    assert bench.dtype == "bf16" and bench.image["encode_ms_median"] > 0

    og = pytest.importorskip("onnxruntime_genai")
    if not getattr(og, "is_cuda_available", lambda: False)():
        pytest.skip("this onnxruntime-genai has no CUDA")
    png = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(png)
    genai = og.Model(str(result.out_dir))  # its genai_config.json: the cuda provider
    inputs = genai.create_multimodal_processor()(case.image_prompt, images=og.Images.open(str(png)))
    ids, pixels = inputs["input_ids"].as_numpy(), inputs["pixel_values"].as_numpy()
    assert pixels.dtype == np.float32  # the vision graph's declared pixel type, which genai's processor feeds
    grid = inputs[contract.IMAGE_GRID_THW].as_numpy() if contract.IMAGE_GRID_THW in case.vision_inputs else None
    tokens, logits = genai_multimodal_run(genai, inputs, 8)
    ours = image_text_decode(open_image_text(result.out_dir, "cuda"), ids[0].tolist(), pixels, 8, image_grid_thw=grid)
    print(f"{case.model_type}: genai {tokens}, ours {ours.chosen}, "
          f"logits {worst_of_range(logits, ours.logits[:8]):.2e} of the range")
    assert tokens == ours.chosen
