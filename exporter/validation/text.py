"""Real text as the model sees it: the checkpoint's own tokenizer, its special tokens and chat template.

A model trained with a BOS token at the start of every sequence gives garbage without it (a real
gemma3_text's perplexity on plain English went from sane to 599,000), so every text validation
feeds is tokenized the way transformers' tokenizer tokenizes it for the model: special tokens as
the tokenizer adds them, chat turns through the checkpoint's chat template.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path

from exporter.cache import cache_key, mark_used, write_atomic
from exporter.packaging.source_files import tokenizer_file_names
from exporter.versions import package_version

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Files of a checkpoint directory that are weights, not what its tokenizer reads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".ot", ".tflite",
                   ".onnx", ".data", ".npz", ".npy", ".pkl")
# What decides transformers' answers besides the files: its version, its tokenizers' and the chat
# templates' renderer's.
TOKENIZER_PACKAGES = ("transformers", "tokenizers", "jinja2")
# The parity run's real-text prompt: one user turn through the chat template (plain text, special
# tokens as the tokenizer adds them, where there is no template).
CHAT_MESSAGE = "Write one sentence about why the sea is salty."


def has_tokenizer(checkpoint: Path) -> bool:
    return any((Path(checkpoint) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(checkpoint: Path, answers: Path | None = None):
    """transformers' tokenizer of ``checkpoint`` (None where it has no tokenizer files); kept while
    its files are unchanged (parity, the quality gate and the genai gate of one export share it).
    With ``answers`` (a cache directory): a ``KeptAnswers`` in its place, which gives what it
    answered before without loading it."""
    if not has_tokenizer(checkpoint):
        return None
    if answers is not None:
        return KeptAnswers(Path(checkpoint), Path(answers))
    # Every tokenizer file packaging copies (the chat template, merges.txt ... too): one changed is a
    # different tokenizer.
    files = [Path(checkpoint) / name for name in tokenizer_file_names(Path(checkpoint))]
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files if p.is_file())
    return _load_tokenizer(Path(checkpoint).resolve(), stamp)


@functools.lru_cache(maxsize=2)
def _load_tokenizer(checkpoint: Path, stamp: tuple):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


class KeptAnswers:
    """transformers' tokenizer of a checkpoint, asked through what validation asks of it (``encode``,
    ``decode``, ``apply_chat_template`` with ``tokenize=True``, ``chat_template``), its answers kept
    in a file of the cache directory: a validation in a fresh process whose questions were all
    answered before imports neither transformers nor torch nor parses the tokenizer (a 0.5B's:
    3.5 s of CPU of its validation's 26). The file is keyed by the content of every file of the
    checkpoint that is not weights and by the versions of ``TOKENIZER_PACKAGES``: the answers are a
    function of those and of the question, like the reference runs kept beside them. A question
    not in the file loads the tokenizer and asks it (what it raises, the caller gets)."""

    def __init__(self, checkpoint: Path, cache_dir: Path):
        self.checkpoint = checkpoint
        self.path = cache_dir / f"tokenizer-{_answers_key(checkpoint)}.json"
        self._lock = threading.Lock()
        try:
            self._answers = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._answers = {}
        if not isinstance(self._answers, dict):
            self._answers = {}
        if self._answers:
            mark_used(self.path)  # a hit, as the reference runs beside it count theirs (LRU eviction)

    def _ask(self, question: list, answer):
        key = json.dumps(question, sort_keys=True, ensure_ascii=False)
        with self._lock:
            if key in self._answers:
                return self._answers[key]
        value = answer(load_tokenizer(self.checkpoint))
        with self._lock:
            self._answers[key] = value
            write_atomic(self.path, json.dumps(self._answers, ensure_ascii=False).encode())
        return value

    @property
    def chat_template(self) -> str | None:
        return self._ask(["chat_template"], lambda t: getattr(t, "chat_template", None) or None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._ask(["encode", text, add_special_tokens],
                         lambda t: [int(i) for i in t.encode(text, add_special_tokens=add_special_tokens)])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        return self._ask(["decode", ids, skip_special_tokens],
                         lambda t: t.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int]:
        if not tokenize:
            raise ValueError("KeptAnswers keeps the ids of a chat template, not its text")

        def ids(t) -> list[int]:
            out = t.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
            out = out["input_ids"] if hasattr(out, "keys") else out  # a BatchEncoding in some versions
            return [int(i) for i in out]

        return self._ask(["apply_chat_template", messages, add_generation_prompt], ids)


def _answers_key(checkpoint: Path) -> str:
    """What the tokenizer's answers depend on, hashed: every file of ``checkpoint`` but its weights,
    name and content (a tokenizer.json of a few MB hashes in milliseconds), and the versions."""
    digest = hashlib.sha256()
    for path in sorted(Path(checkpoint).iterdir()):
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return cache_key({"files": digest.hexdigest(), **{name: package_version(name) for name in TOKENIZER_PACKAGES}})


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
