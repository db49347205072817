"""The streamed reference (one decoder layer in memory at a time) against transformers' whole model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from exporter.errors import ExportError
from exporter.validation.gates.quality import reference_logits
from exporter.validation.reference import cached_window_logits, load_reference, reference_greedy, store_window_logits
from exporter.validation.streamed import StreamedReference, reference_device
from exporter.tiny_checkpoint import HYBRID_ARCHITECTURES
from tests.conftest import ARCHITECTURES

STEPS = 24


def _ids(n: int, seed: int = 0, vocab: int = 250) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def _bf16(checkpoint, arch: str, **kw):
    heads = {"num_attention_heads": 6} if arch == "phi3" else {}  # phi3: head_dim = hidden / heads stays 16
    return checkpoint(arch, dtype="bfloat16", hidden_size=96, **heads, **kw)


# bf16 weights widened to fp32 (what validation meets in practice), tied and untied heads, every
# architecture: transformers' code between the layers (masks, rotary, soft-capping, scaling,
# Gemma's embedding scale) runs as it is, so one pass over the same sequence gives the same bits.
@pytest.mark.parametrize("arch", ARCHITECTURES + list(HYBRID_ARCHITECTURES))  # hybrids: recurrent layers streamed too
@pytest.mark.parametrize("tied", [False, True])
def test_a_streamed_pass_gives_the_whole_model_s_logits_bit_for_bit(checkpoint, arch, tied):
    source = _bf16(checkpoint, arch, tie_word_embeddings=tied)
    whole, streamed = load_reference(source), StreamedReference(source)
    ids = torch.tensor([_ids(40, seed=len(arch))])
    with torch.no_grad():
        want = whole(input_ids=ids, use_cache=False).logits
    got = streamed(input_ids=ids, use_cache=False).logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # Two windows in one batch: the quality gate's pass.
    batch = torch.tensor([_ids(32, 1), _ids(32, 2)])
    with torch.no_grad():
        want = whole(input_ids=batch, use_cache=False).logits
    assert torch.equal(streamed(input_ids=batch, use_cache=False).logits, want)
    assert streamed.materialized_layers() == []  # nothing held between passes


def test_only_one_decoder_layer_is_in_memory_while_a_pass_runs(checkpoint):
    """(With prefetch, the next layer's weights are read beside the running one: two at most.)"""
    source = _bf16(checkpoint, "qwen3", num_hidden_layers=4)
    for prefetch in (False, True):
        streamed = StreamedReference(source, prefetch=prefetch)
        seen = []
        for layer in streamed.layers:
            # runs after the reference's own pre-hook has put the layer's weights in place
            layer.register_forward_pre_hook(lambda *_: seen.append(streamed.materialized_layers()))
        streamed(input_ids=torch.tensor([_ids(20)]), use_cache=False)
        assert seen == [[0], [1], [2], [3]] and not streamed._pending  # nothing read ahead is left behind
        # The embedding and the LM head never hold the vocabulary whole.
        assert streamed.embedding.weight.device.type == "meta" and streamed.lm_head.weight.device.type == "meta"
        streamed.close()


def test_the_lm_head_by_vocabulary_blocks_equals_the_whole_head(checkpoint):
    """Blocks of a few hundred rows give the same bits; blocks of a handful of rows may take another
    GEMM kernel, and stay within fp32 rounding."""
    source = checkpoint("llama", dtype="bfloat16", vocab_size=1000, hidden_size=128)
    ids = torch.tensor([_ids(30, vocab=999)])
    with torch.no_grad():
        want = load_reference(source)(input_ids=ids, use_cache=False).logits
    for rows, exact in ((300, True), (7, False)):
        got = StreamedReference(source, vocab_block_bytes=rows * 128 * 4)(input_ids=ids, use_cache=False).logits
        if exact:
            assert torch.equal(got, want)
        span = float(want.max() - want.min())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * span)


def test_the_greedy_run_from_a_draft_takes_one_pass_and_a_redraft_after_a_departure(checkpoint):
    source = _bf16(checkpoint, "gemma2")
    prompt = _ids(12)
    plain = reference_greedy(load_reference(source), prompt, STEPS)
    streamed = StreamedReference(source)
    assert reference_greedy(streamed, prompt, STEPS, draft=plain.tokens).tokens == plain.tokens
    assert streamed.passes == 1

    # A draft that departs at step 5; the redraft (here the reference's own continuation, as a
    # faithful export's would be) is checked in one more pass.
    wrong = list(plain.tokens)
    wrong[5] = (wrong[5] + 1) % 250
    asked = []

    def redraft(tokens):
        asked.append(list(tokens))
        return plain.tokens[len(tokens):]

    streamed.passes = 0
    run = reference_greedy(streamed, prompt, STEPS, draft=wrong, redraft=redraft)
    assert run.tokens == plain.tokens and streamed.passes == 2 and asked == [plain.tokens[:6]]
    span = float(plain.prefill_logits.max() - plain.prefill_logits.min())
    for a, b in zip(run.step_logits, plain.step_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * span)


def test_a_checkpoint_without_a_tensor_the_model_needs_is_refused_by_name(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = checkpoint("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        StreamedReference(broken)


def test_the_reference_runs_on_the_cpu_unless_a_cuda_export_meets_a_cuda_torch():
    assert reference_device("cpu") == "cpu"
    assert reference_device("cuda") == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_the_quality_reference_is_kept_per_checkpoint_and_text(checkpoint, tmp_path):
    source = checkpoint("qwen2")
    chunks = [_ids(16, 1), _ids(16, 2), _ids(9, 3)]
    logits = reference_logits(StreamedReference(source), chunks)
    with torch.no_grad():
        whole = load_reference(source)
        for chunk, rows in zip(chunks, logits):
            want = whole(input_ids=torch.tensor([chunk])).logits[0].numpy()
            np.testing.assert_allclose(rows, want, rtol=0, atol=1e-5 * float(want.max() - want.min()))

    class Shared:
        def __init__(self):
            self.objects = {}

        def fetch(self, name):
            return self.objects.get(name)

        def publish(self, name, data):
            self.objects[name] = data

    shared = Shared()
    path, cached = cached_window_logits(tmp_path / "a", "rev1", chunks, shared)
    assert cached is None
    store_window_logits(path, chunks, logits, shared)
    _, again = cached_window_logits(tmp_path / "a", "rev1", chunks)
    assert all(np.array_equal(a, b) for a, b in zip(again, logits))
    _, elsewhere = cached_window_logits(tmp_path / "b", "rev1", chunks, shared)  # another worker's cache
    assert elsewhere is not None and (tmp_path / "b" / path.name).is_file()
    assert cached_window_logits(tmp_path / "a", "rev2", chunks)[1] is None  # another checkpoint
    assert cached_window_logits(tmp_path / "a", "rev1", chunks[:2])[1] is None  # another text
    path.write_bytes(path.read_bytes()[:100])  # torn: computed again, not trusted
    assert cached_window_logits(tmp_path / "a", "rev1", chunks)[1] is None


def test_validation_of_a_quantized_export_computes_its_reference_once_for_every_dtype(checkpoint, tmp_path, monkeypatch):
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation import reference
    from exporter.validation.validate import validate_export

    opened = []
    real = reference.open_reference
    monkeypatch.setattr(reference, "open_reference", lambda *a, **k: opened.append(a) or real(*a, **k))
    source = checkpoint("llama")
    cache = tmp_path / "references"
    reports = {}
    for dtype in ("int8", "int4"):
        out = export_model(ExportRequest(model=str(source), dtype=dtype, ep="cpu"), tmp_path / dtype, validate=False).out_dir
        reports[dtype] = validate_export(out, reference_cache=cache)
    assert len(opened) == 1 and len(list(cache.glob("windows-*.npz"))) == 1
    assert [reports[d].timings_s["reference_cached"] for d in ("int8", "int4")] == [0.0, 1.0]
    assert reports["int8"].quality["ppl_reference"] == reports["int4"].quality["ppl_reference"]
    assert json.dumps(reports["int4"].to_json())  # figures stay plain JSON


def test_a_longrope_run_across_the_switch_is_made_as_a_cached_runtime_makes_it(checkpoint):
    """Tiny phi3 switches to its long factors past 64 positions: a 56-token prompt and 24 steps
    cross it, so the run goes token by token through the KV cache, streamed layers and all."""
    source = checkpoint("phi3")
    prompt = _ids(56, 5)
    whole = reference_greedy(load_reference(source), prompt, STEPS)
    streamed = StreamedReference(source)
    run = reference_greedy(streamed, prompt, STEPS, draft=whole.tokens)
    assert run.tokens == whole.tokens and streamed.passes == STEPS  # the prompt, then one pass per token
    span = float(whole.prefill_logits.max() - whole.prefill_logits.min())
    for a, b in zip(run.step_logits, whole.step_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * span)


def test_a_pass_that_fails_leaves_no_layer_behind(checkpoint):
    source = _bf16(checkpoint, "llama", num_hidden_layers=3)
    streamed = StreamedReference(source, prefetch=True)

    def fail(*_):
        raise MemoryError("out of memory in layer 1")

    streamed.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(MemoryError):
        streamed(input_ids=torch.tensor([_ids(10)]), use_cache=False)
    assert streamed.materialized_layers() == [] and not streamed._pending
    assert streamed.embedding.weight.device.type == "meta"


def test_a_checkpoint_sharded_into_a_subfolder_streams_the_weights_transformers_loads(checkpoint, tmp_path):
    """The index names ``sub/model-00001-of-00001.safetensors``; a top-level file of that name holds another model's
    weights. transformers loads the sub/ shard, and so must the reference validation holds an export to."""
    from exporter.tiny_checkpoint import shards_in_subfolder

    source = shards_in_subfolder(checkpoint("llama"), tmp_path / "ckpt", checkpoint("llama", seed=1))
    ids = torch.tensor([_ids(16)])
    with torch.no_grad():
        want = load_reference(source)(input_ids=ids, use_cache=False).logits
    assert torch.equal(StreamedReference(source)(input_ids=ids, use_cache=False).logits, want)
