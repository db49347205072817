"""Benchmark reports a person reads: a PNG plot of ms/token against context and a Markdown summary.

Input is the JSON of ``benchmarks/gpu_matrix.py`` (many configurations of one model) or the
``benchmark.json`` of one export (one line). The summary names the fastest configuration per
context, the crossover between our variants, and recommends a variant per context range.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def series_of(result: dict) -> tuple[dict[str, dict[int, float]], dict[int, float] | None]:
    """({configuration: {ctx: median ms/token}}, floor {ctx: ms} or None) from either JSON kind."""
    if "configs" in result:
        series = {name: {int(ctx): fig["decode_ms_median"] for ctx, fig in cfg["decode"].items()}
                  for name, cfg in result["configs"].items() if cfg.get("decode")}
        floor = result.get("floor", {}).get("decode_ms")
        return series, ({int(c): v for c, v in floor.items()} if floor else None)
    label = f"{result['variant']} ({result['ep']}{', CUDA graph' if result.get('settings', {}).get('cuda_graph') else ''})"
    series: dict[str, dict[int, float]] = {}
    for c in result["decode"]:  # one line per batch size; batch 1 keeps the plain label
        batch = c.get("batch", 1)
        series.setdefault(label if batch == 1 else f"{label}, batch {batch}", {})[c["ctx"]] = c["decode_ms_median"]
    return series, None


def plot(result: dict, path: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, floor = series_of(result)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, points in sorted(series.items()):
        if name == "transformers eager":
            continue  # an order of magnitude slower; it is in the table, not on this scale
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name, linestyle="-" if name.startswith("ours") else "-.")
    if floor:
        xs = sorted(floor)
        ax.plot(xs, [floor[x] for x in xs], "k--", label="floor: (weights + KV) / copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode ms / token (median)")
    ax.set_title(title or f"{result.get('model', '')} decode latency {result.get('device', '')}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TIE = 0.03  # benchmarks/decode_check.py's tolerance: closer than this is not a measured difference


def reproduced_configs(result: dict) -> set[str] | None:
    """Configurations an independent harness reproduced in the same run; None when none was run."""
    check = result.get("independent_check")
    if not check:
        return None
    return {name for name, row in check.get("configs", {}).items() if row.get("reproduced")}


def recommend(series: dict[str, dict[int, float]], allowed: set[str] | None = None) -> list[tuple[int, str, float]]:
    """Per context, our fastest configuration: (ctx, name, ms); only among ``allowed`` when given."""
    ours = {n: s for n, s in series.items() if n.startswith("ours")} or series
    if allowed is not None:
        ours = {n: s for n, s in ours.items() if n in allowed}
    contexts = sorted({c for s in ours.values() for c in s})
    return [(c, *min(((n, s[c]) for n, s in ours.items() if c in s), key=lambda t: t[1])) for c in contexts]


def _ranges(picks: list[tuple[int, str, float]]) -> list[str]:
    lines, start = [], 0
    for i, (ctx, name, _) in enumerate(picks):
        last = i + 1 == len(picks) or picks[i + 1][1] != name
        if last:
            first = picks[start][0]
            span = f"{first}" if first == ctx else f"{first}-{ctx}"
            lines.append(f"- {span} tokens: **{name}**")
            start = i + 1
    return lines


# benchmarks/results/h200/window_cost.json (H200, onnxruntime-gpu 1.31.1, fp16, CUDA graph).
WINDOW_NOTE = (
    "This model has sliding-window layers. attn_static runs them with an in-graph window mask, which moves "
    "CUDA's Attention from Flash / cuDNN to the memory-efficient kernel over the whole cache: measured on an "
    "H200 (benchmarks/window_cost.py, 8-layer Mistral-style model, window 512) it decoded 2.2x slower than "
    "the same model without a window at 1024 tokens and 6.6x at 4096, while gqa (local_window_size) was "
    "0.87-0.91x. Prefer gqa for windowed models on CUDA."
)


def markdown(result: dict) -> str:
    series, floor = series_of(result)
    contexts = sorted({c for s in series.values() for c in s})
    head = ["configuration", *[str(c) for c in contexts]]
    lines = [f"# Decode benchmark: {result.get('model', result.get('variant', ''))}", ""]
    if "versions" in result:
        v = result["versions"]
        lines += [f"{result.get('device', '')}, onnxruntime {v.get('onnxruntime')}, CUDA {v.get('cuda')}, "
                  f"torch {v.get('torch')}, transformers {v.get('transformers')}; {result.get('date', '')}.",
                  f"Command: `{result.get('command', '')}`", ""]
    if result.get("variant") == "attn_static" and result.get("settings", {}).get("sliding_layers"):
        lines += [WINDOW_NOTE, ""]
    lines += ["Median ms/token at batch 1 (p90 and prefill in the JSON):", "",
              "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in sorted(series, key=lambda n: (not n.startswith("ours"), n)):
        lines.append("| " + name + " | " + " | ".join(f"{series[name][c]:.3f}" if c in series[name] else "-" for c in contexts) + " |")
    if floor:
        lines.append("| floor | " + " | ".join(f"{floor[c]:.3f}" for c in contexts) + " |")
    allowed = reproduced_configs(result)
    picks = recommend(series, allowed)
    if allowed is None:
        lines += ["", "Recommended variant per context range (our fastest measured; no independent check in this run):",
                  "", *_ranges(picks)]
    elif picks:
        lines += ["", "Recommended variant per context range (our fastest among the configurations "
                  "benchmarks/decode_check.py reproduced within 3%):", "", *_ranges(picks)]
        close = [f"{c}: {name} {ms:.3f} vs {other} {series[other][c]:.3f}" for c, name, ms in picks
                 for other in sorted(allowed) if other != name and other.startswith("ours") and c in series.get(other, {})
                 and series[other][c] <= ms * (1 + TIE)]
        if close:
            lines += ["", "Within 3% of the pick (a tie, not a measured difference): " + "; ".join(close)]
    else:
        lines += ["", "No recommendation: no configuration of ours was reproduced by the independent check."]
    image = result.get("image") or {}
    if "encode_ms_median" in image:  # an image-text export
        size = (f"{image['image_size']} px" if "image_size" in image
                else "grid t, h, w of patches " + " x ".join(str(v) for v in image["image_grid_thw"]))
        lines += ["", f"Image ({size}, {image['tokens_per_image']} tokens): vision graph "
                  f"{image['encode_ms_median']:.3f} ms; time to the first token of a {image['prompt_tokens']}-token "
                  f"one-image prompt (vision, embedding, prefill) {image['time_to_first_token_ms_median']:.3f} ms "
                  "(medians); text decode above runs through the embedding graph."]
    elif image.get("skipped"):
        lines += ["", f"Image figures: {image['skipped']}."]
    static = [n for n in series if n.startswith("ours attn_static") and "graph" in n and "no graph" not in n]
    gqa = [n for n in series if n.startswith("ours gqa") and "no graph" not in n]
    if static and gqa:
        s, g = series[static[0]], series[gqa[0]]
        faster = [c for c in contexts if c in s and c in g and s[c] < g[c] * (1 - TIE)]
        crossover = next((c for c in contexts if c in faster and all(x in faster for x in contexts if x >= c)), None)
        lines += ["", f"Crossover: {static[0]} is more than 3% faster than {gqa[0]} "
                  + (f"from {crossover} tokens on." if crossover else "at no context length from which it stays so.")]
    if floor:
        best = {c: ms for c, _, ms in picks}
        lines += ["", "Our fastest against the floor: " + ", ".join(f"{c}: {best[c] / floor[c]:.2f}x" for c in contexts if c in best and c in floor)]
    peers = [n for n in series if n.startswith("onnxruntime-genai")]
    if allowed is not None and peers and not any(n in allowed for n in peers):
        lines += ["", "Against the onnxruntime-genai builder: none of its figures was reproduced within 3% by the "
                  "independent check (its figures are in the table below), so no comparison is claimed here."]
        peers = []
    elif allowed is not None:
        peers = [n for n in peers if n in allowed]
    if peers:
        best_peer = {c: min(series[n][c] for n in peers if c in series[n]) for c in contexts if any(c in series[n] for n in peers)}
        best = {c: ms for c, _, ms in picks}
        def versus(c: int) -> str:
            gain = 1 - best[c] / best_peer[c]
            if abs(gain) <= TIE:
                return f"{c}: tie ({100 * gain:+.1f}%)"
            return f"{c}: {100 * gain:.1f}% faster" if gain > 0 else f"{c}: {-100 * gain:.1f}% slower"

        lines += ["", "Against the onnxruntime-genai builder's best setting (within 3% is a tie): " + ", ".join(
            versus(c) for c in contexts if c in best and c in best_peer)]
    lines += _check_lines(result) + _diagnosis_lines(result)
    if result.get("errors"):
        lines += ["", "Not measured (the error, as ONNX Runtime gave it):", ""]
        lines += [f"- {where}: {str(err).splitlines()[-1][:300]}" for where, err in result["errors"].items()]
    return "\n".join(lines) + "\n"


def _check_lines(result: dict) -> list[str]:
    check = result.get("independent_check")
    if not check or not check.get("configs"):
        return []
    contexts = check["contexts"]
    lines = ["", f"Independent check ({check['tool']}, same run, same exports): matrix ms / check ms per context", "",
             "| configuration | " + " | ".join(str(c) for c in contexts) + " | reproduced |",
             "|" + " --- |" * (len(contexts) + 2)]
    for name, row in check["configs"].items():
        cells = [f"{row['contexts'][str(c)]['matrix_ms']:.3f} / {row['contexts'][str(c)]['check_ms']:.3f}"
                 if str(c) in row["contexts"] else "-" for c in contexts]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if row['reproduced'] else 'no'} |")
    return lines


def _diagnosis_lines(result: dict) -> list[str]:
    diagnosis = result.get("driving_diagnosis")
    if not diagnosis or not diagnosis.get("decode_ms_median"):
        return []
    ways = sorted({w for rows in diagnosis["decode_ms_median"].values() for w in rows})
    lines = ["", f"How the driving changes a GQA export's uncaptured decode (ctx {diagnosis['ctx']}, "
             f"buffer {diagnosis['buffer']}, median ms/token):", "",
             "| export | " + " | ".join(ways) + " |", "|" + " --- |" * (len(ways) + 1)]
    for name, rows in diagnosis["decode_ms_median"].items():
        lines.append(f"| {name} | " + " | ".join(f"{rows[w]:.3f}" if w in rows else "-" for w in ways) + " |")
    return lines


def write_report(result_path: Path, out_dir: Path | None = None) -> tuple[Path, Path]:
    result = json.loads(Path(result_path).read_text())
    out_dir = Path(out_dir or Path(result_path).parent)
    stem = Path(result_path).stem
    png = plot(result, out_dir / f"{stem}.png")
    md = out_dir / f"{stem}.md"
    md.write_text(markdown(result))
    return png, md



def dtype_recommendation(rows: dict[str, dict], thresholds: dict | None = None) -> dict:
    """Which export of a dtype matrix to ship, speed weighed against measured quality.

    ``rows``: name -> {"dtype", "decode_ms", "model_bytes"} and, for quantized dtypes, the quality
    figures against the fp32 reference ("agreement", "kl_mean", "ppl_delta"). A row of a dtype with
    quality-gate thresholds (int4, int8: the gate's defaults, each overridden per key by ``thresholds``)
    is eligible when they hold; a float row (fp32, fp16, bf16) has no such gate here: its parity is the
    parity gate's, not a quality budget. The pick is the fastest eligible row; each faster row it
    passes over is named with the figure that ruled it out."""
    import math

    from exporter.validation.gates.quality import DEFAULT_THRESHOLDS

    limits = {dtype: {**bounds, **(thresholds or {}).get(dtype, {})} for dtype, bounds in DEFAULT_THRESHOLDS.items()}
    limits.update({dtype: bounds for dtype, bounds in (thresholds or {}).items() if dtype not in limits})
    verdicts = {}
    for name, row in rows.items():
        bounds = limits.get(row["dtype"])
        if bounds is None:
            verdicts[name] = []
            continue
        missing = [k for k in ("agreement", "kl_mean", "ppl_delta") if row.get(k) is None]
        if missing:
            verdicts[name] = [f"no {', '.join(missing)} measured"]
            continue
        failed = []
        if row["agreement"] < bounds["agreement_min"]:
            failed.append(f"agreement {row['agreement']:.3f} < {bounds['agreement_min']}")
        if row["kl_mean"] > bounds["kl_max"]:
            failed.append(f"KL {row['kl_mean']:.4f} > {bounds['kl_max']}")
        if row["ppl_delta"] > bounds["ppl_delta_max"]:
            failed.append(f"perplexity +{100 * row['ppl_delta']:.1f}% > +{100 * bounds['ppl_delta_max']:.0f}%")
        verdicts[name] = failed

    def speed(name: str) -> float:
        ms = rows[name].get("decode_ms")
        return float(ms) if isinstance(ms, (int, float)) and math.isfinite(ms) else math.inf

    for name in rows:
        if speed(name) == math.inf:
            verdicts[name] = [*verdicts[name], "no decode time measured"]
    by_speed = sorted(rows, key=speed)
    pick = next((n for n in by_speed if not verdicts[n]), None)
    passed_over = {n: verdicts[n] for n in by_speed[: by_speed.index(pick) if pick else len(by_speed)]}
    return {"pick": pick, "passed_over": passed_over, "verdicts": verdicts, "thresholds": limits}


def cpu_markdown(result: dict) -> str:
    """The summary of ``benchmarks/cpu_matrix.py``'s JSON: every export's speed, size and quality, ours
    against the builder's, and the recommendation per dtype and overall (speed weighed against quality)."""
    rows = result["results"]
    lines = [f"# CPU decode: {result.get('model', '')}", "",
             f"{result.get('how_driven', '')}. Quality: {result.get('quality', '')}.",
             f"Command: `{result.get('command', '')}`", "",
             "| export | decode ms/token | prefill ms | MB | agreement | KL | perplexity |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        quality = [f"{row['agreement']:.3f}", f"{row['kl_mean']:.4f}", f"{100 * row['ppl_delta']:+.1f}%"] \
            if row.get("kl_mean") is not None else ["-", "-", "-"]
        lines.append(f"| {name} | {row['decode_ms']:.2f} | {row['prefill_ms']:.1f} | {row['model_bytes'] / 1e6:.0f} | "
                     + " | ".join(quality) + " |")
    ours = {n: {**r, "dtype": _dtype_of(n)} for n, r in rows.items()
            if n.startswith("ours") and "threads=" not in n and _dtype_of(n)}
    verdict = dtype_recommendation(ours)
    lines += ["", "Recommendation (the fastest of our exports whose quality passes its dtype's quality-gate "
              "thresholds against the fp32 reference):", ""]
    if verdict["pick"]:
        row = rows[verdict["pick"]]
        lines.append(f"- **{verdict['pick']}**: {row['decode_ms']:.2f} ms/token, {row['model_bytes'] / 1e6:.0f} MB")
    else:
        lines.append("- none of our exports passes")
    for name, why in verdict["passed_over"].items():
        lines.append(f"- not {name} ({rows[name]['decode_ms']:.2f} ms/token): {'; '.join(why)}")
    for dtype in ("int4", "int8", "fp32"):
        mine = {n: r for n, r in ours.items() if r["dtype"] == dtype}
        peer = f"genai builder {dtype}"
        if mine and peer in rows:
            best = min(mine, key=lambda n: mine[n]["decode_ms"])
            ratio = mine[best]["decode_ms"] / rows[peer]["decode_ms"]
            lines.append(f"- {dtype}: our fastest ({best}) is {ratio:.2f}x the builder's decode time"
                         + (f", KL {mine[best]['kl_mean']:.4f} against its {rows[peer]['kl_mean']:.4f}"
                            if dtype != "fp32" and rows[peer].get("kl_mean") is not None else ""))
            equal = f"{peer} threads=0"  # the builder's package given our thread setting (cpu_matrix)
            if best in rows and equal in rows:
                lines.append(f"- {dtype}, the builder's package given our thread setting: "
                             f"{mine[best]['decode_ms'] / rows[equal]['decode_ms']:.2f}x its decode time")
            gqa = f"ours {dtype} gqa"
            if "bare_session_decode_ms" in rows.get(gqa, {}) and "bare_session_decode_ms" in rows[peer]:
                lines.append(f"- {dtype}, both gqa graphs in a bare session (IO binding, the same threads): ours "
                             f"{rows[gqa]['bare_session_decode_ms']:.2f} ms/token against "
                             f"{rows[peer]['bare_session_decode_ms']:.2f} ("
                             f"{rows[gqa]['bare_session_decode_ms'] / rows[peer]['bare_session_decode_ms']:.2f}x)")
    for name, err in result.get("failed_exports", {}).items():
        lines.append(f"- {name} could not be built: {err.splitlines()[-1][:300]}")
    return "\n".join(lines) + "\n"


def _dtype_of(name: str) -> str | None:
    return next((d for d in ("int4", "int8", "fp32", "fp16", "bf16") if f" {d} " in f" {name} "), None)


if __name__ == "__main__":
    import sys

    for argument in sys.argv[1:]:
        print(*write_report(Path(argument)))
