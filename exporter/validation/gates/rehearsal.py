"""The decode rehearsal: the export's build, at a tiny size, driven as the benchmark and a serving
runtime drive it, in a process of its own.

Parity and the quality gate run the export without CUDA graphs; the benchmark (and onnxruntime-genai
with ``enable_cuda_graph``) capture a decode step once and replay it, with the caches bound in place
and the logits read back from device buffers. A runtime can be right in the first way and crash in
the second: onnxruntime-gpu 1.31.1 crashed with SIGSEGV in every bench of a bf16 export (the export
driver read bf16 logits back through a Cast session that was itself made for graph capture), after
validation had passed. So on CUDA, for the variants that capture, validation rehearses: a random
checkpoint of the export's architecture at a tiny size (``exporter.tiny_checkpoint``) is exported with
the export's own request (variant, dtype, activations, quantization), then prefilled and decoded under
capture at two contexts, twice each, by ``Decoder`` in a child process
(``exporter.runtime.isolated``). A crash there fails the gate with the signal and the step; the
replayed steps must also give the logits a normal run gives for the same inputs (a graph replaying
stale addresses computes something else).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from exporter.validation.gates import GateResult

CONTEXTS = (8, 16)
REPEATS = 2
STEPS, WARMUP = 4, 2
# A replayed step runs the same kernels on the same inputs as a normal run: any difference beyond
# rounding (the same reductions, possibly in another order) means it read something else.
REPLAY_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2, "fp32": 1e-4}
# The tiny checkpoints' expert widths raised to 64: CUDA's QMoE takes widths in multiples of 64.
MOE_WIDTHS = {"intermediate_size": 64, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
# gemma4's tiny checkpoints are dense: an export with experts rehearses a twin with some (enable_moe_block).
GEMMA4_TYPES = ("gemma4_text", "gemma4")
GEMMA4_EXPERTS = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64}


def rehearse(export_dir: str, ep: str) -> dict:
    """In the child: each context prefilled and decoded with capture ``REPEATS`` times (fresh caches,
    new buffers each time, every decode's logits read back), then once without capture on the same
    inputs; returns the largest difference between a replayed and a normal run's logits."""
    from exporter.runtime.session import Decoder

    decoder = Decoder(Path(export_dir), ep, cuda_graph=True)
    rng = np.random.default_rng(0)
    worst, runs = 0.0, 0
    for ctx in CONTEXTS:
        tokens = rng.integers(3, decoder.vocab, size=(1, ctx))
        buffer = ctx + WARMUP + STEPS
        replayed = []
        for _ in range(REPEATS):
            caches = decoder.new_caches(buffer)
            decoder.prefill_bound(tokens, caches, buffer)
            replayed.append(decoder.decode_bound(caches, ctx, buffer, STEPS, WARMUP)[1])
            runs += 1
        caches = decoder.new_caches(buffer)
        decoder.prefill_bound(tokens, caches, buffer)
        plain = decoder.decode_bound(caches, ctx, buffer, STEPS, WARMUP, capture=False)[1]
        for logits in replayed:
            if not np.isfinite(logits).all():
                return {"runs": runs, "max_diff": float("inf")}
            worst = max(worst, float(np.abs(logits.astype(np.float32) - plain.astype(np.float32)).max()))
    return {"runs": runs, "max_diff": worst}


def captures(variant: str, ep: str) -> bool:
    """Whether the benchmark (and a serving runtime) captures this export's decode step in a CUDA graph."""
    return ep == "cuda" and variant != "attn_dynamic"


def rehearsal_gate(manifest: dict, config: dict, activations: str, ep: str, runner=rehearse) -> GateResult:
    """The rehearsal as a gate (``runner`` runs in the child: tests hand it a broken one)."""
    from exporter.errors import ExportError
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.isolated import NativeCrash, ProcessLost, run_isolated
    from exporter.tiny_checkpoint import ARCH_CONFIGS, MOE_ARCHITECTURES, make_tiny_checkpoint

    arch = config.get("architecture")
    check = f"decode under CUDA graph capture and replay, as bench drives it ({activations}; a tiny export of this build)"
    if arch not in ARCH_CONFIGS or not manifest.get("request"):
        return GateResult("runtime", check, True, "not run", "no crash, replay == normal run",
                          f"no tiny checkpoint of {arch!r} to rehearse with", informational=True)
    request = dict(manifest["request"])
    quant = dict(request.get("quant") or {})
    if (manifest.get("quantization") or {}).get("activations"):
        quant["activations"] = activations  # the export's own, whatever the tiny model would measure
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as work:
        overrides = {k: v for k, v in MOE_WIDTHS.items() if k in ARCH_CONFIGS[arch][1] or
                     (k == "intermediate_size" and arch in MOE_ARCHITECTURES)}
        if config.get("moe") and arch in GEMMA4_TYPES:  # gemma4's experts, switched on by config.json (dense twin else)
            overrides.update(GEMMA4_EXPERTS)
        checkpoint = make_tiny_checkpoint(arch, Path(work) / "checkpoint", **overrides)
        tiny = ExportRequest(**{**request, "model": str(checkpoint), "max_seq_len":
                                (max(CONTEXTS) + WARMUP + STEPS) * 2 if request.get("static_cache") else None,
                                **({"quant": quant} if quant else {}), "layout": "farm"})
        try:
            export_model(tiny, Path(work) / "export", validate=False)
        except ExportError as err:
            return GateResult("runtime", check, True, "not run", "no crash, replay == normal run",
                              f"the tiny twin of this build could not be exported ({err})", informational=True)
        try:
            found = run_isolated(runner, str(Path(work) / "export"), ep,
                                 what=f"the decode rehearsal ({activations} activations on {ep})")
        except NativeCrash as crash:
            return GateResult("runtime", check, False, f"crashed ({crash.signal_name})", "no crash, replay == normal run",
                              f"{crash}: a serving runtime that captures CUDA graphs (and this farm's benchmark) "
                              "would crash the same way", details={"phase": crash.phase, "frames": crash.frames})
        except ProcessLost as lost:
            return GateResult("runtime", check, False, "lost", "no crash, replay == normal run", str(lost))
        except Exception as err:  # the runtime refused the pattern: the finding, as the probe's
            from exporter import checkpoints

            if checkpoints.is_stop(err):
                raise
            return GateResult("runtime", check, False, "error", "no crash, replay == normal run",
                              f"onnxruntime could not run the tiny twin under capture: {str(err)[:300]}")
    limit = REPLAY_TOLERANCE.get(activations, REPLAY_TOLERANCE["fp16"])
    ok = found["max_diff"] <= limit
    return GateResult("runtime", check, ok, found["max_diff"], limit,
                      f"{found['runs']} captured decodes at contexts {list(CONTEXTS)}: "
                      + ("replayed steps match a normal run" if ok else
                         "replayed steps differ from a normal run of the same inputs (a graph replaying stale buffers?)"),
                      details={"runs": found["runs"]})
