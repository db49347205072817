"""Every architecture x variant, run through its own cache contract, matches transformers."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.validation.parity import run_batch_parity, run_parity
from exporter.runtime.session import Decoder
from tests.conftest import ARCHITECTURES, DECODE_STEPS, VARIANTS, needs_cuda


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp32_matches_transformers(arch, variant, exported, reference):
    ref = reference(arch)
    result = run_parity(Decoder(exported(arch, variant)), ref, near_tie_margin=0.0)
    assert result.prefill_max_abs_error <= 1e-4, result
    assert result.tokens == ref.tokens, f"greedy tokens differ at steps {result.mismatches}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp16_matches_transformers_except_near_ties(arch, variant, exported, reference, record_property):
    ref = reference(arch)
    result = run_parity(Decoder(exported(arch, variant, "fp16")), ref, near_tie_margin=0.1)
    record_property("near_ties", len(result.near_ties))
    print(f"{arch}/{variant} fp16: prefill err {result.prefill_max_abs_error:.3g}, near ties {result.near_ties}, "
          f"tie flips {result.tie_mismatches}")
    assert result.mismatches == [], f"decisive steps with another token: {result.mismatches}"
    # A vacuous comparison (every step a near tie) would prove nothing.
    assert len(result.near_ties) <= result.steps // 2
    assert result.prefill_max_abs_error <= 5e-2 * result.logit_range


def test_attn_static_chunked_prefill_matches(exported, reference):
    ref = reference("qwen2", prompt_len=15)
    result = run_parity(Decoder(exported("qwen2", "attn_static")), ref, near_tie_margin=0.0, prefill_chunks=2)
    assert result.prefill_max_abs_error <= 1e-4
    assert result.tokens == ref.tokens


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_attn_static_in_place_io_binding_matches(arch, exported, reference):
    """Cache input and updated output bound to one buffer: the scatter updates it in place."""
    ref = reference(arch)
    lm = Decoder(exported(arch, "attn_static"), in_place=True)
    result = run_parity(lm, ref, near_tie_margin=0.0, prefill_chunks=2)
    assert result.prefill_max_abs_error <= 1e-4
    assert result.tokens == ref.tokens


def test_in_place_binding_really_writes_the_bound_buffer(exported, reference):
    lm = Decoder(exported("llama", "attn_static"), in_place=True)
    state = lm.new_state()
    lm.forward(np.array([reference("llama").prompt], dtype=np.int64), state)
    cache = state.caches[0]
    n = len(reference("llama").prompt)
    assert np.abs(cache[:, :n]).sum() > 0  # written by the graph, through the shared buffer ([b, pos, kv])
    assert np.all(cache[:, n:] == 0)  # nothing past the tokens cached


def test_phi3_longrope_switches_to_long_factors_like_transformers(exported, reference):
    """A prompt that crosses original_max_position_embeddings (64 in the tiny config)."""
    ref = reference("phi3", prompt_len=56)
    for variant in ("attn_dynamic", "gqa", "attn_static"):
        result = run_parity(Decoder(exported("phi3", variant)), ref, near_tie_margin=0.0)
        assert result.prefill_max_abs_error <= 1e-4, variant
        assert result.tokens == ref.tokens, variant


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "mistral", "gemma2"])
def test_a_batch_of_ragged_prompts_matches_each_prompt_alone(arch, variant, exported, reference):
    """Batch 2, prompts of 12 and 7 tokens, each row checked against its own transformers run:
    attn_dynamic left-padded, gqa right-padded, attn_static ragged (per-row write_indices and
    nonpad_kv_seqlen), then teacher-forced decode of both rows at once."""
    refs = [reference(arch, prompt_len=12), reference(arch, prompt_len=7)]
    results = run_batch_parity(Decoder(exported(arch, variant)), refs, near_tie_margin=0.0)
    for ref, result in zip(refs, results):
        assert result.steps == len(ref.tokens) == DECODE_STEPS
        assert result.prefill_max_abs_error <= 1e-4, (variant, len(ref.prompt))
        assert result.tokens == ref.tokens, (variant, len(ref.prompt))


def test_static_rows_prefilled_one_by_one_leave_the_other_rows_untouched(exported, reference):
    lm = Decoder(exported("llama", "attn_static"))
    state = lm.new_state(batch=2)
    lm.prefill([reference("llama", prompt_len=12).prompt, reference("llama", prompt_len=7).prompt], state)
    assert list(state.lengths) == [12, 7]
    for cache in state.caches:  # [batch, positions, kv]: each row written up to its own length only
        assert np.abs(cache[0, :12]).sum() > 0 and np.all(cache[0, 12:] == 0)
        assert np.abs(cache[1, :7]).sum() > 0 and np.all(cache[1, 7:] == 0)


@pytest.mark.parametrize("ep", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_caches_kept_on_the_device_give_the_host_fed_run(variant, dtype, ep, exported, reference):
    """Validation on CUDA keeps the caches on the device (GQA's past and present one buffer, as
    onnxruntime-genai binds it); the same binding runs on the CPU too, and must give the run whose
    caches are host arrays fed to every step: the same tokens, logits to the dtype's rounding."""
    from exporter.validation.parity import export_decode

    if ep == "cuda" and dtype == "fp32" and variant == "gqa":
        pytest.skip("GroupQueryAttention on CUDA is fp16/bf16 only")
    ref = reference("qwen3")
    lm = Decoder(exported("qwen3", variant) if dtype == "fp32" else exported("qwen3", variant, dtype), ep)
    for chunks in (1, 2):
        host = export_decode(lm, ref.prompt, len(ref.tokens), ref.tokens, chunks, device_caches=False)
        device = export_decode(lm, ref.prompt, len(ref.tokens), ref.tokens, chunks, device_caches=True)
        assert device.fed == host.fed and device.chosen == host.chosen
        span = float(np.ptp(host.prefill_logits))
        np.testing.assert_allclose(np.stack(device.logits), np.stack(host.logits), rtol=0,
                                   atol=(1e-5 if dtype == "fp32" else 2e-3) * span)
    free = export_decode(lm, ref.prompt, len(ref.tokens), device_caches=True)  # greedy, its own choices
    assert free.follows(free.chosen)
    state = lm.new_device_state(8)
    with pytest.raises(ValueError, match="one row"):
        lm.forward_device(np.ones((2, 1), np.int64), state)
    if variant != "attn_dynamic":
        with pytest.raises(ValueError, match="do not fit"):
            lm.forward_device(np.ones((1, lm.max_seq_len + 1 if variant == "attn_static" else 9), np.int64), state)


@pytest.mark.parametrize("variant", ["gqa", "attn_static"])
def test_caches_on_the_device_at_the_shortest_max_seq_len_validation_takes(variant, checkpoint, tmp_path):
    """prompt + steps positions exactly: the device buffer must not outgrow the export's rotary tables."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.parity import export_decode
    from exporter.validation.validate import PARITY_PROMPT_LEN, PARITY_STEPS

    shortest = PARITY_PROMPT_LEN + PARITY_STEPS
    request = ExportRequest(model=str(checkpoint("qwen3")), variant=variant, static_cache=variant == "attn_static",
                            max_seq_len=shortest)
    lm = Decoder(export_model(request, tmp_path / variant, validate=False).out_dir)
    prompt = list(range(3, 3 + PARITY_PROMPT_LEN))
    host = export_decode(lm, prompt, PARITY_STEPS, device_caches=False)
    device = export_decode(lm, prompt, PARITY_STEPS, device_caches=True)
    assert device.fed == host.fed
    np.testing.assert_allclose(np.stack(device.logits), np.stack(host.logits), rtol=0, atol=1e-4)
