"""Shared fixtures: tiny random-weight checkpoints of real architectures and their exports."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from exporter.pipeline import export_model  # noqa: E402
from exporter.validation.reference import load_reference, reference_greedy  # noqa: E402
from exporter.request import ExportRequest  # noqa: E402
from exporter.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "granite", "olmo2", "smollm3"]
VARIANTS = ["attn_dynamic", "gqa", "attn_static"]
MAX_SEQ_LEN = 128
DECODE_STEPS = 24

import onnxruntime  # noqa: E402

HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a CUDA device (CUDAExecutionProvider)")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("exportfarm")


@pytest.fixture(scope="session")
def checkpoint(workdir):
    """checkpoint(arch, **kw) -> directory of a random-weight checkpoint (built once per arguments)."""

    @functools.cache
    def make(arch: str, **kwargs) -> Path:
        tag = "-".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
        return make_tiny_checkpoint(arch, workdir / "ckpt" / f"{arch}{'-' + tag if tag else ''}", **kwargs)

    return lambda arch, **kw: make(arch, **kw)


@pytest.fixture(scope="session")
def exported(workdir, checkpoint):
    """exported(arch, variant, dtype) -> export directory (exported once per arguments)."""

    @functools.cache
    def make(arch: str, variant: str, dtype: str = "fp32", ckpt_kwargs: tuple = ()) -> Path:
        source = checkpoint(arch, **dict(ckpt_kwargs))
        out = workdir / "exports" / f"{source.name}-{variant}-{dtype}"
        request = ExportRequest(
            model=str(source), dtype=dtype, ep="cpu", variant=variant,
            static_cache=variant == "attn_static", max_seq_len=MAX_SEQ_LEN,
        )
        return export_model(request, out, validate=False).out_dir

    # one cache entry per export, however the call spells its defaults (two entries would write one directory twice)
    return lambda arch, variant, dtype="fp32", ckpt_kwargs=(): make(arch, variant, dtype, tuple(ckpt_kwargs))


@pytest.fixture(scope="session")
def reference(checkpoint):
    """reference(arch, prompt_len) -> transformers greedy run on the same weights (fp32)."""

    @functools.cache
    def make(arch: str, prompt_len: int = 12, ckpt_kwargs: tuple = ()):
        model = load_reference(checkpoint(arch, **dict(ckpt_kwargs)))
        prompt = [int(t) for t in np.random.default_rng(len(arch) + prompt_len).integers(3, 250, size=prompt_len)]
        return reference_greedy(model, prompt, DECODE_STEPS)

    return lambda arch, prompt_len=12, ckpt_kwargs=(): make(arch, prompt_len, tuple(ckpt_kwargs))


@pytest.fixture
def small_filesystem(tmp_path):
    """small_filesystem(size) -> an empty directory on a tmpfs of ``size`` ("256k", "96m"): a real
    filesystem that fills up (ENOSPC) and reports its own free space. Skipped where this process
    may not mount one (mount needs root or CAP_SYS_ADMIN)."""
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"filesystem-{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], check=False)
