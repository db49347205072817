"""The genai package gate: the export folder as onnxruntime-genai loads it, its tokenizer against
transformers', and genai's own greedy loop against the export's own session.

Runs wherever ``onnxruntime_genai`` is importable (the GPU worker image, the test extra). It loads
the package as a genai user does (``og.Model`` on the folder, providers set for the EP validated),
then:

- the tokenizer: every text of a set (plain English, unicode, code, whitespace) encodes to
  transformers' ids when genai is called as the manifest says (special tokens on: genai builds its
  tokenizer with them off), to transformers' bare ids with genai's defaults, and decodes back to
  transformers' text; with a chat template, genai's rendering of a conversation encodes to
  transformers' ``apply_chat_template`` ids;
- generation: genai's own search loop, greedy, from the real-text prompt's ids, gives the tokens the
  export's own session chose (up to an end of sequence, where genai stops).

A package genai cannot load, a tokenizer that disagrees, or a loop that departs fails the export: a
genai package the farm publishes as fine must run in genai.
"""

from __future__ import annotations

import json
from pathlib import Path

from exporter.validation.gates import GateResult

TEXTS = (
    "The capital of France is",
    "Grüße aus Köln: naïve café, 東京タワー, Ελληνικά and 🚀 emoji.",
    "def add(a, b):\n    return a + b\n",
    "Two  spaces,\ttab and\n\nblank lines.",
)
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]


def genai_importable() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except Exception:
        return False
    return True


def genai_config(export_dir: Path, ep: str, session_entries: dict[str, str] | None = None):
    """The package's own genai_config.json as genai reads it, providers set for ``ep``, and
    ``session_entries`` (onnxruntime session config entries) added to the decoder's session options
    for this run only: the files stay as published."""
    import onnxruntime_genai as og

    config = og.Config(str(export_dir))
    if session_entries:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": dict(session_entries)}}}))
    config.clear_providers()
    if ep == "cuda":
        config.append_provider("cuda")
    return config


def genai_gates(export_dir: Path, manifest: dict, checkpoint: Path, ep: str, prompt: list[int] | None,
                own_tokens: list[int] | None, eos: list[int], own_gaps: list[float] | None = None,
                near_tie: float = 0.0, session_entries: dict[str, str] | None = None,
                tokenizer_answers: Path | None = None) -> tuple[list[GateResult], dict | None]:
    """The gate's results, and what was checked (for the manifest's genai block; None: not run).
    ``prompt`` / ``own_tokens``: ids and the export's own greedy tokens after them (from parity),
    ``own_gaps`` its top-1/top-2 gap at each: genai runs the same graph with its own session
    options, so in half precision a step closer than ``near_tie`` may go either way.
    ``session_entries``: how validation makes its own session of the export (no prepacking of
    float weights, no spinning), given to genai's session too: on the CPU, making genai's session
    of a 0.5B fp16 export took 5.1 s of CPU with the weights repacked for a few dozen steps, 2.4 s
    without; the package, its graph and its config are what genai loads either way.
    ``tokenizer_answers``: where transformers' answers are kept (``text.load_tokenizer``)."""
    from exporter.validation import text

    entry = manifest.get("genai") or {}
    if not entry.get("package"):
        return [], None
    if not genai_importable():
        return [GateResult("genai", "the package loads in onnxruntime-genai", True, "not run",
                           "onnxruntime-genai importable", "onnxruntime-genai is not installed on this worker: "
                           "the package was not loaded", informational=True)], {"checked": False}
    import onnxruntime_genai as og

    checked: dict = {"checked": True, "onnxruntime_genai": getattr(og, "__version__", "unknown")}
    try:
        model = og.Model(genai_config(export_dir, ep, session_entries))
    except Exception as err:
        return [GateResult("genai", "the package loads in onnxruntime-genai", False, "error", "og.Model loads",
                           f"onnxruntime-genai could not load the package: {str(err)[:300]}")], {**checked, "loads": False}
    gates = [GateResult("genai", "the package loads in onnxruntime-genai", True, "og.Model", "og.Model loads")]
    checked["loads"] = True
    hf = text.load_tokenizer(Path(checkpoint), tokenizer_answers)
    if hf is not None and entry.get("tokenizer") == "copied":
        try:
            gates += _tokenizer_gates(og, model, hf, checked)
        except Exception as err:  # genai raised on a text: a package that fails in genai, not a crash here
            checked["tokenizer"] = False
            gates.append(GateResult("genai", "genai's tokenizer gives transformers' ids", False, "error", "none",
                                    f"onnxruntime-genai's tokenizer raised: {str(err)[:300]}"))
    if prompt and own_tokens:
        try:
            gates.append(_generation_gate(model, prompt, own_tokens, eos, checked, own_gaps or [], near_tie))
        except Exception as err:
            checked["generation"] = {"error": str(err)[:300]}
            gates.append(GateResult("genai", "genai's greedy loop gives the export's own tokens", False, "error",
                                    "all equal", f"onnxruntime-genai's generator raised: {str(err)[:300]}"))
    del model
    return gates, checked


def _tokenizer_gates(og, model, hf, checked: dict) -> list[GateResult]:
    try:
        tokenizer = og.Tokenizer(model)
    except Exception as err:
        checked["tokenizer"] = False
        return [GateResult("genai", "genai's tokenizer loads", False, "error", "og.Tokenizer loads",
                           f"onnxruntime-genai could not load the package's tokenizer: {str(err)[:300]}")]
    problems = []
    for label, add in (("with special tokens", True), ("without special tokens", False)):
        tokenizer.update_options(add_special_tokens=add)
        for sample in TEXTS:
            got = [int(t) for t in tokenizer.encode(sample)]
            want = [int(t) for t in hf.encode(sample, add_special_tokens=add)]
            if got != want:
                problems.append(f"{sample[:24]!r} {label}: genai {_clip(got)}, transformers {_clip(want)}")
    tokenizer.update_options(add_special_tokens=False)
    for sample in TEXTS:
        ids = hf.encode(sample, add_special_tokens=False)
        got, want = tokenizer.decode(ids), hf.decode(ids, skip_special_tokens=True)
        if got != want:
            problems.append(f"decode of {sample[:24]!r}: genai {got[:40]!r}, transformers {want[:40]!r}")
    chat = "no chat template"
    if getattr(hf, "chat_template", None):
        want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
        want = [int(t) for t in (want["input_ids"] if hasattr(want, "keys") else want)]
        try:
            rendered = tokenizer.apply_chat_template(json.dumps(CONVERSATION), add_generation_prompt=True)
            got = [int(t) for t in tokenizer.encode(rendered)]
        except Exception as err:
            got = None
            problems.append(f"genai cannot apply the chat template: {str(err)[:160]}")
        if got is not None and got != want:
            problems.append(f"chat template: genai {_clip(got)}, transformers {_clip(want)}")
        chat = "chat template"
    checked["tokenizer"] = not problems
    checked["texts"] = len(TEXTS)
    checked["chat_template"] = chat == "chat template"
    return [GateResult(
        "genai", f"genai's tokenizer gives transformers' ids ({len(TEXTS)} texts with and without special tokens, "
                 f"decode, {chat})", not problems, f"{len(problems)} differences", "none",
        "; ".join(problems[:4]) + (f"; {len(problems) - 4} more" if len(problems) > 4 else ""),
        details={"differences": problems})]


def _generation_gate(model, prompt: list[int], own: list[int], eos: list[int], checked: dict, gaps: list[float],
                     near_tie: float) -> GateResult:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    # greedy as the export's own session chose, whatever the package's search defaults (taken from
    # generation_config.json: a repetition penalty or a minimum length would change the tokens)
    params.set_search_options(do_sample=False, num_beams=1, repetition_penalty=1.0, min_length=0,
                              no_repeat_ngram_size=0, max_length=len(prompt) + len(own))
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    got = [int(t) for t in generator.get_sequence(0)][len(prompt):]
    # genai ends at an end of sequence, with or without it in the sequence (0.18 leaves it out):
    # the tokens before it are compared
    stop = next((i for i, t in enumerate(own) if t in eos), None)
    want = own if stop is None else own[:stop]
    if got and got[-1] in eos:
        got = got[:-1]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    # where the export's own choice was a near tie, the two runs of one graph parted on rounding
    # (one of them may have ended the sequence there); their histories differ from there, so
    # nothing after it can be compared
    tie = got != want and first < len(gaps) and gaps[first] < near_tie
    ok = got == want or tie
    checked["generation"] = {"prompt_tokens": len(prompt), "tokens": len(got), "equal": got == want,
                             "near_tie_at": first if tie else None}
    return GateResult(
        "genai", f"genai's greedy loop gives the export's own tokens ({len(want)} tokens)", ok,
        f"{first}/{len(want)} equal", f"all equal up to a near tie (gap < {near_tie:g})",
        "" if got == want else
        (f"genai parts at token {first}, where the export's own top-1/top-2 gap is {gaps[first]:.3g} (a near tie)"
         if tie else f"genai departs at token {first}: genai {_say(got[first:])} from there, the export's session "
                     f"{_say(want[first:])}"))


def _say(ids: list[int]) -> str:
    return _clip(ids) if ids else "ends the sequence"


def _clip(ids: list[int], n: int = 12) -> str:
    return str(ids[:n])[:-1] + (", ...]" if len(ids) > n else "]")
