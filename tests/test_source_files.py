"""The files of a checkpoint an export reads: where the index puts its shards, and what the local
revision (the cache key of a local checkpoint) covers."""

from __future__ import annotations

import json
import shutil

import pytest

from exporter.errors import ExportError
from exporter.packaging.resolve import resolve_source
from exporter.packaging.source_files import GENERATION_CONFIG_FILE, TOKENIZER_FILES, TOKENIZER_GLOBS
from exporter.tiny_checkpoint import shards_in_subfolder

# Every file packaging publishes beside the model (a glob's files by an example name).
PUBLISHED = [GENERATION_CONFIG_FILE, *TOKENIZER_FILES, *(g.replace("*", "cl100k_base") for g in TOKENIZER_GLOBS)]


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_local_revision_changes_with_every_file_an_export_publishes(checkpoint, tmp_path, name):
    """A fixed chat_template.jinja (or tokenizer.model, merges.txt, ...) must not return the export
    made with the old one: the revision is in the cache key."""
    source = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    (source / name).write_text("{{ messages }}")
    before = resolve_source(str(source)).revision
    (source / name).write_text("{{ messages | first }}")
    assert resolve_source(str(source)).revision != before


def test_the_local_revision_covers_the_shards_the_index_puts_in_a_subfolder(checkpoint, tmp_path):
    source = shards_in_subfolder(checkpoint("llama"), tmp_path / "ckpt", checkpoint("llama", seed=1))
    before = resolve_source(str(source)).revision
    shard = source / "sub" / "model-00001-of-00001.safetensors"
    shutil.copyfile(checkpoint("llama", seed=2) / "model.safetensors", shard)  # other weights, same shapes
    assert resolve_source(str(source)).revision != before
    index = source / "model.safetensors.index.json"
    for escaping in (str(shard), "../ckpt/sub/model-00001-of-00001.safetensors"):
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": escaping}}))
        with pytest.raises(ExportError, match="not a file name inside the checkpoint"):
            resolve_source(str(source))


def test_validation_loads_the_tokenizer_again_after_its_chat_template_changes(tmp_path):
    """Validation keeps the checkpoint's tokenizer while its files are unchanged: a worker validating
    after chat_template.jinja was fixed must build its chat prompt with the fixed template."""
    from exporter.tiny_checkpoint import make_tiny_tokenizer
    from exporter.validation.text import load_tokenizer

    source = make_tiny_tokenizer(tmp_path / "ckpt")
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_tokenizer(source).chat_template.startswith("{% for m")
    (source / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert load_tokenizer(source).chat_template == "{{ messages[0].content }}"
