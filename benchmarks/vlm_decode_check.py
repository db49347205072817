"""The decode gap of benchmarks/vlm_speed.py, re-measured by a second harness and profiled (issue 48).

vlm_speed.py drives each package through onnxruntime-genai's Generator. This script takes the same packages (its
``--work`` folder, exported there first with ``vlm_speed.py --export-only``) and times their decoders again:

- ``genai``: the package in onnxruntime-genai 0.18's Generator as vlm_speed.py drives it (a ``--ctx``-token text
  prompt by append_tokens, then greedy steps), median ms per generate_next_token;
- ``plain``: benchmarks/decode_check.py (a harness on onnxruntime's API alone, sharing no code with exporter/ nor
  with genai): the decoder graph in one session, past and present bound to one buffer of ``--buffer`` positions,
  one-token steps after a ``--ctx``-token prompt, without a CUDA graph (the mask growing, as genai's) and with one
  (the mask buffer-wide), each in a fresh session;
- ``kernels``: under each driver, the GPU work of 16 more decode steps as CUPTI records it through torch's profiler
  (every kernel of the process, onnxruntime's and genai's), summed by kernel name per step, with the count of
  kernels a step: where a step's time goes on the device, and how much of it is not device time.

    python benchmarks/vlm_decode_check.py --geometry gemma-3-12b --text-layers 6 --out r.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import decode_check  # noqa: E402
import vlm_speed  # noqa: E402


def genai_decode(package: "vlm_speed.Package", ids: list[int], steps: int, profile: bool) -> dict:
    """One text-prompt run in genai's Generator as vlm_speed.py drives it: median ms per decode step past the first
    4; with ``profile``, the kernels of decode_check.PROFILED_STEPS more steps."""
    profiled = decode_check.PROFILED_STEPS

    def kernels(generator) -> dict:
        return decode_check.gpu_kernels(lambda: [generator.generate_next_token() for _ in range(profiled)], profiled)

    run = package.text(ids, steps, warmup=4, **({"after": kernels, "after_steps": profiled} if profile else {}))
    return {"ms_per_token": run["decode_ms"], "steps": steps, **({"kernels": run["after"]} if profile else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", required=True, choices=sorted(vlm_speed.GEOMETRIES))
    parser.add_argument("--text-layers", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--buffer", type=int, default=0,
                        help="plain harness cache positions (default: the prompt's tokens + 512)")
    parser.add_argument("--ep", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlm-speed"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    checkpoint = args.work / "ckpt" / f"{args.geometry}-L{args.text_layers}"
    labels = {"ours": "ours", "genai": "genai builder (text decoder)"}
    folders = {label: args.work / f"{args.geometry}-L{args.text_layers}-{label}" for label in labels}
    missing = [str(f) for f in folders.values() if not (f / ".exported").is_file()]
    if missing or not (checkpoint / ".complete").is_file():
        raise SystemExit(f"export first (python benchmarks/vlm_speed.py --geometry {args.geometry} --text-layers "
                         f"{args.text_layers} --peers genai --export-only): missing {missing or [str(checkpoint)]}")
    profile = args.ep == "cuda"
    result = {"benchmark": "vlm_decode_check", "command": "python benchmarks/vlm_decode_check.py " + " ".join(sys.argv[1:]),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.node(),
              "geometry": args.geometry, "text_layers": args.text_layers, "ctx": args.ctx,
              "how": __doc__.split("times their decoders again:", 1)[1].strip(), "packages": {}}
    ids = vlm_speed.text_prompt(checkpoint, args.ctx)
    buffer = args.buffer or len(ids) + 512
    result.update(prompt_tokens=len(ids), buffer=buffer)
    for short, folder in folders.items():
        config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
        entry = result["packages"][labels[short]] = {
            "folder": folder.name, "decoder_inputs": sorted(config["inputs"]),
            "sliding_window": config.get("sliding_window"), "genai": [], "plain": {"no_graph": [], "graph": []}}
        package = vlm_speed.Package(short, folder, False, buffer)
        for round_ in range(args.rounds + 1):  # the first warms up and is dropped
            run = genai_decode(package, ids, args.steps, profile and round_ == args.rounds)
            if round_:
                entry["genai"].append(run)
        del package
        for graph in (False, True):
            key = "graph" if graph else "no_graph"
            for round_ in range(args.rounds):
                kernels = {} if profile and round_ == args.rounds - 1 else None
                try:
                    ms = decode_check.measure(folder, graph=graph, buffer=buffer, ctx=len(ids), steps=args.steps,
                                              ep=args.ep, kernels=kernels)
                    entry["plain"][key].append({"ms_per_token": ms, **({"kernels": kernels} if kernels else {})})
                except Exception as err:  # a graph that cannot be captured is a finding
                    entry["plain"][key].append({"error": f"{type(err).__name__}: {str(err)[:600]}"})
                    break
        result["packages"][labels[short]] = entry
        print(labels[short], json.dumps({"genai": [r["ms_per_token"] for r in entry["genai"]],
                                          **{k: [r.get("ms_per_token", r.get("error")) for r in v]
                                             for k, v in entry["plain"].items()}}), flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    import onnxruntime_genai as og

    result["versions"] = {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
