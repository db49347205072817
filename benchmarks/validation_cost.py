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
manifest or parity_report.json records. ``--baseline`` measures a second checkout (the code before a
change) in the same rounds, the two alternating which goes first, each with its own caches: on a
machine whose load changes, only figures taken side by side compare. The result JSON names the
command, the checkouts (their commit, and whether their tree had changes), the package versions
their processes import and the machine (cores, the affinity mask, CPU model, memory, load average
before and after).

Usage::

    git worktree add /tmp/before <commit before the change>
    python benchmarks/validation_cost.py --parts validation,int4 --rounds 3 --layers 4 \\
        --baseline /tmp/before --work /tmp/vc --out benchmarks/results/validation_cost_cpu.json
    # the full 8B int4 / fp16 export ratio on a larger host (16 GB of checkpoint, 16 GB of fp16 export
    # at a time), for either target, the weight gate with it
    python benchmarks/validation_cost.py --parts int4 --layers 32 --rounds 2 --int4-ep cuda \\
        --validate-int4 --work /big/disk --out benchmarks/results/validation_cost_8b_cuda.json
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass
class Measured:
    """A checkout under test: its label in the results, its root, and the environment its processes
    run in (its code first on the path, a cache directory of its own)."""

    label: str
    repo: Path
    env: dict


def in_turn(checkouts: list[Measured], n: int) -> list[Measured]:
    """Round ``n``'s order: the checkouts alternate going first, so that neither always meets the
    machine as the other left it."""
    return checkouts if n % 2 == 0 else checkouts[::-1]


def measure_validation(args, checkouts: list[Measured], work: Path) -> dict:
    logs = work / "logs"
    print(f"validation: {args.model.name} {args.dtype} {args.variant}, cold caches first", flush=True)
    cold, rounds = {}, {c.label: [] for c in checkouts}
    for c in checkouts:
        out = work / "exports" / f"{c.label}-{args.dtype}-{args.variant}"
        e = export(args, c.repo, c.env, args.model, args.dtype, args.variant, out, logs / f"{c.label}-export-cold.log")
        v = validate(c.repo, c.env, out, logs / f"{c.label}-validate-cold.log")
        cold[c.label] = {"export": e, "validate": v, "ratio": round(v["wall_s"] / e["wall_s"], 3)}
        print(f"  {c.label} cold: export {e['wall_s']} s, validate {v['wall_s']} s ({v['status']})", flush=True)
    for n in range(args.rounds):
        for c in in_turn(checkouts, n):
            out = work / "exports" / f"{c.label}-{args.dtype}-{args.variant}"
            e = export(args, c.repo, c.env, args.model, args.dtype, args.variant, out, logs / f"{c.label}-export-{n}.log")
            v = validate(c.repo, c.env, out, logs / f"{c.label}-validate-{n}.log")
            rounds[c.label].append({"export": e, "validate": v, "ratio": round(v["wall_s"] / e["wall_s"], 3)})
            print(f"  round {n + 1} {c.label}: export {e['wall_s']} s ({e['cpu_s']} s CPU), validate {v['wall_s']} s "
                  f"({v['cpu_s']} s CPU, {v['status']}): {rounds[c.label][-1]['ratio']} x", flush=True)
    results = {}
    for c in checkouts:
        shutil.rmtree(work / "exports" / f"{c.label}-{args.dtype}-{args.variant}", ignore_errors=True)
        exports, validations = [r["export"] for r in rounds[c.label]], [r["validate"] for r in rounds[c.label]]
        ratio = median(validations, "wall_s") / median(exports, "wall_s")
        results[c.label] = {
            "model": str(args.model), "dtype": args.dtype, "variant": args.variant, "ep": "cpu",
            "cold": cold[c.label], "rounds": rounds[c.label],
            "median": {"export_wall_s": median(exports, "wall_s"), "export_cpu_s": median(exports, "cpu_s"),
                       "validate_wall_s": median(validations, "wall_s"),
                       "validate_cpu_s": median(validations, "cpu_s")},
            "validate_over_export": round(ratio, 3),
            "validate_over_export_cpu": round(median(validations, "cpu_s") / median(exports, "cpu_s"), 3),
            "target": f"warm validation wall <= {VALIDATION_TARGET} x export wall (medians)",
            "target_met": ratio <= VALIDATION_TARGET,
            "all_passed": all(v["status"] == "passed" for v in validations),
        }
    return results


def measure_int4(args, checkouts: list[Measured], work: Path) -> dict:
    logs = work / "logs"
    print(f"int4: building {args.geometry} with {args.layers} layers under {work}", flush=True)
    checkpoint = build_checkpoints(args.geometry, [args.layers], work / "checkpoints")[args.layers]
    rounds = {c.label: [] for c in checkouts}
    for c in checkouts:  # a warm-up export each (rope tables, the page cache), not counted
        warm = work / "exports" / f"{c.label}-warm-up"
        export(args, c.repo, c.env, checkpoint, "fp16", None, warm, logs / f"{c.label}-export-warm-up.log", args.int4_ep)
        shutil.rmtree(warm, ignore_errors=True)
    for n in range(args.rounds):
        for c in in_turn(checkouts, n):
            row = {}
            for dtype in (("fp16", "int4") if n % 2 == 0 else ("int4", "fp16")):
                out = work / "exports" / f"{c.label}-{args.geometry}-L{args.layers}-{dtype}"
                row[dtype] = export(args, c.repo, c.env, checkpoint, dtype, None, out,
                                    logs / f"{c.label}-export-{dtype}-{n}.log", args.int4_ep)
                print(f"  round {n + 1} {c.label}: {dtype} export {row[dtype]['wall_s']} s ({row[dtype]['cpu_s']} s CPU, "
                      f"{row[dtype]['export_bytes'] / GIB:.2f} GiB)", flush=True)
                if dtype == "int4" and args.validate_int4:
                    row["int4_validate"] = validate(c.repo, c.env, out, logs / f"{c.label}-validate-int4-{n}.log",
                                                    args.int4_ep)
                    print(f"  round {n + 1} {c.label}: int4 validate {row['int4_validate']['wall_s']} s, weights "
                          f"{row['int4_validate']['gate_timings_s'].get('weights')} s", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            row["ratio"] = round(row["int4"]["wall_s"] / row["fp16"]["wall_s"], 3)
            rounds[c.label].append(row)
    results = {}
    for c in checkouts:
        fp16, int4 = [r["fp16"] for r in rounds[c.label]], [r["int4"] for r in rounds[c.label]]
        ratio = median(int4, "wall_s") / median(fp16, "wall_s")
        results[c.label] = {
            "geometry": args.geometry, "layers": args.layers, "checkpoint": str(checkpoint), "ep": args.int4_ep,
            "depth_truncated": args.layers < _full_depth(args.geometry), "rounds": rounds[c.label],
            "median": {"fp16_wall_s": median(fp16, "wall_s"), "fp16_cpu_s": median(fp16, "cpu_s"),
                       "int4_wall_s": median(int4, "wall_s"), "int4_cpu_s": median(int4, "cpu_s")},
            "int4_over_fp16": round(ratio, 3),
            "int4_over_fp16_cpu": round(median(int4, "cpu_s") / median(fp16, "cpu_s"), 3),
            "target": f"int4 export wall <= {INT4_TARGET} x fp16 export wall (medians)",
            "target_met": ratio <= INT4_TARGET,
        }
        if args.validate_int4:
            results[c.label]["int4_validate_median_s"] = median([r["int4_validate"] for r in rounds[c.label]], "wall_s")
    return results


def _full_depth(geometry: str) -> int:
    from exporter.geometries import geometry_config

    return geometry_config(geometry)["num_hidden_layers"]


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
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout (the code before a change) measured in the same rounds, "
                             "alternating with --repo, each with caches of its own")
    parser.add_argument("--work", type=Path, default=Path("/tmp/exportfarm-validation-cost"),
                        help="checkpoints, exports, caches and logs (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "validation_cost_cpu.json")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"validation", "int4"}:
        parser.error("--parts takes validation, int4 or both")
    work = args.work.resolve()
    shutil.rmtree(work / "exports", ignore_errors=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    checkouts = []
    for label, repo in (("measured", args.repo), ("baseline", args.baseline)):
        if repo is None:
            continue
        cache = work / f"cache-{label}"
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(repo.resolve()), "EXPORTFARM_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
        checkouts.append(Measured(label, repo.resolve(), env))
    result = {
        "benchmark": "validation_cost",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "checkouts": {c.label: checkout(c.repo) for c in checkouts},
        "versions": versions(checkouts[0].env),
        "machine": machine(),
        "load_average_before": list(os.getloadavg()),
    }
    if "validation" in parts:
        result["validation"] = measure_validation(args, checkouts, work)
    if "int4" in parts:
        result["int4"] = measure_int4(args, checkouts, work)
    result["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for c in checkouts:
        if "validation" in result:
            v = result["validation"][c.label]
            print(f"{c.label} validation: {v['median']['validate_wall_s']} s against export "
                  f"{v['median']['export_wall_s']} s: {v['validate_over_export']} x (target <= {VALIDATION_TARGET}: "
                  f"{v['target_met']}); cold {v['cold']['ratio']} x", flush=True)
        if "int4" in result:
            q = result["int4"][c.label]
            print(f"{c.label} int4 export {q['median']['int4_wall_s']} s against fp16 {q['median']['fp16_wall_s']} s "
                  f"({q['geometry']}, {q['layers']} layers): {q['int4_over_fp16']} x (target <= {INT4_TARGET}: "
                  f"{q['target_met']})", flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
