"""The diff between two exports: what changed in the graph, the files, parity, latency and kernels.

``exportfarm diff A B`` prints it; the farm runs it after every re-export and publishes
``diff.json`` and ``diff.md`` with the new export. Inputs are plain dicts (``ExportArtifacts``), so
it does not matter whether they came from a directory or from object storage.

What counts as a regression (``Thresholds``; ``None`` switches a check off):

- correctness, judged whatever the two exports are, because both are measured against the same
  yardstick (transformers on the checkpoint's weights): a validation gate failing in the new
  export that did not fail in the old one, and more decisive token mismatches than before;
- performance and structure, judged only when the two exports are *comparable* (same variant,
  dtype, execution provider and task: a text export, an image-text package; latency also needs
  both benchmarks run on the same EP): decode ms/token up by more than ``latency_pct`` at any
  context measured by both, node count up by more than ``node_count_pct``, weight bytes up by more
  than ``size_pct`` (same variant and dtype, the weights should not grow: a growth means e.g. a
  tied table stored twice), and any change of the graph's inputs/outputs (a runtime driving the
  old contract breaks). Across variants these numbers differ by design, so they are shown but not
  judged, and the summary says so.

Prefill throughput, parity error figures and kernel choices are reported, never judged: the
validation gates own the error bounds, and a kernel change that matters shows up as latency.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from exporter.errors import ExportError

from exporter.contract import BENCH_FILE, DATA_FILE, DIFF_JSON, DIFF_MD, MANIFEST_FILE, MODEL_FILE, MODEL_FILES  # noqa: E402
from exporter.contract import REPORT_JSON as REPORT_FILE  # noqa: E402


@dataclasses.dataclass
class Thresholds:
    """When a change is a regression. Percentages are increases of new over old; None = not judged."""

    latency_pct: float | None = 10.0  # decode ms/token (median) at any context measured by both
    node_count_pct: float | None = 10.0
    size_pct: float | None = 10.0  # weight_bytes
    new_token_mismatch: bool = True  # more decisive greedy mismatches than the old export
    parity_gate_newly_failing: bool = True  # a validation gate fails that passed (or was not run) before
    io_change: bool = True  # graph inputs/outputs changed although variant, dtype and ep match

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExportArtifacts:
    """What a diff reads from one export: its manifest and, when present, the reports."""

    manifest: dict
    parity_report: dict | None = None
    benchmark: dict | None = None
    kernels: dict | None = None  # {phase: {op: kernel}} (exporter.runtime.kernel_log)
    label: str = ""

    def __post_init__(self) -> None:
        if self.kernels is None and self.benchmark:
            self.kernels = self.benchmark.get("kernels")
        self.kernels = _kernel_map(self.kernels)
        if not self.label:
            self.label = str(self.manifest.get("export_id") or "export")

    @classmethod
    def from_files(cls, files: Mapping[str, bytes | str | None], label: str = "") -> ExportArtifacts:
        """From file name -> content (bytes or text; None or missing = absent), e.g. object storage."""

        def load(name: str, required: bool = False) -> dict | None:
            raw = files.get(name)
            if raw is None:
                if required:
                    raise ExportError(f"{label or 'export'} has no {name}: pass an export directory")
                return None
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise ExportError(f"{label or 'export'}: {name} is not valid JSON ({err})") from None
            if not isinstance(data, dict):
                raise ExportError(f"{label or 'export'}: {name} is not a JSON object")
            return data

        return cls(load(MANIFEST_FILE, required=True), load(REPORT_FILE), load(BENCH_FILE), label=label)

    @classmethod
    def from_dir(cls, path: Path | str, label: str = "") -> ExportArtifacts:
        path = Path(path)
        if not (path / MANIFEST_FILE).is_file():
            what = "does not exist" if not path.exists() else f"has no {MANIFEST_FILE}"
            raise ExportError(f"{path} {what}: pass an export directory")
        files = {name: (path / name).read_bytes() for name in (MANIFEST_FILE, REPORT_FILE, BENCH_FILE) if (path / name).is_file()}
        return cls.from_files(files, label=label or str(path))


@dataclasses.dataclass
class ExportDiff:
    old: dict  # identity: label, export_id, variant, dtype, ep, onnxruntime, created_at, status, checkpoint
    new: dict
    comparable: bool  # same variant, dtype, ep and task: performance/structure changes are judged
    not_comparable: list[str]  # why not (empty when comparable)
    op_census: dict[str, dict]  # op -> {old, new, delta}; changed ops only
    node_count: dict  # {old, new, delta, pct, flagged}
    io: dict  # {"inputs"|"outputs": {added: [..], removed: [..], changed: [{name, old, new}]}}
    sizes: dict  # {files: {name: {old, new, delta, pct}}, total, model_files, weight_bytes (+ flagged)}
    parity: dict  # {old: figures | None, new: figures | None, flagged: {failed_gates, mismatches}}
    decode: dict  # {contexts: [{ctx, old_ms, new_ms, delta_ms, pct, old_p90, new_p90, flagged}], only_old, only_new, bench_ep, judged}
    prefill_tokens_per_s: list[dict]  # [{length, old, new, pct}]
    kernels: dict  # {compared: both sides known, changes: [{phase, op, old, new}]}
    regressions: list[str]
    notes: list[str]
    thresholds: Thresholds

    @property
    def regression(self) -> bool:
        return bool(self.regressions)

    def summary(self) -> str:
        if self.regressions:
            return "REGRESSION: " + "; ".join(self.regressions)
        return "no regression"

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["thresholds"] = self.thresholds.to_dict()
        data = {"schema": 1, "regression": self.regression, "summary": self.summary(), **data}
        return json.loads(json.dumps(data, default=str))  # plain JSON types only

    def to_markdown(self) -> str:
        return render_markdown(self)


# --- building the diff ----------------------------------------------------------------------------


def _kernel_map(kernels) -> dict | None:
    """{phase: {op: kernel}}; also accepts a kernel_log.probe() result ({"kernels": ..., "lines": ...})."""
    if not isinstance(kernels, dict):
        return None
    if isinstance(kernels.get("kernels"), dict):
        kernels = kernels["kernels"]
    return {str(p): dict(ops) for p, ops in kernels.items() if isinstance(ops, dict)}


def _pct(old, new) -> float | None:
    if not isinstance(old, (int, float)) or not isinstance(new, (int, float)) or old == 0:
        return None
    return (new - old) / old * 100.0


def _change(old, new) -> dict:
    delta = new - old if isinstance(old, (int, float)) and isinstance(new, (int, float)) else None
    return {"old": old, "new": new, "delta": delta, "pct": _pct(old, new)}


def identity(art: ExportArtifacts) -> dict:
    m = art.manifest
    request = m.get("request") or {}
    source = m.get("source") or {}
    checkpoint = source.get("repo_id") or source.get("path") or request.get("model")
    return {
        "label": art.label,
        "export_id": m.get("export_id"),
        "variant": m.get("variant"),
        "dtype": request.get("dtype"),
        "ep": request.get("ep"),
        "onnxruntime": (m.get("versions") or {}).get("onnxruntime"),
        "exporter": (m.get("versions") or {}).get("exporter"),
        "created_at": m.get("created_at"),
        "status": m.get("status"),
        "checkpoint": checkpoint,
        "revision": source.get("revision"),
    }


def _io_changes(old: list[dict], new: list[dict]) -> dict:
    a = {v["name"]: v for v in old or []}
    b = {v["name"]: v for v in new or []}
    changed = []
    for name in a.keys() & b.keys():
        was = {"dtype": a[name].get("dtype"), "shape": a[name].get("shape")}
        now = {"dtype": b[name].get("dtype"), "shape": b[name].get("shape")}
        if was != now:
            changed.append({"name": name, "old": was, "new": now})
    order = list(b)  # new graph order

    def entry(v: dict) -> dict:
        return {"name": v["name"], "dtype": v.get("dtype"), "shape": v.get("shape")}

    return {
        "added": [entry(v) for n, v in b.items() if n not in a],
        "removed": [entry(v) for n, v in a.items() if n not in b],
        "changed": sorted(changed, key=lambda c: order.index(c["name"])),
    }


def parity_figures(art: ExportArtifacts) -> dict | None:
    """The parity report's headline numbers (counts, not step lists); falls back to the manifest."""
    report = art.parity_report
    if report is None:
        validation = art.manifest.get("validation")
        if not validation:
            return None
        return {"status": validation.get("status"), "failed_gates": sorted(validation.get("failed_gates") or []),
                "prefill_max_abs_error": None, "logit_range": None, "steps": None, "mismatches": None,
                "tie_mismatches": None, "near_ties": None, "token_matches": None}
    parity = report.get("parity") or {}
    steps = parity.get("steps")
    counts = {k: len(parity[k]) if isinstance(parity.get(k), list) else parity.get(k)
              for k in ("mismatches", "tie_mismatches", "near_ties")}
    # (steps a router near tie explains differ too: routing.py; a report from before it has none)
    explained = len(parity.get("routing_tie_mismatches") or ())
    matches = (steps - counts["mismatches"] - counts["tie_mismatches"] - explained
               if None not in (steps, counts["mismatches"], counts["tie_mismatches"]) else None)
    return {
        "status": report.get("status"),
        "failed_gates": sorted(report.get("failed_gates") or []),
        "prefill_max_abs_error": parity.get("prefill_max_abs_error"),
        "logit_range": parity.get("logit_range"),
        "steps": steps,
        **counts,
        "token_matches": matches,
    }


def _decode_rows(bench: dict | None) -> dict[int, dict]:
    """Batch-1 decode rows by context (the figures every benchmark has)."""
    return {int(r["ctx"]): r for r in (bench or {}).get("decode") or [] if "ctx" in r and r.get("batch", 1) == 1}


def _kernel_changes(old: dict | None, new: dict | None) -> list[dict]:
    if old is None or new is None:
        return []
    changes = []
    for phase in sorted(old.keys() | new.keys()):
        a, b = old.get(phase, {}), new.get(phase, {})
        for op in sorted(a.keys() | b.keys()):
            if a.get(op) != b.get(op):
                changes.append({"phase": phase, "op": op, "old": a.get(op), "new": b.get(op)})
    return changes


def _farm_names(manifest: Mapping) -> dict:
    """A manifest's files under the farm layout's names: an hf-layout export's graph and weights
    (``onnx/model*.onnx``, ``*_data``) are its farm export's, so a re-export diffs file for file."""
    files = dict(manifest.get("files") or {})
    layout = manifest.get("layout") or {}
    for farm, laid in ((MODEL_FILE, layout.get("model_file")), (DATA_FILE, layout.get("data_file"))):
        if laid in files:
            files[farm] = files.pop(laid)
    return files


def diff_exports(old: ExportArtifacts, new: ExportArtifacts, thresholds: Thresholds | None = None) -> ExportDiff:
    """Compare ``new`` against ``old`` (the baseline); ``regressions`` says what got worse and by how much."""
    t = thresholds or Thresholds()
    mo, mn = old.manifest, new.manifest
    ido, idn = identity(old), identity(new)
    regressions: list[str] = []
    notes: list[str] = []

    not_comparable = [f"{k} differs ({ido[k]} -> {idn[k]})" for k in ("variant", "dtype", "ep") if ido[k] != idn[k]]
    # an image-text checkpoint once exported as its language model alone (a bf16 Qwen3.5 before stop 57, its manifest's
    # language_model_only) and now as the image-text package: other graphs, not a regression of the same one
    tasks = [m.get("task") or ("its language model alone" if m.get("language_model_only") else "text generation")
             for m in (mo, mn)]
    if tasks[0] != tasks[1]:
        not_comparable.append(f"task differs ({tasks[0]} -> {tasks[1]})")
    comparable = not not_comparable
    if not comparable:
        notes.append("not comparable for regression: " + ", ".join(not_comparable)
                     + "; latency, node count, size and I/O changes are shown, not judged")
    if (ido["checkpoint"], ido["revision"]) != (idn["checkpoint"], idn["revision"]):
        notes.append(f"checkpoint differs ({ido['checkpoint']}@{ido['revision']} -> {idn['checkpoint']}@{idn['revision']})")
    if ido["onnxruntime"] != idn["onnxruntime"]:
        notes.append(f"onnxruntime differs ({ido['onnxruntime']} -> {idn['onnxruntime']})")

    # graph
    co, cn = mo.get("op_census") or {}, mn.get("op_census") or {}
    census = {op: {"old": co.get(op, 0), "new": cn.get(op, 0), "delta": cn.get(op, 0) - co.get(op, 0)}
              for op in sorted(co.keys() | cn.keys()) if co.get(op, 0) != cn.get(op, 0)}
    nodes = _change(mo.get("node_count"), mn.get("node_count"))
    nodes["flagged"] = bool(comparable and t.node_count_pct is not None and nodes["pct"] is not None
                            and nodes["pct"] > t.node_count_pct)
    if nodes["flagged"]:
        regressions.append(f"node count {nodes['pct']:+.1f}% ({nodes['old']} -> {nodes['new']})")
    go, gn = mo.get("graph") or {}, mn.get("graph") or {}
    io = {side: _io_changes(go.get(side), gn.get(side)) for side in ("inputs", "outputs")}
    io_count = sum(len(v) for side in io.values() for v in side.values())
    if comparable and t.io_change and io_count:
        regressions.append(f"graph I/O changed within {idn['variant']}: {_io_summary(io)}")

    # sizes
    fo, fn = _farm_names(mo), _farm_names(mn)
    files = {name: _change((fo.get(name) or {}).get("size"), (fn.get(name) or {}).get("size"))
             for name in sorted(fo.keys() | fn.keys())}
    sizes = {
        "files": files,
        "total": _change(sum(e.get("size", 0) for e in fo.values()), sum(e.get("size", 0) for e in fn.values())),
        "model_files": _change(sum((fo.get(n) or {}).get("size", 0) for n in MODEL_FILES),
                               sum((fn.get(n) or {}).get("size", 0) for n in MODEL_FILES)),
        "weight_bytes": _change(mo.get("weight_bytes"), mn.get("weight_bytes")),
    }
    wb = sizes["weight_bytes"]
    wb["flagged"] = bool(comparable and t.size_pct is not None and wb["pct"] is not None and wb["pct"] > t.size_pct)
    if wb["flagged"]:
        regressions.append(f"weight bytes {wb['pct']:+.1f}% ({wb['old']:,} -> {wb['new']:,})")

    # parity
    po, pn = parity_figures(old), parity_figures(new)
    parity = {"old": po, "new": pn, "flagged": {"failed_gates": False, "mismatches": False}}
    if pn is not None:
        failed_before = set((po or {}).get("failed_gates") or [])
        newly = [g for g in pn["failed_gates"] if g not in failed_before]
        if t.parity_gate_newly_failing and newly:
            parity["flagged"]["failed_gates"] = True
            regressions.append("parity gate newly failing: " + ", ".join(newly)
                               + ("" if po is not None else " (old export not validated)"))
        was, now = (po or {}).get("mismatches"), pn.get("mismatches")
        if t.new_token_mismatch and now is not None and now > (was or 0):
            parity["flagged"]["mismatches"] = True
            regressions.append(f"new token mismatches: {'n/a' if was is None else was} -> {now}")
    elif po is not None:
        notes.append("the new export has no parity report (not validated)")

    # latency
    bo, bn = old.benchmark, new.benchmark
    ro, rn = _decode_rows(bo), _decode_rows(bn)
    bench_ep = ((bo or {}).get("ep"), (bn or {}).get("ep"))
    latency_judged = comparable and bench_ep[0] == bench_ep[1]
    if bo and bn and comparable and not latency_judged:
        notes.append(f"benchmarks ran on different EPs ({bench_ep[0]} -> {bench_ep[1]}): latency not judged")
    if bo and bn and (bo.get("settings") or {}).get("cuda_graph") != (bn.get("settings") or {}).get("cuda_graph"):
        notes.append("benchmarks differ in CUDA graph use "
                     f"({(bo.get('settings') or {}).get('cuda_graph')} -> {(bn.get('settings') or {}).get('cuda_graph')})")
    rows = []
    for ctx in sorted(ro.keys() & rn.keys()):
        a, b = ro[ctx], rn[ctx]
        row = {"ctx": ctx, "old_ms": a.get("decode_ms_median"), "new_ms": b.get("decode_ms_median"),
               "delta_ms": None, "pct": _pct(a.get("decode_ms_median"), b.get("decode_ms_median")),
               "old_p90": a.get("decode_ms_p90"), "new_p90": b.get("decode_ms_p90"), "flagged": False}
        if row["pct"] is not None:
            row["delta_ms"] = row["new_ms"] - row["old_ms"]
        if latency_judged and t.latency_pct is not None and row["pct"] is not None and row["pct"] > t.latency_pct:
            row["flagged"] = True
            regressions.append(f"decode at ctx {ctx} {row['pct']:+.1f}% ({row['old_ms']:#.3g} -> {row['new_ms']:#.3g} ms)")
        rows.append(row)
    decode = {"contexts": rows, "only_old": sorted(ro.keys() - rn.keys()), "only_new": sorted(rn.keys() - ro.keys()),
              "bench_ep": {"old": bench_ep[0], "new": bench_ep[1]}, "judged": latency_judged and bool(rows)}
    if bo is None or bn is None:
        missing = [side for side, b in (("old", bo), ("new", bn)) if b is None]
        notes.append(f"no benchmark for the {' and '.join(missing)} export: latency not compared")

    pfo = {int(k): v for k, v in ((bo or {}).get("prefill_tokens_per_s") or {}).items()}
    pfn = {int(k): v for k, v in ((bn or {}).get("prefill_tokens_per_s") or {}).items()}
    prefill = [{"length": n, "old": pfo.get(n), "new": pfn.get(n), "pct": _pct(pfo.get(n), pfn.get(n))}
               for n in sorted(pfo.keys() | pfn.keys())]

    kernels = {"compared": old.kernels is not None and new.kernels is not None,
               "changes": _kernel_changes(old.kernels, new.kernels)}
    if (old.kernels is None) != (new.kernels is None):
        notes.append("kernel choices known for one export only: not compared")

    return ExportDiff(ido, idn, comparable, not_comparable, census, nodes, io, sizes, parity,
                      decode, prefill, kernels, regressions, notes, t)


def _io_summary(io: dict) -> str:
    parts = []
    for side in ("inputs", "outputs"):
        d = io[side]
        kind = side[:-1]
        parts += [f"+{kind} {v['name']}" for v in d["added"]] + [f"-{kind} {v['name']}" for v in d["removed"]]
        parts += [f"~{kind} {c['name']}" for c in d["changed"]]
    return ", ".join(parts[:6]) + (f" (+{len(parts) - 6} more)" if len(parts) > 6 else "")


# --- Markdown -------------------------------------------------------------------------------------


def _num(value, fmt: str = "{:,}") -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and fmt == "{:,}":
        return f"{value:.4g}"
    return fmt.format(value)


def _signed(delta, pct=None, fmt: str = "{:+,}") -> str:
    if delta is None:
        return "–"
    text = fmt.format(delta)
    return text + (f" ({pct:+.1f}%)" if pct is not None else "")


def _bytes(n) -> str:
    if n is None:
        return "–"
    size = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            text = f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
            return ("-" if n < 0 else "") + text
        size /= 1024


def _signed_bytes(c: dict) -> str:
    if c["old"] is None and c["new"] is not None:
        return "added"
    if c["new"] is None and c["old"] is not None:
        return "removed"
    if c["delta"] is None:
        return "–"
    sign = "+" if c["delta"] >= 0 else ""
    return sign + _bytes(c["delta"]) + (f" ({c['pct']:+.1f}%)" if c["pct"] is not None else "")


def _io_cell(v: dict | None) -> str:
    if v is None:
        return "–"
    shape = "?" if v.get("shape") is None else "[" + ", ".join(str(d) for d in v["shape"]) + "]"
    return f"{v.get('dtype')} {shape}"


def _flag(text: str, flagged: bool) -> str:
    return f"**{text}**" if flagged else text


def render_markdown(d: ExportDiff) -> str:
    o, n = d.old, d.new
    verdict = "REGRESSION" if d.regression else "no regression"
    if not d.comparable:
        differs = ", ".join(k for k in ("variant", "dtype", "ep") if o[k] != n[k])
        verdict += f" (different {differs}: correctness judged, performance shown only)"
    lines = [f"# Export diff: {verdict}", ""]
    if d.regressions:
        lines += [f"- {r}" for r in d.regressions] + [""]
    lines.append(f"old `{o['label']}` ({o['variant']}, {o['dtype']}, {o['ep']}) -> "
                 f"new `{n['label']}` ({n['variant']}, {n['dtype']}, {n['ep']})")
    lines.append("")
    for note in d.notes:
        lines.append(f"> {note}")
    if d.notes:
        lines.append("")

    lines += ["## Identity", "", "| | old | new |", "| --- | --- | --- |"]
    for key in ("export_id", "variant", "dtype", "ep", "onnxruntime", "exporter", "created_at", "status", "checkpoint", "revision"):
        a, b = o.get(key), n.get(key)
        lines.append(f"| {key} | {_num(a, '{}')} | {_flag(_num(b, '{}'), a != b)} |")

    nodes = d.node_count
    node_delta = _flag(_signed(nodes["delta"], nodes["pct"]), nodes["flagged"])
    lines += ["", "## Graph", "", "| | old | new | delta |", "| --- | --- | --- | --- |",
              f"| nodes | {_num(nodes['old'])} | {_num(nodes['new'])} | {node_delta} |"]
    for op, c in d.op_census.items():
        lines.append(f"| {op} | {c['old']} | {c['new']} | {c['delta']:+d} |")
    if not d.op_census:
        lines += ["", "Op census unchanged."]

    io_rows = []
    for side in ("inputs", "outputs"):
        kind = side[:-1]
        io_rows += [f"| {kind} added | `{v['name']}` | – | {_io_cell(v)} |" for v in d.io[side]["added"]]
        io_rows += [f"| {kind} removed | `{v['name']}` | {_io_cell(v)} | – |" for v in d.io[side]["removed"]]
        io_rows += [f"| {kind} changed | `{c['name']}` | {_io_cell(c['old'])} | {_io_cell(c['new'])} |"
                    for c in d.io[side]["changed"]]
    if io_rows:
        lines += ["", "| I/O change | name | old | new |", "| --- | --- | --- | --- |"] + io_rows
    else:
        lines += ["", "Graph inputs and outputs unchanged."]

    s = d.sizes
    lines += ["", "## Size", "", "| | old | new | delta |", "| --- | --- | --- | --- |"]
    for name, c in s["files"].items():
        if name in MODEL_FILES or c["delta"] != 0:
            lines.append(f"| {name} | {_bytes(c['old'])} | {_bytes(c['new'])} | {_signed_bytes(c)} |")
    lines.append(f"| all files | {_bytes(s['total']['old'])} | {_bytes(s['total']['new'])} | {_signed_bytes(s['total'])} |")
    wb = s["weight_bytes"]
    lines.append(f"| weight bytes | {_bytes(wb['old'])} | {_bytes(wb['new'])} | "
                 f"{_flag(_signed_bytes(wb), wb['flagged'])} |")

    po, pn = d.parity["old"], d.parity["new"]
    lines += ["", "## Parity", ""]
    if po is None and pn is None:
        lines.append("Neither export was validated.")
    else:
        po, pn = po or {}, pn or {}
        newly, more = d.parity["flagged"]["failed_gates"], d.parity["flagged"]["mismatches"]

        def tokens(p):
            return "–" if p.get("token_matches") is None else f"{p['token_matches']}/{p['steps']}"

        def gates(p):
            return "–" if "failed_gates" not in p else (", ".join(p["failed_gates"]) or "none")

        lines += ["| | old | new |", "| --- | --- | --- |",
                  f"| status | {po.get('status', 'not validated')} | {_flag(str(pn.get('status', 'not validated')), newly)} |",
                  f"| failed gates | {gates(po)} | {_flag(gates(pn), newly)} |",
                  f"| prefill max abs error | {_num(po.get('prefill_max_abs_error'), '{:.3g}')} | "  # noqa: ISC004
                  f"{_num(pn.get('prefill_max_abs_error'), '{:.3g}')} |",
                  f"| logit range | {_num(po.get('logit_range'), '{:.3g}')} | {_num(pn.get('logit_range'), '{:.3g}')} |",
                  f"| tokens equal | {tokens(po)} | {tokens(pn)} |",
                  f"| token mismatches | {_num(po.get('mismatches'))} | {_flag(_num(pn.get('mismatches')), more)} |",
                  f"| near ties (flipped) | {_ties(po)} | {_ties(pn)} |"]

    dec = d.decode
    lines += ["", "## Decode latency (median ms/token)", ""]
    if dec["contexts"]:
        lines += ["| ctx | old | new | delta | p90 old | p90 new |", "| --- | --- | --- | --- | --- | --- |"]
        for r in dec["contexts"]:
            delta = _signed(r["delta_ms"], r["pct"], "{:+.3f}")
            lines.append(f"| {r['ctx']} | {_num(r['old_ms'], '{:.3f}')} | {_num(r['new_ms'], '{:.3f}')} | "
                         f"{_flag(delta, r['flagged'])} | {_num(r['old_p90'], '{:.3f}')} | {_num(r['new_p90'], '{:.3f}')} |")
        if not dec["judged"]:
            lines += ["", "Shown, not judged (see above)."]
    else:
        lines.append("No context measured by both exports.")
    if dec["only_old"] or dec["only_new"]:
        lines += ["", f"Contexts only in old: {dec['only_old'] or 'none'}; only in new: {dec['only_new'] or 'none'}."]
    if d.prefill_tokens_per_s:
        lines += ["", "| prefill tokens | old tokens/s | new tokens/s | delta |", "| --- | --- | --- | --- |"]
        for p in d.prefill_tokens_per_s:
            pct = "–" if p["pct"] is None else f"{p['pct']:+.1f}%"
            lines.append(f"| {p['length']} | {_num(p['old'], '{:,.0f}')} | {_num(p['new'], '{:,.0f}')} | {pct} |")

    lines += ["", "## Kernels", ""]
    if d.kernels["changes"]:
        lines += ["| phase | op | old | new |", "| --- | --- | --- | --- |"]
        lines += [f"| {k['phase']} | {k['op']} | {k['old'] or '–'} | {k['new'] or '–'} |" for k in d.kernels["changes"]]
    else:
        lines.append("Kernel choices unchanged." if d.kernels["compared"] else "Kernel choices not recorded for both exports.")
    return "\n".join(lines) + "\n"


def _ties(p: dict) -> str:
    if p.get("near_ties") is None:
        return "–"
    return f"{p['near_ties']} ({p.get('tie_mismatches') or 0})"


def write_diff(diff: ExportDiff, out_dir: Path | str) -> list[Path]:
    """Write diff.json and diff.md into ``out_dir`` (created if missing); returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / DIFF_JSON, out_dir / DIFF_MD]
    paths[0].write_text(json.dumps(diff.to_dict(), indent=2) + "\n")
    paths[1].write_text(diff.to_markdown())
    return paths


__all__ = ["DIFF_JSON", "DIFF_MD", "ExportArtifacts", "ExportDiff", "Thresholds", "diff_exports", "render_markdown", "write_diff"]
