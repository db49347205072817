"""Real text as the model sees it: the checkpoint's own tokenizer, its special tokens and chat template.

A model trained with a BOS token at the start of every sequence gives garbage without it (a real
gemma3_text's perplexity on plain English went from sane to 599,000), so every text validation
feeds is tokenized the way transformers' tokenizer tokenizes it for the model: special tokens as
the tokenizer adds them, chat turns through the checkpoint's chat template.
"""

from __future__ import annotations

import functools
from pathlib import Path

from exporter.packaging.source_files import tokenizer_file_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# The parity run's real-text prompt: one user turn through the chat template (plain text, special
# tokens as the tokenizer adds them, where there is no template).
CHAT_MESSAGE = "Write one sentence about why the sea is salty."


def has_tokenizer(checkpoint: Path) -> bool:
    return any((Path(checkpoint) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(checkpoint: Path):
    """transformers' tokenizer of ``checkpoint`` (None where it has no tokenizer files); kept while
    its files are unchanged (parity, the quality gate and the genai gate of one export share it)."""
    if not has_tokenizer(checkpoint):
        return None
    # Every tokenizer file packaging copies (the chat template, merges.txt ... too): one changed is a
    # different tokenizer.
    files = [Path(checkpoint) / name for name in tokenizer_file_names(Path(checkpoint))]
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files if p.is_file())
    return _load_tokenizer(Path(checkpoint).resolve(), stamp)


@functools.lru_cache(maxsize=2)
def _load_tokenizer(checkpoint: Path, stamp: tuple):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def added_special_ids(tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer puts before and after a text when it encodes one for the model (BOS,
    say): ``encode(text)`` is ``prefix + encode(text, add_special_tokens=False) + suffix``; None
    where what it adds is not around the text."""
    probe = "Hello world"
    bare = tokenizer.encode(probe, add_special_tokens=False)
    full = tokenizer.encode(probe)
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare):])
    return None


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """``added_special_ids``, nothing where what the tokenizer adds is not around the text."""
    return added_special_ids(tokenizer) or ([], [])


def chat_prompt(tokenizer) -> tuple[list[int], str]:
    """The real-text prompt's ids and what it is: ``chat template`` (one user turn and the
    generation prompt) where the tokenizer has a template, else ``plain text`` with the special
    tokens the tokenizer adds."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(t) for t in ids], "chat template"
    return [int(t) for t in tokenizer.encode(CHAT_MESSAGE)], "plain text"
