"""Export and validation cost of a Qwen2.5-0.5B-sized checkpoint: wall time and peak memory, per variant.

What is measured
----------------
* A random-weight bf16 checkpoint with the Qwen2.5-0.5B config is built offline (no download) and
  reused across runs.
* Each variant (attn_dynamic, gqa, attn_static at --max-seq-len 4096) is exported to fp16 by the
  ``exportfarm export`` CLI in a fresh subprocess, so every export pays its own imports and its peak
  memory is its own. While it runs, ``/proc/<pid>/status`` is sampled every ~20 ms for ``RssAnon``
  and ``VmRSS``; the peaks and the wall time (spawn to exit) are recorded.
* Import baseline: a subprocess that only imports what an export imports and then sleeps 1 s,
  sampled the same way. Its peak RssAnon is what any export pays before touching a weight.
* Floor: a subprocess that reads every checkpoint tensor whole with ``safetensors.safe_open``,
  casts it to fp16 and appends its bytes to one file (no fsync, as the exporter does not fsync).
  That is the least work an fp16 export can do, measured on the same machine in the same run.

* Validation: ``exportfarm validate OUT --ep EP`` on each export, in a fresh process, sampled the
  same way; its per-gate timings come from the parity report. It should cost less than the export.
* Caches start empty: exports keep rope tables in ``$EXPORTFARM_CACHE`` (a fresh directory per
  benchmark run), so the very first export computes them (importing torch) and every later one
  reads them back, as in a farm exporting one checkpoint in several variants. That first, cold
  export is reported on its own (``cold_first_export``); the medians are over every round.

* Worker path: a farm worker runs export and validation in its own long-lived process (a Celery
  child), so after its first job the imports are paid and the execution provider is initialised.
  One process that has imported torch, transformers (with its modeling code) and the exporter and
  run the runtime probe once on --ep (as an earlier job would have) then exports and validates
  every variant in turn, as successive jobs (``export_model`` with validation, fresh rope and
  reference caches): the first variant's validation computes the reference, the following ones
  read it back. Export and validation times come from the manifest's own stage timings. It does
  that for ``--worker-checkpoints`` checkpoints in turn (the same one, each time with empty
  rope and reference caches, so nothing computed is reused): the first is a worker's first
  checkpoint, whose first job of each variant also loads that variant's kernels on the device; a
  later one is what the worker pays from then on.

Why RssAnon and not RSS
-----------------------
The exporter (and the floor) read the safetensors through mmap. Those file-backed pages count in
VmRSS, but they are clean page cache: the kernel drops them under pressure and re-reads them on
demand, so they do not decide whether an export fits in a machine. Anonymous pages (heap, numpy
and torch buffers) cannot be dropped without swap; RssAnon is the memory an export really needs.
VmRSS is recorded as well, for reference.

Targets
-------
* memory: peak RssAnon <= baseline RssAnon + 0.25 * output weight bytes (model.onnx.data size);
* time: export wall time <= 1.5 * floor wall time;
* validation: the first variant's wall time <= its export's; each following variant's (the
  reference read back) <= 0.5 * its export's.

``--ep cuda`` exports for CUDA and validates there (the GPU workers' path); the reference and the
weight check still run on the CPU, as they do in a worker.

The checkpoint is read once before any measurement so that every run sees a warm page cache; before
each run, earlier outputs are deleted and dirty pages are synced, so runs start from the same state.

Usage::

    python benchmarks/export_cost.py [--work-dir DIR] [--out benchmarks/results/export_cost.json]
                                     [--variants attn_dynamic,gqa,attn_static] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLE_INTERVAL_S = 0.02
ANON_TARGET_FRACTION = 0.25
TIME_TARGET_RATIO = 1.5
# Validation of the first variant of a checkpoint <= its export; of the following variants (the
# reference read back) "well below" it, taken as half.
FOLLOWING_VALIDATION_RATIO = 0.5
STATIC_MAX_SEQ_LEN = 4096
ALL_VARIANTS = ("attn_dynamic", "gqa", "attn_static")
PACKAGES = ("torch", "transformers", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-gpu", "safetensors", "numpy",
            "ml_dtypes")

QWEN2_5_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)

# The import baseline: everything an export imports, then idle long enough to be sampled.
BASELINE_CODE = """
import time
import exporter.pipeline, exporter.cli, torch, transformers, onnx_ir, onnxruntime, safetensors
time.sleep(1)
"""

# The worker path: one warm process, one export job per variant (validated), in turn, for each of
# a number of checkpoints (the same one with empty caches each time).
# argv: checkpoint, out root, ep, variants (comma-separated), attn_static max_seq_len, result file,
# checkpoints, cache root.
WORKER_CODE = """
import json, os, sys, time
from pathlib import Path
t0 = time.perf_counter()
import torch, transformers  # what a worker child holds after its first job, with the modeling code
from transformers import AutoModelForCausalLM, modeling_utils  # its reference loaded (lazy imports)
from exporter.cache import reference_cache_default, rope_cache_default
from exporter.pipeline import export_model
from exporter.request import ExportRequest
from exporter.validation.gates.runtime_probe import runtime_gate

checkpoint, root, ep, variants, static_len, out, checkpoints, cache_root = sys.argv[1:9]
runtime_gate("attn_static", ep, "fp16")  # the execution provider initialised, as an earlier job left it
result = {"warm_up_s": round(time.perf_counter() - t0, 3), "checkpoints": []}
for n in range(int(checkpoints)):
    os.environ["EXPORTFARM_CACHE"] = str(Path(cache_root) / f"checkpoint-{n}")  # nothing computed is reused
    jobs = {}
    for variant in variants.split(","):
        static = variant == "attn_static"
        request = ExportRequest(model=checkpoint, dtype="fp16", ep=ep, variant=variant, static_cache=static,
                                max_seq_len=int(static_len) if static else None)
        t0 = time.perf_counter()
        done = export_model(request, Path(root) / variant, overwrite=True, validate=True, validate_ep=ep,
                            reference_cache=reference_cache_default(), rope_cache=rope_cache_default())
        wall = time.perf_counter() - t0
        timings = done.manifest.data["timings_s"]
        jobs[variant] = {"job_wall_s": round(wall, 3), "validate_s": timings["validate"],
                         "export_s": round(wall - timings["validate"], 3), "status": done.manifest.data["status"],
                         "stage_timings_s": timings, "validation_stage_timings_s": done.report.to_dict()["timings_s"]}
    result["checkpoints"].append(jobs)
Path(out).write_text(json.dumps(result))
"""

# The floor: every tensor read whole, cast to fp16, appended to one file. argv: checkpoint dir, out file.
FLOOR_CODE = """
import sys
from pathlib import Path
import torch
from safetensors import safe_open

checkpoint, out_path = Path(sys.argv[1]), sys.argv[2]
with open(out_path, "wb") as out:
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).to(torch.float16).contiguous()
                out.write(tensor.numpy().data)
                del tensor
"""


@dataclasses.dataclass
class Sample:
    """What one sampled subprocess cost: wall time (spawn to exit) and its memory peaks."""

    wall_s: float
    peak_rss_anon_bytes: int
    peak_rss_bytes: int
    samples: int

    def to_dict(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 3),
            "peak_rss_anon_bytes": self.peak_rss_anon_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "samples": self.samples,
        }


def read_memory(pid: int) -> tuple[int, int] | None:
    """(RssAnon, VmRSS) in bytes from /proc/<pid>/status, or None once the process is gone."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "VmRSS"):
                    values[key] = int(rest.split()[0]) * 1024  # reported in kB
    except (FileNotFoundError, ProcessLookupError):
        return None
    if len(values) < 2:  # a zombie has no memory lines
        return None
    return values["RssAnon"], values["VmRSS"]


def run_sampled(cmd: list[str], log_path: Path, check: bool = True) -> Sample:
    """Run ``cmd``, sampling its memory every SAMPLE_INTERVAL_S; raise if it fails.

    Dirty pages left by the previous run are flushed first (unmeasured), so one run's background
    writeback does not slow the next one down.
    """
    os.sync()
    peak_anon = peak_rss = samples = 0
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            memory = read_memory(proc.pid)
            if memory is not None:
                peak_anon, peak_rss = max(peak_anon, memory[0]), max(peak_rss, memory[1])
                samples += 1
            time.sleep(SAMPLE_INTERVAL_S)
        wall = time.perf_counter() - start
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log_path}")
    return Sample(wall, peak_anon, peak_rss, samples)


def build_checkpoint(directory: Path) -> None:
    """Save a random-weight bf16 Qwen2.5-0.5B checkpoint to ``directory`` unless one is there."""
    if (directory / "config.json").is_file():
        print(f"reusing checkpoint {directory}", flush=True)
        return
    import torch
    import transformers

    print(f"building random bf16 Qwen2.5-0.5B checkpoint in {directory}", flush=True)
    config = transformers.Qwen2Config(**QWEN2_5_0_5B)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    gc.collect()


def warm_page_cache(directory: Path) -> None:
    """Read the safetensors once so every measured run starts from the same warm page cache."""
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def exportfarm_command() -> list[str]:
    """The ``exportfarm`` entry point of this interpreter (not a pyenv shim that forks first), or
    the exporter's own CLI module where the project runs from a source tree (the GPU machine)."""
    local = Path(sys.executable).parent / "exportfarm"
    found = str(local) if local.is_file() else shutil.which("exportfarm")
    return [found] if found else [sys.executable, "-m", "exporter.cli"]


def export_command(checkpoint: Path, variant: str, out_dir: Path, ep: str) -> list[str]:
    cmd = [*exportfarm_command(), "export", "--model", str(checkpoint), "--dtype", "fp16", "--variant", variant,
           "--ep", ep]
    if variant == "attn_static":
        cmd += ["--max-seq-len", str(STATIC_MAX_SEQ_LEN)]
    # Validation is measured on its own (measure_validate), so the export figure is the export alone.
    return cmd + ["--out", str(out_dir), "--overwrite", "--no-validate"]


def validation_limit(order: int) -> float:
    """The validation target, as a multiple of the export: the checkpoint's first variant (order 0)
    computes the reference, the following ones read it back."""
    return 1.0 if order == 0 else FOLLOWING_VALIDATION_RATIO


def measure_worker(checkpoint: Path, variants: list[str], work_dir: Path, ep: str, checkpoints: int) -> dict:
    """The worker path (WORKER_CODE), each checkpoint with empty caches; each variant's validation
    against its own export."""
    cache = work_dir / "worker-cache"
    shutil.rmtree(cache, ignore_errors=True)
    out = work_dir / "worker.json"
    cmd = [sys.executable, "-c", WORKER_CODE, str(checkpoint), str(work_dir / "worker-exports"), ep,
           ",".join(variants), str(STATIC_MAX_SEQ_LEN), str(out), str(checkpoints), str(cache)]
    print(f"worker path (one warm process, a job per variant, {checkpoints} checkpoints) ...", flush=True)
    with open(work_dir / "worker.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    result = json.loads(out.read_text())
    for jobs in result["checkpoints"]:
        for i, variant in enumerate(variants):
            job = jobs[variant]
            limit = validation_limit(i)
            job["validation_ratio_vs_export"] = round(job["validate_s"] / job["export_s"], 3)
            job["time_target"] = f"validate <= {limit} x export"
            job["time_target_met"] = job["validation_ratio_vs_export"] <= limit
    return result


def measure_validate(variant: str, work_dir: Path, export_wall_s: float, ep: str) -> dict:
    """Validate an export in a fresh process: every gate, on its target EP, against transformers."""
    out_dir = work_dir / "exports" / variant
    cmd = [*exportfarm_command(), "validate", str(out_dir), "--ep", ep]
    print(f"validate {variant} ...", flush=True)
    sample = run_sampled(cmd, work_dir / f"validate_{variant}.log", check=False)
    report = json.loads((out_dir / "parity_report.json").read_text())
    return {
        "command": cmd,
        **sample.to_dict(),
        "status": report["status"],
        "failed_gates": report["failed_gates"],
        "stage_timings_s": report["timings_s"],
        "time_ratio_vs_export": round(sample.wall_s / export_wall_s, 3),
    }


def measure_export(checkpoint: Path, variant: str, work_dir: Path, baseline: Sample, floor: Sample,
                   ep: str) -> dict:
    """Export one variant in a fresh process and score it against the targets."""
    out_dir = work_dir / "exports" / variant
    shutil.rmtree(out_dir, ignore_errors=True)  # deleting an old export is not export cost
    cmd = export_command(checkpoint, variant, out_dir, ep)
    print(f"export {variant} ...", flush=True)
    sample = run_sampled(cmd, work_dir / f"export_{variant}.log")
    weight_bytes = (out_dir / "model.onnx.data").stat().st_size
    over_baseline = sample.peak_rss_anon_bytes - baseline.peak_rss_anon_bytes
    anon_target = int(ANON_TARGET_FRACTION * weight_bytes)
    time_ratio = sample.wall_s / floor.wall_s
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return {
        "command": cmd,
        **sample.to_dict(),
        "output_weight_bytes": weight_bytes,
        "anon_over_baseline_bytes": over_baseline,
        "anon_target_bytes": anon_target,
        "anon_target_met": over_baseline <= anon_target,
        "time_ratio_vs_floor": round(time_ratio, 3),
        "time_target_met": time_ratio <= TIME_TARGET_RATIO,
        "stage_timings_s": manifest.get("timings_s", {}),
    }


def measure_floor(checkpoint: Path, work_dir: Path) -> tuple[Sample, int]:
    """The read-cast-write floor; returns its sample and the bytes it wrote."""
    out_path = work_dir / "floor" / "weights.fp16.bin"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    print("floor ...", flush=True)
    sample = run_sampled([sys.executable, "-c", FLOOR_CODE, str(checkpoint), str(out_path)], work_dir / "floor.log")
    return sample, out_path.stat().st_size


def machine_info() -> dict:
    with open("/proc/meminfo") as f:
        mem_total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    info = {"nproc": os.cpu_count(), "mem_total_bytes": mem_total_kb * 1024, "python": sys.version.split()[0]}
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        info["gpus"] = query.stdout.strip().splitlines() if query.returncode == 0 else []
    return info


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def print_table(result: dict) -> None:
    mib = 1 << 20
    baseline, floor = result["baseline"], result["floor"]
    print()
    print(f"baseline (imports): peak RssAnon {baseline['peak_rss_anon_bytes'] / mib:8.1f} MiB, "
          f"wall {baseline['wall_s']:.2f} s")
    print(f"floor (read+cast+write): wall {floor['wall_s']:.2f} s, peak RssAnon "
          f"{floor['peak_rss_anon_bytes'] / mib:.1f} MiB, wrote {floor['output_bytes'] / mib:.1f} MiB")
    header = (f"{'variant':<13}{'wall s':>8}{'x floor':>9}{'time ok':>9}{'RssAnon MiB':>13}{'over base':>11}"
              f"{'target':>9}{'mem ok':>8}{'VmRSS MiB':>11}{'data MiB':>10}")
    print(header)
    print("-" * len(header))
    for variant, r in result["variants"].items():
        print(f"{variant:<13}{r['wall_s']:>8.2f}{r['time_ratio_vs_floor']:>9.2f}{str(r['time_target_met']):>9}"
              f"{r['peak_rss_anon_bytes'] / mib:>13.1f}{r['anon_over_baseline_bytes'] / mib:>11.1f}"
              f"{r['anon_target_bytes'] / mib:>9.1f}{str(r['anon_target_met']):>8}"
              f"{r['peak_rss_bytes'] / mib:>11.1f}{r['output_weight_bytes'] / mib:>10.1f}")
    cold = result["cold_first_export"]
    print(f"cold first export ({cold['variant']}, empty caches): wall {cold['wall_s']:.2f} s, "
          f"{cold['time_ratio_vs_floor']:.2f} x its round's floor")
    print()
    print(f"{'validate':<13}{'wall s':>8}{'x export':>10}{'time ok':>9}{'RssAnon MiB':>13}{'VmRSS MiB':>11}  "
          f"status, stages (s)")
    for variant, r in result["validation"].items():
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stage_timings_s"].items())
        print(f"{variant:<13}{r['wall_s']:>8.2f}{r['time_ratio_vs_export']:>10.2f}{str(r['time_target_met']):>9}"
              f"{r['peak_rss_anon_bytes'] / mib:>13.1f}{r['peak_rss_bytes'] / mib:>11.1f}  {r['status']}, {stages}")
    worker = result["worker"]
    print(f"\nworker path (warm process, warm-up {worker['warm_up_s']:.1f} s)")
    print(f"{'checkpoint, job':<17}{'export s':>9}{'validate s':>11}{'x export':>10}{'time ok':>9}  "
          f"status, validation stages (s)")
    for n, jobs in enumerate(worker["checkpoints"]):
        for variant in result["variants"]:
            r = jobs[variant]
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["validation_stage_timings_s"].items())
            print(f"{f'{n + 1} {variant}':<17}{r['export_s']:>9.2f}{r['validate_s']:>11.2f}"
                  f"{r['validation_ratio_vs_export']:>10.2f}{str(r['time_target_met']):>9}  {r['status']}, {stages}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "exportfarm_export_cost",
                        help="checkpoint, exports and logs (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/export_cost.json"),
                        help="JSON result file (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of floor + every export (medians)")
    parser.add_argument("--ep", choices=("cpu", "cuda"), default="cpu",
                        help="the exports' target execution provider, where validation runs them (default: %(default)s)")
    parser.add_argument("--worker-checkpoints", type=int, default=2,
                        help="checkpoints the worker path exports in turn, each with empty caches (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS),
                        help="comma-separated variants to export (default: %(default)s)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.worker_checkpoints < 1:
        parser.error("--worker-checkpoints must be 1 or more")
    unknown = sorted(set(args.variants) - set(ALL_VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: use {', '.join(ALL_VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir.absolute()
    checkpoint = work_dir / "qwen2.5-0.5b-random-bf16"
    work_dir.mkdir(parents=True, exist_ok=True)
    build_checkpoint(checkpoint)
    warm_page_cache(checkpoint)

    print("import baseline ...", flush=True)
    baseline = run_sampled([sys.executable, "-c", BASELINE_CODE], work_dir / "baseline.log")
    # Rounds of (floor, every variant), interleaved: page cache and disk state drift over a run
    # by more than the margin measured, so each export is judged against the floor of its own
    # round and the medians are reported (peak memory: the worst round).
    export_cache = work_dir / "export-cache"
    shutil.rmtree(export_cache, ignore_errors=True)
    os.environ["EXPORTFARM_CACHE"] = str(export_cache)
    # The variants' order turns by one each round: a run's place in its round moved its time by up
    # to 40% here (whichever variant ran last was the slowest, os.sync() before each run or not),
    # so with as many rounds as variants each one takes every place once.
    rounds, orders = [], []
    for r in range(args.rounds):
        turn = r % len(args.variants)
        order = args.variants[turn:] + args.variants[:turn]
        orders.append(order)
        print(f"round {r + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        floor, floor_bytes = measure_floor(checkpoint, work_dir)
        rounds.append((floor, {v: measure_export(checkpoint, v, work_dir, baseline, floor, args.ep) for v in order}))
    floor_walls = [f.wall_s for f, _ in rounds]
    floor = min((f for f, _ in rounds), key=lambda f: abs(f.wall_s - statistics.median(floor_walls)))
    cold = rounds[0][1][args.variants[0]]
    cold_first_export = {"variant": args.variants[0], "wall_s": cold["wall_s"],
                         "time_ratio_vs_floor": cold["time_ratio_vs_floor"],
                         "time_target_met": cold["time_target_met"]}
    variants = {}
    for v in args.variants:
        runs = [per[v] for _, per in rounds]
        ratio = statistics.median(run["time_ratio_vs_floor"] for run in runs)
        worst = max(runs, key=lambda run: run["peak_rss_anon_bytes"])
        variants[v] = {**worst, "wall_s": round(statistics.median(run["wall_s"] for run in runs), 3),
                       "time_ratio_vs_floor": round(ratio, 3), "time_target_met": ratio <= TIME_TARGET_RATIO,
                       "rounds": [{"wall_s": run["wall_s"], "time_ratio_vs_floor": run["time_ratio_vs_floor"],
                                   "peak_rss_anon_bytes": run["peak_rss_anon_bytes"]} for run in runs]}
    # A fresh reference cache: the first validation computes the transformers reference, the
    # following variants of the same checkpoint read it back (what a worker does).
    reference_cache = work_dir / "reference-cache"
    shutil.rmtree(reference_cache, ignore_errors=True)
    os.environ["EXPORTFARM_CACHE"] = str(reference_cache)
    validation = {v: measure_validate(v, work_dir, variants[v]["wall_s"], args.ep) for v in args.variants}
    for i, v in enumerate(args.variants):  # the first computes the reference, the others read it back
        limit = validation_limit(i)
        validation[v]["time_target"] = f"wall <= {limit} x export wall"
        validation[v]["time_target_met"] = validation[v]["time_ratio_vs_export"] <= limit

    worker = measure_worker(checkpoint, args.variants, work_dir, args.ep, args.worker_checkpoints)

    result = {
        "benchmark": "export_cost",
        "command": [Path(sys.executable).name, *sys.argv],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": package_versions(),
        "checkpoint": {"path": str(checkpoint), "config": QWEN2_5_0_5B, "dtype": "bf16",
                       "bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))},
        "export_dtype": "fp16",
        "ep": args.ep,
        "sample_interval_s": SAMPLE_INTERVAL_S,
        "targets": {"anon": f"peak RssAnon <= baseline RssAnon + {ANON_TARGET_FRACTION} * output weight bytes",
                    "time": f"wall <= {TIME_TARGET_RATIO} * floor wall",
                    "validation": f"first variant: wall <= export wall; following: wall <= "
                                  f"{FOLLOWING_VALIDATION_RATIO} * export wall"},
        "baseline": baseline.to_dict(),
        "floor": {**floor.to_dict(), "wall_s": round(statistics.median(floor_walls), 3), "rounds_wall_s": floor_walls,
                  "output_bytes": floor_bytes},
        "rounds": args.rounds,
        "round_orders": orders,
        "cold_first_export": cold_first_export,
        "variants": variants,
        "validation": validation,
        "worker": worker,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
