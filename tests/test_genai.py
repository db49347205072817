"""Exports run in onnxruntime-genai unchanged: genai_config.json, tokenizer files, greedy parity.

The packages are loaded by the real onnxruntime-genai (CPU wheel from PyPI) from the export folder as
written, and its greedy tokens are compared with transformers' generate on the same weights.
"""

from __future__ import annotations

import functools
import json
import shutil

import onnx
import onnxruntime_genai as og
import pytest

from exporter.errors import ExportError

from exporter.packaging.genai import (
    GENAI_CONFIG_FILE,
    GENAI_RUNTIME,
    GENAI_TOKENIZER_USE,
    search_defaults,
    special_token_ids,
)
from exporter.packaging.package import MANIFEST_FILE, MODEL_FILE, sha256_file
from exporter.pipeline import export_model
from exporter.validation.reference import load_reference, reference_greedy
from tests.genai_greedy import genai_greedy
from exporter.request import ExportRequest, Variant
from exporter.tiny_checkpoint import (
    TINY_TOKENIZER_VOCAB,
    make_tiny_checkpoint,
    make_tiny_tokenizer,
)
from exporter.tiny_checkpoint import MOE_ARCHITECTURES, NEW_ARCHITECTURES, TEXT_HYBRID_ARCHITECTURES
from tests.conftest import ARCHITECTURES, MAX_SEQ_LEN

NEW_TOKENS = 20
PROMPT = "hello onnx runtime, the quick brown fox"
GENAI_VARIANTS = ["gqa", "attn_dynamic"]


@pytest.fixture(scope="module")
def tokenized_checkpoint(tmp_path_factory):
    """tokenized_checkpoint(arch) -> a random-weight checkpoint that carries a real (tiny BPE) tokenizer."""
    root = tmp_path_factory.mktemp("genai-ckpt")

    @functools.cache
    def make(arch: str):
        source = make_tiny_checkpoint(arch, root / arch, vocab_size=TINY_TOKENIZER_VOCAB)
        return make_tiny_tokenizer(source)

    return make


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory, tokenized_checkpoint):
    """genai_export(arch, variant, dtype="fp32", ep="cpu") -> export directory of a tokenized checkpoint."""
    root = tmp_path_factory.mktemp("genai-exports")

    @functools.cache
    def make(arch: str, variant: str, dtype: str, ep: str):
        request = ExportRequest(
            model=str(tokenized_checkpoint(arch)), dtype=dtype, ep=ep, variant=variant, max_seq_len=MAX_SEQ_LEN
        )
        return export_model(request, root / f"{arch}-{variant}-{dtype}-{ep}", validate=False).out_dir

    # one export per request however it is spelled (dtype given or left to its default)
    return lambda arch, variant, dtype="fp32", ep="cpu": make(arch, variant, dtype, ep)


def _genai_config(export_dir) -> dict:
    return json.loads((export_dir / GENAI_CONFIG_FILE).read_text())


def _manifest(export_dir) -> dict:
    return json.loads((export_dir / MANIFEST_FILE).read_text())


def _genai_greedy(export_dir, prompt: list[int], new_tokens: int) -> list[int]:
    return genai_greedy(og.Model(str(export_dir)), prompt, new_tokens, through_eos=True)


def _transformers_greedy(checkpoint, prompt: list[int], new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


# Every dense architecture in both variants genai runs; the mixtures of experts too (gpt-oss: gqa only,
# its attention sinks exist in GroupQueryAttention alone).
GENAI_CASES = [(arch, variant) for arch in ARCHITECTURES for variant in GENAI_VARIANTS] + [
    (arch, variant) for arch in MOE_ARCHITECTURES for variant in GENAI_VARIANTS if arch != "gpt_oss" or variant == "gqa"] + [
    # Hybrids: genai carries their recurrent states (past_conv.%d / past_recurrent.%d) from genai_config.json.
    # (Qwen3.5's image-text checkpoints are genai's qwen3_5 / qwen3_5_moe image-text packages:
    # tests/test_genai_vlm_qwen3_5.py.)
    (arch, variant) for arch in TEXT_HYBRID_ARCHITECTURES for variant in GENAI_VARIANTS] + [
    # The 2025-26 families; deepseek_v3's latent cache is one KV head of kv_lora_rank + qk_rope_head_dim;
    # llama4_text's chunked attention has no gqa form.
    (arch, variant) for arch in NEW_ARCHITECTURES for variant in GENAI_VARIANTS if arch != "llama4_text" or variant != "gqa"]


@pytest.mark.parametrize("arch, variant", GENAI_CASES)
def test_genai_greedy_tokens_equal_transformers(arch, variant, genai_export, tokenized_checkpoint):
    from transformers import AutoTokenizer

    export_dir = genai_export(arch, variant)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenized_checkpoint(arch)))
    genai_tokenizer = og.Tokenizer(og.Model(str(export_dir)))
    ids = hf_tokenizer(PROMPT).input_ids
    # The copied tokenizer files mean the same thing to genai as to transformers.
    assert [int(t) for t in genai_tokenizer.encode(PROMPT)] == ids
    assert genai_tokenizer.decode(ids) == PROMPT
    prompt = [hf_tokenizer.bos_token_id, *ids]

    genai_tokens = _genai_greedy(export_dir, prompt, NEW_TOKENS)
    assert len(genai_tokens) == NEW_TOKENS
    assert genai_tokens == _transformers_greedy(tokenized_checkpoint(arch), prompt, NEW_TOKENS)


@pytest.mark.parametrize("variant", GENAI_VARIANTS)
def test_genai_greedy_across_the_longrope_switch(variant, genai_export, tokenized_checkpoint):
    """Tiny phi3 switches to its long rope factors past 64 positions; 50 + 20 tokens cross it mid-decode.

    The reference is transformers' forward with its KV cache kept, step by step, as genai keeps it.
    (transformers' Phi3 ``generate`` instead drops the cache at the switch and recomputes the whole
    prefix with the long factors, which no KV-cached runtime does, so its tokens differ from there on.)
    """
    prompt = [1, *(3 + (7 * i) % 290 for i in range(49))]
    genai_tokens = _genai_greedy(genai_export("phi3", variant), prompt, NEW_TOKENS)
    reference = reference_greedy(load_reference(tokenized_checkpoint("phi3")), prompt, NEW_TOKENS)
    assert genai_tokens == reference.tokens


@pytest.mark.parametrize("variant", GENAI_VARIANTS)
def test_genai_config_follows_the_graph_and_the_checkpoint(variant, genai_export):
    export_dir = genai_export("qwen3", variant)
    config = _genai_config(export_dir)
    model, search = config["model"], config["search"]
    decoder = model["decoder"]
    assert model["type"] == "qwen3"
    assert model["context_length"] == search["max_length"] == MAX_SEQ_LEN
    assert model["vocab_size"] == TINY_TOKENIZER_VOCAB
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (1, 2, 0)
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["head_size"]) == (4, 2, 16)
    assert (decoder["num_hidden_layers"], decoder["hidden_size"], decoder["filename"]) == (2, 64, MODEL_FILE)
    assert decoder["session_options"]["provider_options"] == []
    # onnxruntime's thread count (a thread per physical core), not genai's half of the logical CPUs
    assert decoder["session_options"]["intra_op_num_threads"] == 0
    assert search["past_present_share_buffer"] is (variant == "gqa")
    assert search["do_sample"] is False

    # Every name genai will feed or read is exactly a graph input / output of model.onnx, and back.
    graph = onnx.load(str(export_dir / MODEL_FILE), load_external_data=False).graph
    layers = range(decoder["num_hidden_layers"])
    inputs, outputs = decoder["inputs"], decoder["outputs"]
    fed = {v for k, v in inputs.items() if not k.endswith("_names")}
    fed |= {inputs[k] % i for k in ("past_key_names", "past_value_names") for i in layers}
    read = {outputs["logits"]} | {outputs[k] % i for k in ("present_key_names", "present_value_names") for i in layers}
    assert fed == {i.name for i in graph.input}
    assert read == {o.name for o in graph.output}
    assert ("position_ids" in inputs) is (variant == "attn_dynamic")


def test_cuda_export_carries_cuda_provider_options(genai_export):
    export_dir = genai_export("llama", "gqa", "fp16", "cuda")  # built on the CPU, never run here
    config = _genai_config(export_dir)
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]
    assert "intra_op_num_threads" not in config["model"]["decoder"]["session_options"]
    assert config["search"]["past_present_share_buffer"] is True


def test_manifest_lists_genai_runtime_and_files(genai_export, tokenized_checkpoint):
    export_dir = genai_export("llama", "gqa")
    manifest = _manifest(export_dir)
    genai = manifest["genai"]
    assert genai == {
        "package": True,
        "runtime": GENAI_RUNTIME,
        "reason": None,
        "config": GENAI_CONFIG_FILE,
        "model_type": "llama",  # what genai runs it as
        "files": [GENAI_CONFIG_FILE, "tokenizer.json", "tokenizer_config.json"],
        "tokenizer": "copied",
        # what transformers' tokenizer adds, written for genai's (tokenizer_config.json), and how to call it
        "special_tokens": {"add_bos_token": False, "add_eos_token": False},
        "tokenizer_use": GENAI_TOKENIZER_USE,
    }
    for name in genai["files"]:
        path = export_dir / name
        assert manifest["files"][name] == {"sha256": sha256_file(path), "size": path.stat().st_size}
    # tokenizer.json copied byte for byte; tokenizer_config.json the source's, the flags made explicit
    source = tokenized_checkpoint("llama")
    assert sha256_file(export_dir / "tokenizer.json") == sha256_file(source / "tokenizer.json")
    written = json.loads((export_dir / "tokenizer_config.json").read_text())
    assert written == {**json.loads((source / "tokenizer_config.json").read_text()), **genai["special_tokens"]}


def test_missing_tokenizer_gives_a_package_without_tokenizer_files(exported):
    export_dir = exported("llama", "gqa")  # the shared tiny checkpoint has no tokenizer
    genai = _manifest(export_dir)["genai"]
    assert genai["package"] is True and genai["tokenizer"] == "missing"
    assert "no tokenizer files" in genai["reason"]
    assert genai["files"] == [GENAI_CONFIG_FILE]
    assert not [p.name for p in export_dir.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges"))]
    # Still runs in genai from token ids; only text in / out needs a tokenizer.
    assert len(_genai_greedy(export_dir, [1, 17, 42, 99], 4)) == 4
    with pytest.raises(RuntimeError, match="tokenizer_config.json"):
        og.Tokenizer(og.Model(str(export_dir)))


def test_attn_static_is_not_a_genai_package(genai_export):
    export_dir = genai_export("llama", "attn_static")
    genai = _manifest(export_dir)["genai"]
    assert genai["package"] is False and genai["runtime"] is None and genai["config"] is None
    assert "write_indices" in genai["reason"] and "nonpad_kv_seqlen" in genai["reason"]
    assert not (export_dir / GENAI_CONFIG_FILE).exists()
    # The tokenizer still travels with the model: a static-cache runtime needs it too.
    assert genai["tokenizer"] == "copied" and (export_dir / "tokenizer.json").is_file()


def test_validated_export_keeps_the_genai_block(tokenized_checkpoint, tmp_path):
    request = ExportRequest(model=str(tokenized_checkpoint("qwen2")), variant="gqa", max_seq_len=64)
    result = export_model(request, tmp_path / "validated")
    manifest = _manifest(result.out_dir)
    assert manifest["status"] == "ready" and manifest["genai"]["package"] is True
    assert {GENAI_CONFIG_FILE, "tokenizer.json", "parity_report.json"} <= set(manifest["files"])
    assert _genai_config(result.out_dir)["model"]["context_length"] == 64


def test_generation_config_sets_token_ids_and_search_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
         "eos_token_id": [2, 7], "max_length": 20}
    ))
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert special_token_ids(tmp_path) == (1, [2, 7], 2)
    search = search_defaults(generation, Variant.ATTN_DYNAMIC, 4096)
    assert search["do_sample"] is True and search["temperature"] == 0.7 and search["top_k"] == 20
    assert search["top_p"] == 0.8 and search["repetition_penalty"] == 1.05
    assert search["max_length"] == 4096  # the context, not generation_config's default 20
    assert search["past_present_share_buffer"] is False


def test_genai_config_is_written_from_no_checkpoint_file_that_leads_outside_it(checkpoint, tmp_path):
    """genai_config.json is published with the export: what it takes from generation_config.json must
    come from the checkpoint's own file, not from one a link leads to elsewhere."""
    source = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere.json"
    (source / "generation_config.json").rename(elsewhere)
    (source / "generation_config.json").symlink_to(elsewhere)
    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic", max_seq_len=64)
    with pytest.raises(ExportError, match="generation_config.json in ckpt leads outside the checkpoint"):
        export_model(request, tmp_path / "out", validate=False)
    assert not (tmp_path / "out").exists()


def test_tokenizer_eos_joins_config_eos_without_generation_config(tmp_path):
    # A chat model: config.json names end-of-text, the tokenizer ends each turn with <|im_end|>.
    make_tiny_tokenizer(tmp_path)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"].append({"id": 299, "content": "<|im_end|>", "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|im_end|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert special_token_ids(tmp_path) == (1, [2, 299], 0)


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory):
    """A tokenized checkpoint whose tokenizer starts every text with BOS, as Gemma's and Llama's do."""
    root = tmp_path_factory.mktemp("genai-bos")
    source = make_tiny_checkpoint("llama", root / "ckpt", vocab_size=TINY_TOKENIZER_VOCAB)
    return make_tiny_tokenizer(source, bos=True)


def _validated(source, out, variant="gqa"):
    from exporter.validation.validate import validate_export

    request = ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant=variant, max_seq_len=MAX_SEQ_LEN)
    export_dir = export_model(request, out, validate=False).out_dir
    return export_dir, validate_export(export_dir)


def test_the_genai_gate_loads_the_package_and_checks_tokenizer_and_generation(bos_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(bos_checkpoint)).encode("hi")[0] == 1  # transformers adds BOS
    export_dir, report = _validated(bos_checkpoint, tmp_path / "e")
    genai = {g.check: g for g in report.gates if g.gate == "genai"}
    assert report.passed, report.summary()
    assert len(genai) == 3 and all(g.status == "pass" for g in genai.values()), genai
    assert report.genai["loads"] and report.genai["tokenizer"] and report.genai["generation"]["equal"]
    assert report.genai["generation"]["tokens"] > 0
    special = _manifest(export_dir)["genai"]["special_tokens"]
    assert special == {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>"}
    # genai, called as the manifest says, gives the BOS transformers adds
    tokenizer = og.Tokenizer(og.Model(str(export_dir)))
    tokenizer.update_options(add_special_tokens=True)
    assert list(tokenizer.encode("hello onnx")) == AutoTokenizer.from_pretrained(str(bos_checkpoint)).encode("hello onnx")


def test_a_tokenizer_whose_bos_handling_disagrees_fails_the_genai_gate(tokenized_checkpoint, tmp_path):
    """tokenizer_config.json says add_bos_token while transformers' tokenizer (its post-processor)
    adds none: genai's tokenizer would add a BOS transformers never does. Packaged as the checkpoint
    has it, the gate fails naming the difference; the packager's explicit flags make it pass."""
    from exporter.validation.validate import validate_export

    source = tmp_path / "ckpt"
    shutil.copytree(tokenized_checkpoint("llama"), source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    export_dir, report = _validated(source, tmp_path / "e")
    assert report.passed, report.summary()  # the packaged flags say what transformers does
    shutil.copyfile(source / "tokenizer_config.json", export_dir / "tokenizer_config.json")  # as copied before
    report = validate_export(export_dir)
    [failed] = [g for g in report.failed if g.gate == "genai"]
    assert failed.check.startswith("genai's tokenizer gives transformers' ids")
    assert "with special tokens: genai [1, " in failed.message, failed.message
    assert report.genai["tokenizer"] is False


def test_a_unigram_tokenizer_genai_reads_as_bpe_is_named_unusable(tokenized_checkpoint, tmp_path):
    from exporter.packaging.genai import align_special_tokens

    out = tmp_path / "pkg"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenized_checkpoint("llama") / name, out / name)
    data = json.loads((out / "tokenizer.json").read_text())
    data["model"] = {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["a", -1.0]]}
    (out / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GemmaTokenizerFast"}))
    written, reason = align_special_tokens(tokenized_checkpoint("llama"), out)
    assert written == {} and "holds a Unigram model" in reason and "type must be object, but is array" in reason


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_the_genai_gate_makes_its_session_as_validation_makes_its_own(genai_export, monkeypatch, capfd, dtype):
    """Validation gives onnxruntime-genai's session of the package the options of its own session:
    a float export's weights are not repacked for the few dozen steps the gate runs (0.5B fp16 on
    the CPU: 5.1 s of CPU to make that session with them, 2.4 s without), a quantized one's are
    (MatMulNBits runs on them), and no thread spins. onnxruntime's log says what it was given."""
    import re

    from exporter.validation.validate import validate_export

    export_dir = genai_export("llama", "gqa", dtype)
    real = og.Model

    def logged(config):  # the config genai is given, onnxruntime asked to log the session's options
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"log_severity_level": 1}}}}))
        return real(config)

    monkeypatch.setattr(og, "Model", logged)
    report = validate_export(export_dir)
    assert report.genai["loads"], report.summary()
    [options] = re.findall(r"config_options: \{([^}]*)\}", capfd.readouterr().err)
    assert ("session.disable_prepacking: 1" in options) == (dtype != "int4"), options
    assert "session.intra_op.allow_spinning: 0" in options, options


def test_a_validation_whose_tokenizer_questions_were_answered_before_loads_neither_transformers_nor_torch(
        bos_checkpoint, tmp_path):
    """transformers' answers about the checkpoint's tokenizer (the parity prompt, the genai gate's
    texts) are kept beside the reference runs: validating again in a fresh process gives the same
    gates without importing transformers or torch (3.5 s of CPU of a 0.5B validation's 26)."""
    import subprocess
    import sys

    request = ExportRequest(model=str(bos_checkpoint), dtype="fp32", ep="cpu", variant="gqa", max_seq_len=MAX_SEQ_LEN)
    export_dir = export_model(request, tmp_path / "e", validate=False).out_dir
    code = ("import json, sys; from pathlib import Path; from exporter.validation.validate import validate_export; "
            f"r = validate_export(Path({str(export_dir)!r}), reference_cache=Path({str(tmp_path / 'cache')!r})); "
            "print(json.dumps({'gates': [g.to_dict() for g in r.gates if g.gate != 'weights'], "
            "'loaded': sorted({'torch', 'transformers'} & set(sys.modules))}))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["loaded"] == ["torch", "transformers"]  # the first asks transformers (and runs the reference)
    assert runs[1]["loaded"] == [] and runs[1]["gates"] == runs[0]["gates"]
    genai = [g for g in runs[1]["gates"] if g["gate"] == "genai"]
    assert len(genai) == 3 and all(g["status"] == "pass" for g in genai), genai


def test_kept_tokenizer_answers_are_transformers_own_and_follow_the_checkpoints_files(tokenized_checkpoint, tmp_path):
    """What ``KeptAnswers`` gives is what transformers' tokenizer says, asked or read back from the
    file; a tokenizer file changed in the checkpoint is another key, so a kept answer never stands
    for a tokenizer that would now say something else."""
    from transformers import AutoTokenizer

    from exporter.validation.gates.genai import CONVERSATION, TEXTS
    from exporter.validation.text import KeptAnswers, load_tokenizer

    source = shutil.copytree(tokenized_checkpoint("llama"), tmp_path / "ckpt")
    cache = tmp_path / "cache"
    hf = AutoTokenizer.from_pretrained(str(source))
    for kept in (load_tokenizer(source, cache), KeptAnswers(source, cache)):  # asked, then read back
        assert isinstance(kept, KeptAnswers) and kept.chat_template is None
        for text in TEXTS:
            ids = hf.encode(text, add_special_tokens=False)
            assert kept.encode(text) == hf.encode(text) and kept.encode(text, add_special_tokens=False) == ids
            assert kept.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    changed = load_tokenizer(source, cache)
    assert changed.path != kept.path and changed.chat_template == config["chat_template"]
    want = AutoTokenizer.from_pretrained(str(source)).apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                                           tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert changed.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True) == list(want)
