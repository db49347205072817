"""Greedy generation the way onnxruntime-genai's own loop runs it, shared by the genai tests and
benchmarks/quant_quality.py."""

from __future__ import annotations


def genai_greedy(model, prompt: list[int], new_tokens: int, *, through_eos: bool = False) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` from an ``og.Model``; ``through_eos`` keeps
    going past an end of sequence (min_length = max_length, as min_new_tokens does in transformers)."""
    import onnxruntime_genai as og

    total = len(prompt) + new_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=total, **({"min_length": total} if through_eos else {}))
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]


def genai_multimodal_run(model, inputs, steps: int) -> tuple[list[int], list]:
    """genai's greedy loop from its multimodal processor's ``inputs``: (the ``steps`` tokens, the logits that chose
    each one)."""
    import onnxruntime_genai as og

    prompt = inputs["input_ids"].as_numpy().shape[1]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=prompt + steps, min_length=prompt + steps)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    logits = []
    for _ in range(steps):
        logits.append(generator.get_logits().reshape(-1).copy())  # the next token's (genai runs the step eagerly)
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[prompt:]], logits


def worst_of_range(ours: list, theirs: list) -> float:
    """The largest |ours - theirs| of any step, as a share of that step's reference logit range."""
    import numpy as np

    return max(float(np.abs(a - b).max() / np.ptp(b)) for a, b in zip(ours, theirs, strict=True))


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """What a generation loop emits: the tokens up to and including the first end of sequence."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def variant_exports(checkpoint, root, max_seq_len: int):
    """variant -> the farm export of ``checkpoint`` in that variant under ``root`` (made once, not validated): what
    the genai image-text tests run genai on."""
    import functools

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    @functools.cache
    def make(variant: str):
        request = ExportRequest(model=str(checkpoint), variant=variant, static_cache=variant == "attn_static",
                                max_seq_len=max_seq_len)
        return export_model(request, root / variant, validate=False)

    return make
