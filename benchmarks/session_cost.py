"""Where a validation's onnxruntime time goes: session creation and the parity decode, per export.

For each export directory given, in one process (the CUDA libraries are loaded once, by a warm-up
session of the first export, as the runtime probe does before parity in a validation):

* session creation as validation makes it (``validate.validation_session``), the same with
  spinning intra-op threads, and with onnxruntime's graph optimizations at ``basic`` and
  ``disabled``, each ``--repeats`` times, interleaved;
* the parity decode (``export_decode``: a 16-token prompt, 24 greedy steps) on that session, its
  first step and the median of the rest;
* the same decode with the caches kept on the device (``Decoder.forward_device``, validation's way:
  attn_static and GroupQueryAttention caches bound in place, dynamic presents taken as the next
  step's past), logits copied back each step;
* onnxruntime's own profile of the host decode: time per operator type and execution provider;
* ``--beside-weights``: session creation and the device-caches decode again while the weight check
  (``weight_integrity``, on its own threads) runs beside them, as validation runs the two, and the
  check's own time alone; with validation's session (its intra-op threads sleep between ops) and
  with one whose threads spin (``spinning``, onnxruntime's default), ``--repeats`` rounds, each
  of the two first in turn: which of them the other slows;
* ``--profile-validation``: ``validate_export`` of each export in turn (one reference cache: the
  first computes the reference, the rest read it back), its stage timings, and Python's profile of
  it (the 25 costliest calls by cumulative time: the calling thread's on Python 3.11; on the GPU
  machine's 3.12 it held the other threads' calls too).

Usage::

    python benchmarks/session_cost.py EXPORT_DIR [EXPORT_DIR ...] --ep cuda [--repeats 2]
                                      [--beside-weights] [--profile-validation] [--skip-op-profile]
                                      [--out benchmarks/results/session_cost.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LEVELS = ("validation", "spinning", "basic", "disabled")


def validation_options():
    """Session options as validation's session sets them (no prepacking, threads not spinning),
    for the levels that change one thing more."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def make_session(export_dir: Path, ep: str, level: str):
    import onnxruntime as ort

    from exporter.runtime.session import Decoder, read_metadata
    from exporter.validation.validate import QUANTIZED, validation_session

    dtype = read_metadata(Path(export_dir) / "model.onnx")["dtype"]
    if level == "validation":
        return validation_session(export_dir, ep, dtype)
    if level == "spinning":  # validation's session, its threads spinning between ops (onnxruntime's default)
        return Decoder(export_dir, ep=ep, prepack=dtype in QUANTIZED)
    options = validation_options()
    options.graph_optimization_level = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[level]
    return Decoder(export_dir, ep=ep, session_options=options)


def timed_decode(lm, steps: int = 24, prompt_len: int = 16, device_caches: bool = False) -> dict:
    """export_decode's loop (greedy), each forward timed: the caches host arrays fed to every step
    (``Decoder.forward``), or kept where the session runs (``Decoder.forward_device``, what
    validation does)."""
    import numpy as np

    if device_caches:
        state, forward = lm.new_device_state(prompt_len + steps), lm.forward_device
    else:
        state, forward = lm.new_state(), lm.forward
    prompt = np.arange(3, 3 + prompt_len, dtype=np.int64)[None]
    t0 = time.perf_counter()
    out = forward(prompt, state)
    times = [time.perf_counter() - t0]
    for _ in range(steps):
        token = int(np.argmax(out[0, -1]))
        t0 = time.perf_counter()
        out = forward(np.array([[token]], dtype=np.int64), state)
        times.append(time.perf_counter() - t0)
    return {"prefill_s": round(times[0], 4), "first_step_s": round(times[1], 4),
            "median_step_s": round(statistics.median(times[2:]), 5), "total_s": round(sum(times), 3)}


def op_profile(export_dir: Path, ep: str, top: int = 12) -> list[dict]:
    """onnxruntime's profile of the host decode: total microseconds per (operator, provider)."""
    import collections

    from exporter.runtime.session import Decoder

    options = validation_options()
    options.enable_profiling = True
    options.profile_file_prefix = f"/tmp/session_cost_{export_dir.name}"
    lm = Decoder(export_dir, ep=ep, session_options=options)
    timed_decode(lm)
    events = json.loads(Path(lm.session.end_profiling()).read_text())
    totals, counts = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            key = (event["args"].get("op_name", "?"), event["args"].get("provider", "?"))
            totals[key] += event["dur"]
            counts[key] += 1
    return [{"op": op, "provider": provider, "total_us": us, "calls": counts[(op, provider)]}
            for (op, provider), us in totals.most_common(top)]


def beside_weights(export_dir: Path, ep: str, repeats: int) -> dict:
    """Session creation and the device-caches decode with the weight check running beside them,
    with validation's session and with one whose intra-op threads spin between ops; ``repeats``
    rounds, the two in turn first (whichever ran first in a round was the slower by up to 2x here)."""
    import concurrent.futures

    from exporter.packaging.checkpoint import Checkpoint
    from exporter.packaging.resolve import resolve_source
    from exporter.runtime.session import read_metadata
    from exporter.validation.gates.weights import weight_integrity
    from exporter.validation.validate import manifest_reference

    manifest = json.loads((export_dir / "manifest.json").read_text())
    model_path = export_dir / "model.onnx"
    meta = read_metadata(model_path)
    checkpoint = resolve_source(manifest_reference(manifest, export_dir)).path
    dtype, activations = meta["dtype"], meta["config"].get("activations", meta["dtype"])

    def check():
        gates, _ = weight_integrity(model_path, manifest, Checkpoint(checkpoint), dtype, activations)
        failed = [g for g in gates if g.status == "fail"]
        if failed:
            raise SystemExit(f"{export_dir}: the weight check failed ({failed[0].message}): nothing to time")

    result = {"weights_alone_s": [], "validation": [], "spinning": []}
    for r in range(repeats):
        t0 = time.perf_counter()
        check()
        result["weights_alone_s"].append(round(time.perf_counter() - t0, 3))
        for level in ("validation", "spinning")[:: 1 if r % 2 == 0 else -1]:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                t0 = time.perf_counter()
                checking = pool.submit(check)
                lm = make_session(export_dir, ep, level)
                creation_s = time.perf_counter() - t0
                decode = timed_decode(lm, device_caches=True)
                decode_done_s = time.perf_counter() - t0
                checking.result()
                check_s = time.perf_counter() - t0
            del lm
            result[level].append({"round": r, "creation_s": round(creation_s, 3), "decode": decode,
                                  "session_and_decode_s": round(decode_done_s, 3), "weights_done_s": round(check_s, 3)})
    return result


def profile_validation(exports: list[Path], ep: str, cache: Path, top: int = 25) -> dict:
    """validate_export of each export (the first computes the reference into ``cache``), with its
    stage timings and its profile."""
    import cProfile
    import io
    import pstats

    from exporter.validation.validate import validate_export

    out = {}
    for export_dir in exports:
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        report = validate_export(export_dir, ep=ep, reference_cache=cache)
        profile.disable()
        wall = time.perf_counter() - t0
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
        out[str(export_dir)] = {"wall_s": round(wall, 3), "passed": report.passed,
                                "timings_s": {k: round(v, 3) for k, v in report.timings_s.items()},
                                "profile": text.getvalue().splitlines()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--ep", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--beside-weights", action="store_true")
    parser.add_argument("--profile-validation", action="store_true")
    parser.add_argument("--skip-op-profile", action="store_true")
    parser.add_argument("--reference-cache", type=Path, default=Path("/tmp/session_cost_references"),
                        help="--profile-validation's reference cache (emptied first)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/session_cost.json"))
    args = parser.parse_args(argv)

    import onnxruntime as ort

    t0 = time.perf_counter()
    make_session(args.exports[0], args.ep, "validation")
    warm_up_s = time.perf_counter() - t0
    creation = {str(e): {level: [] for level in LEVELS} for e in args.exports}
    decode, device = {}, {}
    for _ in range(args.repeats):
        for export_dir in args.exports:
            for level in LEVELS:
                t0 = time.perf_counter()
                lm = make_session(export_dir, args.ep, level)
                creation[str(export_dir)][level].append(round(time.perf_counter() - t0, 3))
                if level == "validation":
                    decode.setdefault(str(export_dir), []).append(timed_decode(lm))
                    device.setdefault(str(export_dir), []).append(timed_decode(lm, device_caches=True))
                del lm
    profiles = {} if args.skip_op_profile else {str(e): op_profile(e, args.ep) for e in args.exports}
    beside = {str(e): beside_weights(e, args.ep, args.repeats) for e in args.exports} if args.beside_weights else None
    validations = None
    if args.profile_validation:
        import shutil

        shutil.rmtree(args.reference_cache, ignore_errors=True)
        validations = profile_validation(args.exports, args.ep, args.reference_cache)
    result = {
        "benchmark": "session_cost", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ep": args.ep, "onnxruntime": ort.__version__,
        "first_session_s": round(warm_up_s, 3),
        "creation_s": creation, "decode": decode, "decode_device_caches": device, "op_profile": profiles,
        **({"beside_weights": beside} if beside else {}), **({"validations": validations} if validations else {}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
