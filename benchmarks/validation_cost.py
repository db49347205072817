"""What validation and int4 quantization cost on the CPU next to the export they follow (issue 45).

What is measured (every step a fresh process of the checkout under test, as a user runs the CLI)
------------------------------------------------------------------------------------------------
* ``validation``: a real checkpoint with its tokenizer (default: Qwen2.5-Coder-0.5B-Instruct, as
  ``tests/real_model.py`` builds it) exported with ``exportfarm export --dtype fp16 --variant gqa
  --ep cpu --no-validate``, then ``exportfarm validate OUT --ep cpu``. The cache directory
  (``$EXPORTFARM_CACHE``: rope tables, reference runs, the tokenizer's answers) starts empty: the
  first export and the first validation are reported apart as ``cold`` (the validation computes
  transformers' reference and its fp16 yardstick); then ``--rounds`` rounds of export + validate
  with those caches kept, as a farm validates every variant and dtype of a checkpoint after its
  first. Target: warm validation wall <= 1.5 x export wall (medians).
* ``int4``: a depth-truncated random-weight checkpoint of a real geometry (``benchmarks/scale.py``'s
  ``build_checkpoints``; default llama-3.1-8b, ``--layers``) exported in fp16 and in int4 for
  ``--int4-ep`` (cpu: int4 computes in fp32 and onnxruntime's quantizer makes the codes; cuda: the
  bf16-trained geometry computes in bf16 and the exporter's numpy quantizer makes them), alternating
  which goes first each round, after one fp16 export that is not counted (the rope tables, the page
  cache). Target: int4 export wall <= 2 x fp16 export wall (medians). ``--validate-int4`` also
  validates each int4 export (the weight gate's time is in its report; the first computes the
  quality gate's reference).

For every run: wall time, CPU time (user + system of the process and the children it waited for,
from ``wait4``), peak RssAnon of its process tree (sampled every 20 ms), and the stage timings the
manifest or parity_report.json records. The result JSON names the command, the checkout measured
(``--repo``: its commit, and whether its tree had changes), the package versions it imported and
the machine (cores, the affinity mask, CPU model, memory, load average before and after): figures
from another machine or another load are not comparable.

Usage::

    python benchmarks/validation_cost.py --parts validation,int4 --rounds 3 --layers 4 \\
        --work /tmp/vc --out benchmarks/results/validation_cost_cpu.json
    # the code before the change, on the same machine: a checkout of it
    python benchmarks/validation_cost.py --repo /path/to/old/checkout --out /tmp/before.json
    # the full 8B int4 / fp16 export ratio on a larger host (16 GB of checkpoint, 16 GB of fp16 export
    # at a time), for either target, the weight gate with it
    python benchmarks/validation_cost.py --parts int4 --layers 32 --rounds 2 --int4-ep cuda \
        --validate-int4 --work /big/disk --out benchmarks/results/validation_cost_8b_cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import _status, build_checkpoints, process_tree  # noqa: E402  (this folder is on the path)

VALIDATION_TARGET = 1.5  # warm validation wall <= this x its export's
INT4_TARGET = 2.0  # int4 export wall <= this x the fp16 export's
PACKAGES = ("numpy", "ml_dtypes", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-genai", "torch", "transformers",
            "tokenizers", "safetensors")
SAMPLE_S = 0.02
GIB = 1024 ** 3


def run(cmd: list[str], env: dict, log: Path, cwd: Path) -> dict:
    """Run ``cmd`` to its end: wall, CPU (user + system, its waited-for children included) and the
    peak RssAnon of its process tree. A non-zero exit raises with the log's tail."""
    peak = [0]
    with log.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], sum(_status(p)[0] for p in process_tree(proc.pid)))
                time.sleep(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                           f"{log.read_text(errors='replace')[-3000:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "user_s": round(usage.ru_utime, 3), "sys_s": round(usage.ru_stime, 3),
            "peak_rss_anon_gib": round(peak[0] / GIB, 3)}


def cli() -> list[str]:
    """``exportfarm`` of the checkout the process runs in (its working directory, its PYTHONPATH)."""
    return [sys.executable, "-m", "services.cli"]


def export(args, repo: Path, env: dict, model: Path, dtype: str, variant: str | None, out: Path, log: Path,
           ep: str = "cpu") -> dict:
    cmd = [*cli(), "export", "--model", str(model), "--dtype", dtype, "--ep", ep, "--no-validate",
           "--overwrite", "--out", str(out)]
    if variant:
        cmd += ["--variant", variant]
    result = run(cmd, env, log, repo)
    manifest = json.loads((out / "manifest.json").read_text())
    return {**result, "stage_timings_s": manifest.get("timings_s", {}),
            "export_bytes": (out / "model.onnx.data").stat().st_size}


def validate(repo: Path, env: dict, out: Path, log: Path, ep: str = "cpu") -> dict:
    result = run([*cli(), "validate", str(out), "--ep", ep], env, log, repo)
    report = json.loads((out / "parity_report.json").read_text())
    return {**result, "status": report["status"], "failed_gates": report["failed_gates"],
            "gate_timings_s": report["timings_s"]}


def median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def measure_validation(args, repo: Path, env: dict, work: Path) -> dict:
    out, logs = work / "exports" / f"{args.dtype}-{args.variant}", work / "logs"
    print(f"validation: {args.model.name} {args.dtype} {args.variant}, cold caches first", flush=True)
    cold_export = export(args, repo, env, args.model, args.dtype, args.variant, out, logs / "export-cold.log")
    cold_validate = validate(repo, env, out, logs / "validate-cold.log")
    print(f"  cold: export {cold_export['wall_s']} s, validate {cold_validate['wall_s']} s "
          f"({cold_validate['status']})", flush=True)
    rounds = []
    for n in range(args.rounds):
        e = export(args, repo, env, args.model, args.dtype, args.variant, out, logs / f"export-{n}.log")
        v = validate(repo, env, out, logs / f"validate-{n}.log")
        rounds.append({"export": e, "validate": v, "ratio": round(v["wall_s"] / e["wall_s"], 3)})
        print(f"  round {n + 1}: export {e['wall_s']} s ({e['cpu_s']} s CPU), validate {v['wall_s']} s "
              f"({v['cpu_s']} s CPU, {v['status']}): {rounds[-1]['ratio']} x", flush=True)
    exports, validations = [r["export"] for r in rounds], [r["validate"] for r in rounds]
    ratio = median(validations, "wall_s") / median(exports, "wall_s")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "model": str(args.model), "dtype": args.dtype, "variant": args.variant, "ep": "cpu",
        "cold": {"export": cold_export, "validate": cold_validate,
                 "ratio": round(cold_validate["wall_s"] / cold_export["wall_s"], 3)},
        "rounds": rounds,
        "median": {"export_wall_s": median(exports, "wall_s"), "export_cpu_s": median(exports, "cpu_s"),
                   "validate_wall_s": median(validations, "wall_s"), "validate_cpu_s": median(validations, "cpu_s")},
        "validate_over_export": round(ratio, 3),
        "validate_over_export_cpu": round(median(validations, "cpu_s") / median(exports, "cpu_s"), 3),
        "target": f"warm validation wall <= {VALIDATION_TARGET} x export wall (medians)",
        "target_met": ratio <= VALIDATION_TARGET,
        "all_passed": all(v["status"] == "passed" for v in validations),
    }


def measure_int4(args, repo: Path, env: dict, work: Path) -> dict:
    logs = work / "logs"
    print(f"int4: building {args.geometry} with {args.layers} layers under {work}", flush=True)
    checkpoint = build_checkpoints(args.geometry, [args.layers], work / "checkpoints")[args.layers]
    # a warm-up export (rope tables into the cache, the checkpoint into the page cache), not counted
    warm = work / "exports" / "warm-up"
    export(args, repo, env, checkpoint, "fp16", None, warm, logs / "export-warm-up.log", args.int4_ep)
    shutil.rmtree(warm, ignore_errors=True)
    rounds = []
    for n in range(args.rounds):
        row = {}
        for dtype in (("fp16", "int4") if n % 2 == 0 else ("int4", "fp16")):
            out = work / "exports" / f"{args.geometry}-L{args.layers}-{dtype}"
            row[dtype] = export(args, repo, env, checkpoint, dtype, None, out, logs / f"export-{dtype}-{n}.log",
                                args.int4_ep)
            print(f"  round {n + 1}: {dtype} export {row[dtype]['wall_s']} s ({row[dtype]['cpu_s']} s CPU, "
                  f"{row[dtype]['export_bytes'] / GIB:.2f} GiB)", flush=True)
            if dtype == "int4" and args.validate_int4:
                row["int4_validate"] = validate(repo, env, out, logs / f"validate-int4-{n}.log", args.int4_ep)
                print(f"  round {n + 1}: int4 validate {row['int4_validate']['wall_s']} s, weights "
                      f"{row['int4_validate']['gate_timings_s'].get('weights')} s", flush=True)
            shutil.rmtree(out, ignore_errors=True)
        row["ratio"] = round(row["int4"]["wall_s"] / row["fp16"]["wall_s"], 3)
        rounds.append(row)
    fp16, int4 = [r["fp16"] for r in rounds], [r["int4"] for r in rounds]
    ratio = median(int4, "wall_s") / median(fp16, "wall_s")
    return {
        "geometry": args.geometry, "layers": args.layers, "checkpoint": str(checkpoint), "ep": args.int4_ep,
        "depth_truncated": True, "rounds": rounds,
        "median": {"fp16_wall_s": median(fp16, "wall_s"), "fp16_cpu_s": median(fp16, "cpu_s"),
                   "int4_wall_s": median(int4, "wall_s"), "int4_cpu_s": median(int4, "cpu_s")},
        "int4_over_fp16": round(ratio, 3),
        "int4_over_fp16_cpu": round(median(int4, "cpu_s") / median(fp16, "cpu_s"), 3),
        "target": f"int4 export wall <= {INT4_TARGET} x fp16 export wall (medians)",
        "target_met": ratio <= INT4_TARGET,
    }


def checkout(repo: Path) -> dict:
    def git(*a):
        done = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    return {"path": str(repo), "commit": git("rev-parse", "HEAD"), "changed": bool(git("status", "--porcelain"))}


def versions(env: dict) -> dict:
    """The versions the measured processes import (their interpreter, their PYTHONPATH)."""
    code = ("import importlib.metadata as m, json; v = {}\n"
            f"for n in {PACKAGES!r}:\n"
            "    try: v[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: v[n] = None\n"
            "print(json.dumps(v))")
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {"cpus": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_model": model, "memory_gib": round(int(meminfo["MemTotal"].split()[0]) * 1024 / GIB, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="validation,int4", help="validation, int4 or both (default: %(default)s)")
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache" / "exportfarm" / "qwen2.5-coder-0.5b-instruct",
                        help="validation: a checkpoint with its tokenizer (default: %(default)s; "
                             "python tests/real_model.py qwen2.5-coder-0.5b-instruct builds it)")
    parser.add_argument("--dtype", default="fp16", help="validation: the export's dtype (default: %(default)s)")
    parser.add_argument("--variant", default="gqa", help="validation: the export's variant (default: %(default)s)")
    parser.add_argument("--geometry", default="llama-3.1-8b", help="int4: exporter.geometries name (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="int4: decoder layers of the geometry (default: %(default)s)")
    parser.add_argument("--int4-ep", choices=("cpu", "cuda"), default="cpu",
                        help="int4: the exports' target (cuda: built here all the same, computing in bf16 for "
                             "a bf16-trained geometry; validating them needs the GPU) (default: %(default)s)")
    parser.add_argument("--validate-int4", action="store_true", help="int4: validate each int4 export too")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (medians; default: %(default)s)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose exporter is measured "
                                                                "(default: this one, %(default)s)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/exportfarm-validation-cost"),
                        help="checkpoints, exports, caches and logs (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "validation_cost_cpu.json")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"validation", "int4"}:
        parser.error("--parts takes validation, int4 or both")
    repo = args.repo.resolve()
    work = args.work.resolve()
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work / "exports", ignore_errors=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(repo), "EXPORTFARM_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    result = {
        "benchmark": "validation_cost",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "checkout": checkout(repo),
        "versions": versions(env),
        "machine": machine(),
        "load_average_before": list(os.getloadavg()),
    }
    if "validation" in parts:
        result["validation"] = measure_validation(args, repo, env, work)
    if "int4" in parts:
        result["int4"] = measure_int4(args, repo, env, work)
    result["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if "validation" in result:
        v = result["validation"]
        print(f"validation: {v['median']['validate_wall_s']} s against export {v['median']['export_wall_s']} s: "
              f"{v['validate_over_export']} x (target <= {VALIDATION_TARGET}: {v['target_met']}); cold "
              f"{v['cold']['ratio']} x", flush=True)
    if "int4" in result:
        q = result["int4"]
        print(f"int4 export {q['median']['int4_wall_s']} s against fp16 {q['median']['fp16_wall_s']} s "
              f"({q['geometry']}, {q['layers']} layers): {q['int4_over_fp16']} x (target <= {INT4_TARGET}: "
              f"{q['target_met']})", flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
