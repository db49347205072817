"""Memory of export, validation and benchmark at production geometries, fitted per layer and extrapolated.

What is measured
----------------
* Depth-truncated random-weight bf16 checkpoints of real models (``exporter.geometries``:
  Llama-3.1-8B, Qwen2.5-32B, Llama-3.3-70B): the real hidden size, MLP width, heads and
  vocabulary, with 1, 2 and 4 decoder layers (``--layers``). The deepest is written once, a shard
  per layer; a shallower one is a directory whose index names its first layers' shards (links).
* Per depth and dtype, in fresh processes, each sampled every 20 ms over its whole process tree
  for the peak RssAnon (anonymous: what must fit), RssFile (page cache of mapped files: the kernel
  drops it under pressure) and, on a GPU, the device memory its processes hold (NVML):
  - ``export``: ``exportfarm export --no-validate``;
  - ``session``: a bare session of the export as validation makes it, running one prefill (the
    quality window of a quantized export, parity's prompt of a float one) — the export's own cost;
  - ``validate``: ``exportfarm validate`` with an empty reference cache (the reference is computed);
  - ``bench`` (``--bench``, on a GPU): ``exportfarm bench`` at one context.
* ``validate - session``: what validation holds beyond the export's own session (the streamed
  reference, the weight check, the gate's logits). Its per-layer growth is the point: the whole-model
  reference grew it by the fp32 layer (3.4 GB a layer at the 70B geometry).
* A least-squares line per stage over the depths (intercept + slope x layers), extrapolated to the
  model's full depth, beside ``exporter.resources.estimate_resources``' prediction for each depth and
  for the full model (host RssAnon, GPU memory, export size).

Usage (a results file per machine; the figures are this machine's):

    python benchmarks/scale.py --geometry llama-3.3-70b --dtypes int4 --ep cpu --layers 1,2,4 \\
        --work /tmp/scale --out benchmarks/results/scale_cpu.json
    # on the GPU machine (benchmarks/gpu_env.sh first):
    python3 benchmarks/scale.py --geometry llama-3.1-8b --dtypes fp16,int4 --ep cuda --layers 32 --bench ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1024 ** 3
SAMPLE_S = 0.02


# --- sampling a process tree ----------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (via /proc/<pid>/task/<tid>/children); used by the other benchmarks too."""
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stack += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def _status(pid: int) -> tuple[int, int]:
    anon = file = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "RssAnon":
                anon = int(rest.split()[0]) * 1024
            elif key == "RssFile":
                file = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return anon, file


class GpuMemory:
    """Device memory held by a process tree (NVML): its processes' own figures where NVML names
    them, else the device's used memory above what it was when the process started (NVML inside a
    container may report processes by the host's pids). None where there is no NVML."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.nvml, self.handles = None, []
        self.baseline = 0

    def used(self) -> int:
        return sum(self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)

    def start(self) -> None:
        if self.nvml is not None:
            self.baseline = self.used()

    def held_by(self, pids: set[int]) -> int | None:
        if self.nvml is None:
            return None
        total, named = 0, False
        for handle in self.handles:
            try:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid in pids and proc.usedGpuMemory:
                        total, named = total + proc.usedGpuMemory, True
            except self.nvml.NVMLError:
                pass
        return total if named else max(0, self.used() - self.baseline)


def run_sampled(cmd: list[str], log: Path, env: dict | None = None, gpu: GpuMemory | None = None,
                ok: tuple[int, ...] = (0,)) -> dict:
    """Run ``cmd`` to its end, sampling its process tree; its peaks and wall time. An exit status
    outside ``ok`` raises (``exportfarm validate`` exits 2 when a gate fails: a finished run)."""
    os.sync()
    peaks = {"rss_anon": 0, "rss_file": 0, "gpu": None}
    if gpu is not None:
        gpu.start()
    with log.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT)
        last_gpu = 0.0
        while proc.poll() is None:
            pids = process_tree(proc.pid)
            anon = file = 0
            for p in pids:
                a, f = _status(p)
                anon, file = anon + a, file + f
            peaks["rss_anon"], peaks["rss_file"] = max(peaks["rss_anon"], anon), max(peaks["rss_file"], file)
            if gpu is not None and time.perf_counter() - last_gpu > 0.2:  # NVML is slower to ask
                held = gpu.held_by(set(pids))
                if held is not None:
                    peaks["gpu"] = max(peaks["gpu"] or 0, held)
                last_gpu = time.perf_counter()
            time.sleep(SAMPLE_S)
        wall = time.perf_counter() - start
    if proc.returncode not in ok:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return {"wall_s": round(wall, 2), "peak_rss_anon_gib": round(peaks["rss_anon"] / GIB, 3),
            "peak_rss_file_gib": round(peaks["rss_file"] / GIB, 3),
            "peak_gpu_gib": None if peaks["gpu"] is None else round(peaks["gpu"] / GIB, 3)}


# --- checkpoints ----------------------------------------------------------------------------------


# Geometries whose layers build_checkpoints writes itself (llama-like tensors); every other family (hybrids,
# mixtures of experts) is made by transformers' own model class and save_pretrained, one checkpoint a depth.
HAND_WRITTEN_TYPES = ("llama", "qwen2")  # the tensors the writer below knows (qwen2: its q / k / v biases)


def build_with_transformers(geometry: str, depths: list[int], root: Path) -> dict[int, Path]:
    """A random-weight bf16 checkpoint of ``geometry`` at each depth, built by transformers' model class (its own
    initialization, std 0.02) and written by save_pretrained under the checkpoint's own tensor names."""
    import torch
    import transformers

    from exporter.geometries import geometry_config

    out = {}
    for n in depths:
        folder = root / f"{geometry}-L{n}"
        if not (folder / ".complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            config = dict(geometry_config(geometry, n))
            config.pop("architectures", None), config.pop("torch_dtype", None)
            hf = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
            model.save_pretrained(folder, max_shard_size="2GB")
            del model
            (folder / ".complete").touch()
            print(f"  {folder.name}: written", flush=True)
        out[n] = folder
    return out


def build_checkpoints(geometry: str, depths: list[int], root: Path) -> dict[int, Path]:
    """The deepest checkpoint written once (a shard per layer), the others linking its shards."""
    import torch
    from safetensors.torch import save_file

    from exporter.geometries import geometry_config, write_geometry_config

    if geometry_config(geometry)["model_type"] not in HAND_WRITTEN_TYPES:
        return build_with_transformers(geometry, depths, root)
    deepest = max(depths)
    full = root / f"{geometry}-L{deepest}"
    config = geometry_config(geometry, deepest)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    bias = config["model_type"] == "qwen2"
    done = full / ".complete"
    if not done.is_file():
        shutil.rmtree(full, ignore_errors=True)
        write_geometry_config(geometry, full, deepest)
        generator = torch.Generator().manual_seed(0)
        pool = (torch.randn(1 << 26, generator=generator) * 0.02).to(torch.bfloat16)  # 128 MB of values
        offset = [0]

        def weight(*shape):
            n = 1
            for s in shape:
                n *= s
            out = torch.empty(n, dtype=torch.bfloat16)
            at = 0
            while at < n:  # tile the pool, starting somewhere new for every tensor
                start = offset[0] % pool.numel()
                take = min(n - at, pool.numel() - start)
                out[at:at + take] = pool[start:start + take]
                at, offset[0] = at + take, offset[0] + take + 7919
            return out.reshape(shape)

        ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
        index = {}
        base = {"model.embed_tokens.weight": weight(vocab, h), "model.norm.weight": ones(h)}
        if not config.get("tie_word_embeddings"):
            base["lm_head.weight"] = weight(vocab, h)
        save_file(base, str(full / "base.safetensors"), metadata={"format": "pt"})
        index.update({k: "base.safetensors" for k in base})
        del base
        for i in range(deepest):
            p = f"model.layers.{i}."
            layer = {p + "self_attn.q_proj.weight": weight(heads * head_dim, h),
                     p + "self_attn.k_proj.weight": weight(kv * head_dim, h),
                     p + "self_attn.v_proj.weight": weight(kv * head_dim, h),
                     p + "self_attn.o_proj.weight": weight(h, heads * head_dim),
                     p + "mlp.gate_proj.weight": weight(inter, h), p + "mlp.up_proj.weight": weight(inter, h),
                     p + "mlp.down_proj.weight": weight(h, inter),
                     p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)}
            if bias:
                layer.update({p + "self_attn.q_proj.bias": weight(heads * head_dim),
                              p + "self_attn.k_proj.bias": weight(kv * head_dim),
                              p + "self_attn.v_proj.bias": weight(kv * head_dim)})
            name = f"layer-{i:03d}.safetensors"
            save_file(layer, str(full / name), metadata={"format": "pt"})
            index.update({k: name for k in layer})
            print(f"  {full.name}: layer {i + 1}/{deepest} written", flush=True)
        (full / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        done.touch()
    out = {deepest: full}
    index = json.loads((full / "model.safetensors.index.json").read_text())["weight_map"]
    for n in depths:
        if n == deepest:
            continue
        d = root / f"{geometry}-L{n}"
        shutil.rmtree(d, ignore_errors=True)
        write_geometry_config(geometry, d, n)
        keep = {k: v for k, v in index.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
        for name in sorted(set(keep.values())):
            (d / name).symlink_to(full / name)
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
        out[n] = d
    return out


# --- one depth ------------------------------------------------------------------------------------


def bare_session(export_dir: str, ep: str) -> None:
    """The export's session as validation makes it, and one prefill (run in its own process)."""
    import numpy as np

    from exporter.runtime.session import read_metadata
    from exporter.validation.gates.quality import WINDOW
    from exporter.validation.validate import PARITY_PROMPT_LEN, validation_session

    meta = read_metadata(Path(export_dir) / "model.onnx")
    lm = validation_session(Path(export_dir), ep, meta["dtype"])
    length = WINDOW if meta["dtype"] in ("int4", "int8") else PARITY_PROMPT_LEN
    ids = np.random.default_rng(0).integers(3, int(meta["config"]["vocab_size"]), size=(1, length))
    lm.forward(ids.astype(np.int64), lm.new_state())


def measure_depth(checkpoint: Path, layers: int, dtype: str, ep: str, work: Path, bench: bool, gpu) -> dict:
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.request import ExportRequest
    from exporter.resources import estimate_resources

    out = work / f"export-L{layers}-{dtype}-{ep}"
    shutil.rmtree(out, ignore_errors=True)
    cache = work / f"cache-L{layers}-{dtype}"
    shutil.rmtree(cache, ignore_errors=True)
    env = {"EXPORTFARM_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "exporter.cli"]
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    tag = f"L{layers}-{dtype}-{ep}"
    row = {"layers": layers, "dtype": dtype, "ep": ep}
    print(f"[{tag}] export", flush=True)
    row["export"] = run_sampled([*cli, "export", "--model", str(checkpoint), "--dtype", dtype, "--ep", ep,
                                 "--out", str(out), "--no-validate", "--overwrite"], logs / f"{tag}-export.log", env, gpu)
    row["export_bytes"] = (out / "model.onnx.data").stat().st_size
    print(f"[{tag}] session", flush=True)
    row["session"] = run_sampled([sys.executable, str(Path(__file__).resolve()), "_session", str(out), ep],
                                 logs / f"{tag}-session.log", env, gpu)
    print(f"[{tag}] validate", flush=True)
    row["validate"] = run_sampled([*cli, "validate", str(out), "--ep", ep], logs / f"{tag}-validate.log", env, gpu,
                                  ok=(0, 2))
    report = json.loads((out / "parity_report.json").read_text())
    row["validation"] = {"status": report["status"], "failed_gates": report["failed_gates"],
                         "timings_s": report["timings_s"]}
    row["validate_beyond_session_gib"] = round(row["validate"]["peak_rss_anon_gib"] - row["session"]["peak_rss_anon_gib"], 3)
    if bench:
        print(f"[{tag}] bench", flush=True)
        row["bench"] = run_sampled([*cli, "bench", str(out), "--ep", ep, "--ctx", "512", "--steps", "16"],
                                   logs / f"{tag}-bench.log", env, gpu)
    config = load_model_config(checkpoint, ARCHITECTURES)
    estimate = estimate_resources(config, ExportRequest(model=str(checkpoint), dtype=dtype, ep=ep),
                                  reference_on_gpu=_reference_on_gpu(ep))
    row["estimate"] = estimate.to_dict()
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return row


def _reference_on_gpu(ep: str) -> bool:
    if ep != "cuda":
        return False
    import torch

    return torch.cuda.is_available()


def fit(rows: list[dict], key, full_depth: int) -> dict | None:
    """Least squares ``value = a + b * layers`` over the depths, and its value at ``full_depth``."""
    points = [(r["layers"], key(r)) for r in rows if key(r) is not None]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    return {"intercept_gib": round(intercept, 3), "per_layer_gib": round(slope, 4),
            "at_full_depth_gib": round(intercept + slope * full_depth, 2), "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", default="llama-3.3-70b")
    parser.add_argument("--layers", default="1,2,4")
    parser.add_argument("--dtypes", default="int4")
    parser.add_argument("--ep", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bench", action="store_true", help="also run the benchmark (a GPU)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/exportfarm-scale"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale_cpu.json")
    parser.add_argument("--append", action="store_true", help="add to --out's runs instead of replacing them")
    parser.add_argument("--build-only", action="store_true", help="write the checkpoints and stop")
    args = parser.parse_args()

    from exporter.geometries import geometry_config, write_geometry_config
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.request import ExportRequest
    from exporter.resources import estimate_resources
    from exporter.versions import package_version

    depths = sorted(int(n) for n in args.layers.split(","))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.work.mkdir(parents=True, exist_ok=True)
    gpu = GpuMemory() if args.ep == "cuda" else None
    started = time.perf_counter()
    print(f"building {args.geometry} at {depths} layers under {args.work}", flush=True)
    checkpoints = build_checkpoints(args.geometry, depths, args.work)
    build_s = time.perf_counter() - started
    if args.build_only:
        print(f"checkpoints written in {build_s:.0f} s", flush=True)
        return
    full = geometry_config(args.geometry)
    full_depth = full.get("num_hidden_layers") or len(full["hybrid_override_pattern"])  # nemotron_h: a letter a block
    full_config = load_model_config(write_geometry_config(args.geometry, args.work / f"{args.geometry}-full-config"),
                                    ARCHITECTURES)
    earlier = json.loads(args.out.read_text()) if args.append and args.out.is_file() else {}
    result = {
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
                    "python": platform.python_version(),
                    "onnxruntime": package_version("onnxruntime") or package_version("onnxruntime-gpu"),
                    "torch": package_version("torch"), "transformers": package_version("transformers"),
                    "gpu": _gpu_name(gpu)},
        "checkpoint_build_s": round(build_s, 1),
        "runs": list(earlier.get("runs", [])),
        **({"earlier_commands": [*earlier.get("earlier_commands", []), earlier.get("command")]} if earlier else {}),
    }
    for dtype in dtypes:
        run = {"geometry": args.geometry, "dtype": dtype, "ep": args.ep, "full_depth": full_depth, "depths": [],
               "estimate_full_depth": estimate_resources(
                   full_config, ExportRequest(model=args.geometry, dtype=dtype, ep=args.ep),
                   reference_on_gpu=_reference_on_gpu(args.ep)).to_dict()}
        result["runs"].append(run)
        for n in depths:
            try:
                run["depths"].append(measure_depth(checkpoints[n], n, dtype, args.ep, args.work, args.bench, gpu))
            except RuntimeError as err:  # a stage that died (killed for memory: -9) is a finding, kept with its words
                run.setdefault("failed_depths", []).append({"layers": n, "error": str(err)[:600]})
                args.out.write_text(json.dumps(result, indent=2) + "\n")
                print(f"[L{n}-{dtype}-{args.ep}] failed: {str(err).splitlines()[0][:300]}", flush=True)
                continue
            run["fits"] = {
                "export_rss_anon": fit(run["depths"], lambda r: r["export"]["peak_rss_anon_gib"], full_depth),
                "session_rss_anon": fit(run["depths"], lambda r: r["session"]["peak_rss_anon_gib"], full_depth),
                "validate_rss_anon": fit(run["depths"], lambda r: r["validate"]["peak_rss_anon_gib"], full_depth),
                "validate_beyond_session_rss_anon": fit(run["depths"], lambda r: r["validate_beyond_session_gib"],
                                                        full_depth),
                "validate_gpu": fit(run["depths"], lambda r: r["validate"]["peak_gpu_gib"], full_depth),
                "bench_gpu": fit(run["depths"], lambda r: (r.get("bench") or {}).get("peak_gpu_gib"), full_depth),
                "export_bytes": fit(run["depths"], lambda r: r["export_bytes"] / GIB, full_depth),
            }
            # Written after every depth: a run cut short keeps what it measured.
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        beyond = run["fits"]["validate_beyond_session_rss_anon"]
        if beyond:
            print(f"{args.geometry} {dtype} {args.ep}: validation beyond the session grows "
                  f"{beyond['per_layer_gib']:.3f} GiB/layer; at {full_depth} layers {beyond['at_full_depth_gib']:.1f} GiB; "
                  f"validate RssAnon at full depth {run['fits']['validate_rss_anon']['at_full_depth_gib']:.1f} GiB "
                  f"(estimate {run['estimate_full_depth']['host_gib']} GiB)", flush=True)
    print(f"wrote {args.out}", flush=True)


def _gpu_name(gpu) -> str | None:
    if gpu is None or gpu.nvml is None or not gpu.handles:
        return None
    name = gpu.nvml.nvmlDeviceGetName(gpu.handles[0])
    return name.decode() if isinstance(name, bytes) else name


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_session":
        bare_session(sys.argv[2], sys.argv[3])
    else:
        main()
