"""``exportfarm``: the command line over the same stage functions the workers call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter.contract import BENCH_FILE, MANIFEST_FILE, MODEL_FILE
from exporter.errors import ExportError, ValidationFailed
from exporter.pipeline import Progress
from exporter.request import BUILDERS


class TerminalProgress(Progress):
    """Stage lines plus tqdm bars for layers built and bytes written (on stderr)."""

    def __init__(self):
        self._bars = {}

    def _bar(self, key: str, total, unit: str, **kw):
        from tqdm import tqdm

        if key not in self._bars:
            self._bars[key] = tqdm(total=total, unit=unit, desc=key, leave=True, file=sys.stderr, **kw)
        return self._bars[key]

    def stage(self, name: str) -> None:
        print(f"[exportfarm] {name}", file=sys.stderr, flush=True)

    def layer(self, index: int, total: int) -> None:
        bar = self._bar("layers built", total, "layer")
        bar.update(index - bar.n)

    def bytes_written(self, count: int, total: int) -> None:
        bar = self._bar("weights written", total, "B", unit_scale=True, unit_divisor=1024)
        bar.update(count - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


def add_base_quant_arguments(p) -> None:
    """The weight-only quantization options that export and quant-plan share."""
    p.add_argument("--quant-block-size", type=int, default=None, help="int4 / int8: MatMulNBits block size (default 32)")
    p.add_argument("--quant-asymmetric", action="store_true", help="int4 / int8: zero points per block")
    p.add_argument("--quant-method", default=None, choices=("rtn", "hqq"),
                   help="int4: rtn (round to nearest, default) or hqq (onnxruntime's half-quadratic quantization, "
                        "float zero points: needs --quant-asymmetric)")
    p.add_argument("--quant-lm-head-bits", type=int, default=None, help="int4: 8 quantizes the LM head to int8")


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="export a Hugging Face checkpoint to ONNX")
    p.add_argument("--model", required=True, help="checkpoint directory, or hub id[@revision]")
    p.add_argument("--dtype", default="fp32",
                   help="fp32 | fp16 | bf16 | int4 | int8 (weight-only MatMulNBits; default fp32)")
    add_base_quant_arguments(p)
    p.add_argument("--quant-int8-layers", default=None,
                   help="int4: comma-separated decoder layers whose projections get 8 bits (mixed precision; "
                        "`exportfarm quant-plan` measures which)")
    p.add_argument("--quant-activations", default=None, choices=("fp16", "bf16"),
                   help="int4 / int8 on cuda: the activation dtype (default: measured on the checkpoint: fp16 "
                        "where its activations fit fp16 with room to spare, else bf16)")
    p.add_argument("--quant-keep", default="",
                   help="int4 / int8: comma-separated roles kept unquantized: lm_head, first_layer, last_layer, embedding")
    p.add_argument("--quant-accuracy-level", type=int, default=None,
                   help="int4 / int8 on cpu: MatMulNBits accuracy level, 0 (fp32 activations, exact to the dequantized "
                        "weights) to 4 (int8 activations, the default there)")
    p.add_argument("--ep", default="cpu", help="cpu | cuda: the execution provider the export targets")
    p.add_argument("--static-cache", action="store_true", help="fixed-size KV cache (attn_static)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length; required with --static-cache")
    p.add_argument("--variant", default=None, help="attn_static | gqa | attn_dynamic (default: chosen from the request)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    p.add_argument("--no-validate", action="store_true", help="skip the validation gates (status: unvalidated)")
    p.add_argument("--validate-ep", default=None, help="cpu | cuda: where to validate (default: --ep)")
    p.add_argument("--layout", default="farm", choices=("farm", "hf"),
                   help="farm: model.onnx + model.onnx.data at the root (onnxruntime-genai reads it; the default); "
                        "hf: a Hugging Face model repository (config.json, onnx/model{,_fp16,_q4,_q4f16,_int8}.onnx) "
                        "for transformers.js and optimum, attn_dynamic only (the default variant there)")
    p.add_argument("--compat", action="store_true",
                   help="write the graph in IR 10 / opset 20 with onnxruntime's contrib ops, for older runtimes "
                        "(transformers.js 3.x on onnxruntime 1.21): attn_dynamic (its default), fp32 / fp16 / int4 / "
                        "int8, dense models; anything else is refused with the reason")
    p.add_argument("--builder", default="auto", choices=BUILDERS,
                   help="auto: exportfarm's hand-built graph where it has the architecture, else traced (the "
                        "default); hand: refuse a model without one; traced: transformers' own exporter "
                        "(transformers.exporters) on the model's code, mapped onto attn_dynamic")
    p.set_defaults(func=_cmd_export)


def add_layout_parser(sub) -> None:
    p = sub.add_parser("layout", help="lay a finished export out for another consumer (hf: transformers.js, optimum)")
    p.add_argument("kind", choices=("hf",), help="hf: a Hugging Face model repository")
    p.add_argument("dir", type=Path, help="the export directory (farm layout)")
    p.add_argument("--out", required=True, type=Path, help="a new directory for the laid-out repository")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the checkpoint directory it was exported from (default: the manifest's source path)")
    p.set_defaults(func=_cmd_layout)


def _cmd_layout(args) -> int:
    from exporter.packaging.hf_layout import check_export, write_hf_layout

    source = check_export(args.dir).get("source") or {}  # refuses what the layout cannot hold, first
    checkpoint = args.checkpoint or (Path(source["path"]) if source.get("path") else None)
    if checkpoint is None or not checkpoint.is_dir():
        raise ExportError(f"the checkpoint this export was made from ({checkpoint or 'not in its manifest'}) is not a "
                          "directory here: pass --checkpoint DIR")
    manifest = write_hf_layout(args.dir, args.out, checkpoint)
    print(f"laid out {args.dir} as a Hugging Face repository in {args.out}:")
    for name, entry in manifest["files"].items():
        print(f"  {name:<28} {entry['size']:>14,d} bytes")
    print(f"  transformers.js: dtype {manifest['layout']['transformers_js_dtype']!r}")
    return 0


def add_validate_parser(sub) -> None:
    p = sub.add_parser("validate", help="run the validation gates on an export directory")
    p.add_argument("dir", type=Path, help="export directory (model.onnx, model.onnx.data, manifest.json)")
    p.add_argument("--reference", default=None, help="checkpoint to compare with (default: the one it was built from)")
    p.add_argument("--ep", default=None, help="cpu | cuda (default: the export's target)")
    p.add_argument("--peer", type=Path, default=None, help="another export of the same checkpoint to compare with")
    p.add_argument("--steps", type=int, default=24, help="greedy decode steps (default 24)")
    p.set_defaults(func=_cmd_validate)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="decode benchmark of an export (IO binding; CUDA graphs on cuda)")
    p.add_argument("dir", type=Path, help="export directory")
    p.add_argument("--ep", default=None, help="cpu | cuda (default: the export's target)")
    p.add_argument("--ctx", default="128,512,2048,4096,8192", help="comma-separated context lengths")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per context (default 64)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="cuda: run every decode step without CUDA graph capture (default: capture where the variant allows)")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    from exporter.packaging.package import add_files_to_manifest
    from exporter.reports.bench_report import write_report
    from exporter.runtime.bench import run_bench
    from exporter.runtime.isolated import run_isolated

    if args.ep not in (None, "cpu", "cuda"):
        raise ExportError(f"unknown execution provider {args.ep!r}: use cpu or cuda")
    try:
        contexts = [int(c) for c in args.ctx.split(",") if c.strip()]
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise ExportError(f"--ctx and --batch take comma-separated integers, got {args.ctx!r} and {args.batch!r}") from None
    if not contexts or min(contexts) < 1 or not batches or min(batches) < 1 or args.steps < 1 or args.warmup < 0:
        raise ExportError("--ctx and --batch need positive integers, --steps at least 1, --warmup at least 0")
    if not (args.dir / MODEL_FILE).is_file():
        raise ExportError(f"{args.dir} has no model.onnx: pass an export directory")
    if args.ep == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ExportError("this onnxruntime has no CUDAExecutionProvider: install onnxruntime-gpu or use --ep cpu")
    # In a process of its own: a crash inside onnxruntime's kernels ends the command with a message
    # naming the step, not with a bare "Segmentation fault".
    result = run_isolated(run_bench, args.dir, args.ep, contexts, args.steps, args.warmup, batches=batches,
                          cuda_graph=False if args.no_cuda_graph else None, what=f"bench of {args.dir}",
                          crash_advice="try --no-cuda-graph, or an export with other activations (int4 / int8: "
                                       "--quant-activations) or another variant")
    png, md = write_report(args.dir / BENCH_FILE)
    if (args.dir / MANIFEST_FILE).is_file():
        add_files_to_manifest(args.dir, [BENCH_FILE, png.name, md.name])
    for c in result.contexts:
        print(f"  ctx {c.ctx:>6} batch {c.batch:>3}: {c.decode_ms_median:8.3f} ms/token (p90 {c.decode_ms_p90:.3f}), prefill {c.prefill_ms:.1f} ms")
    skipped = [c for c in contexts if c not in {r.ctx for r in result.contexts}]
    if skipped:
        print(f"  skipped contexts {skipped}: longer than the export's max_seq_len / context length")
    print(f"report: {args.dir / BENCH_FILE}, {png.name}, {md.name}")
    return 0


def _print_report(report) -> None:
    for g in report.gates:
        mark = {"pass": "ok  ", "fail": "FAIL", "info": "info"}[g.status]
        print(f"  [{mark}] {g.gate:<9} {g.check}: {g.measured}" + (f"  -- {g.message}" if g.status != "pass" and g.message else ""))


def _cmd_validate(args) -> int:
    from exporter.errors import ExportError
    from exporter.validation.validate import validate_export

    if args.ep not in (None, "cpu", "cuda"):
        raise ExportError(f"unknown execution provider {args.ep!r}: use cpu or cuda")
    if args.steps < 1:
        raise ExportError("--steps must be at least 1")
    from exporter.cache import reference_cache_default

    report = validate_export(args.dir, args.reference, args.ep, args.peer, steps=args.steps,
                             reference_cache=reference_cache_default())
    paths = report.write()
    _print_report(report)
    print(f"report: {paths[0]} and {paths[1].name}")
    if not report.passed:
        raise ExportError(f"validation {report.summary()}")
    return 0


def _quant_options(args) -> dict | None:
    options = {}
    if args.quant_block_size is not None:
        options["block_size"] = args.quant_block_size
    if args.quant_activations:
        options["activations"] = args.quant_activations
    if args.quant_method is not None:
        options["method"] = args.quant_method
    if args.quant_asymmetric:
        options["symmetric"] = False
    if args.quant_lm_head_bits is not None:
        options["lm_head_bits"] = args.quant_lm_head_bits
    if args.quant_int8_layers:
        try:
            options["int8_layers"] = [int(i) for i in args.quant_int8_layers.split(",") if i.strip()]
        except ValueError:
            raise ExportError(f"--quant-int8-layers wants comma-separated layer indexes, got {args.quant_int8_layers!r}")
    if args.quant_accuracy_level is not None:
        options["accuracy_level"] = args.quant_accuracy_level
    if args.quant_keep:
        options["keep"] = [k.strip() for k in args.quant_keep.split(",") if k.strip()]
    if options and args.dtype not in ("int4", "int8"):
        raise ExportError(f"--quant-* options apply to --dtype int4 / int8, not {args.dtype}")
    return options if args.dtype in ("int4", "int8") else None


def _cmd_export(args) -> int:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    request = ExportRequest(
        model=args.model,
        dtype=args.dtype,
        ep=args.ep,
        static_cache=args.static_cache,
        max_seq_len=args.max_seq_len,
        variant=args.variant,
        quant=_quant_options(args),
        layout=args.layout,
        compat=args.compat,
        builder=args.builder,
    )
    if args.validate_ep not in (None, "cpu", "cuda"):
        raise ExportError(f"unknown --validate-ep {args.validate_ep!r}: use cpu or cuda")
    from exporter.cache import reference_cache_default, rope_cache_default

    progress = TerminalProgress()
    try:
        result = export_model(
            request, args.out, progress, overwrite=args.overwrite,
            validate=not args.no_validate, validate_ep=args.validate_ep, reference_cache=reference_cache_default(),
            rope_cache=rope_cache_default(),
        )
    except ValidationFailed as failed:
        progress.close()
        _print_report(failed.report)
        raise
    finally:
        progress.close()
    manifest = result.manifest.data
    builder = manifest.get("builder") or {}
    print(f"exported {manifest['variant']} ({manifest['request']['dtype']}, {manifest['request']['ep']}) to {result.out_dir}"
          f", built by {builder.get('name')} {builder.get('version')}")
    for name, entry in manifest["files"].items():
        print(f"  {name:<18} {entry['size']:>14,d} bytes  sha256 {entry['sha256'][:16]}")
    if result.report is not None:
        _print_report(result.report)
    print(f"  status: {manifest['status']}")
    print(f"  {'manifest.json':<18} ops: {sum(manifest['op_census'].values())} nodes, "
          f"{len(manifest['initializers'])} initializers, opsets {manifest['opset_imports']}")
    return 0


def add_quant_plan_parser(sub) -> None:
    p = sub.add_parser(
        "quant-plan", help="int4 mixed precision by measurement: which layers get 8 bits within a size / KL target",
        description="Measure each decoder layer's int4 sensitivity (the quality gate's KL with that layer alone int4, "
        "the rest 8-bit) and give the most sensitive layers 8 bits within --budget-mb and, with --kl-target, no more "
        "than meet it. Prints the quant spec; --out keeps the whole plan as JSON. One export and one quality pass "
        "per layer.")
    p.add_argument("--model", required=True, help="checkpoint directory, or hub id[@revision]")
    p.add_argument("--ep", default="cpu", help="cpu | cuda: the export's target, where the quality is measured")
    p.add_argument("--max-seq-len", type=int, default=None)
    add_base_quant_arguments(p)
    p.add_argument("--budget-mb", type=float, default=None, help="model.onnx.data at most this many MB (1e6 bytes)")
    p.add_argument("--kl-target", type=float, default=None, help="stop adding 8-bit layers once the mean KL is this low")
    p.add_argument("--work", type=Path, default=None, help="where the candidate exports are built (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the plan (every measurement) as JSON here")
    # an int4 export whose other quant options are the defaults (what _quant_options reads)
    p.set_defaults(func=_cmd_quant_plan, dtype="int4", quant_int8_layers=None, quant_activations=None,
                   quant_accuracy_level=None, quant_keep="")


def _cmd_quant_plan(args) -> int:
    import json
    import tempfile

    from exporter.quant_plan import plan_int8_layers
    from exporter.request import ExportRequest

    if args.budget_mb is not None and args.budget_mb <= 0:
        raise ExportError(f"--budget-mb must be positive, got {args.budget_mb}")
    request = ExportRequest(model=args.model, dtype="int4", ep=args.ep, max_seq_len=args.max_seq_len,
                            quant=_quant_options(args))
    with tempfile.TemporaryDirectory(prefix="quant-plan-") as scratch:
        plan = plan_int8_layers(request, args.work or Path(scratch),
                                budget_bytes=int(args.budget_mb * 1e6) if args.budget_mb is not None else None,
                                kl_target=args.kl_target, log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(plan, indent=2) + "\n")
    chosen = plan["chosen"]
    print(f"int8 layers {chosen['int8_layers'] or 'none'}: KL {chosen['kl']} (all int4: {plan['baseline']['kl']}), "
          f"agreement {chosen['agreement']}, {chosen['bytes']:,d} bytes")
    print("quant: " + json.dumps(plan["quant"]))
    return 0


def add_diff_parser(sub) -> None:
    p = sub.add_parser(
        "diff", help="compare two exports: graph, I/O, sizes, parity, decode latency, kernels",
        description="Compare export B against export A (the baseline) and print a Markdown report. "
        "Exit status: 0 no regression, 1 a regression was flagged (a validation gate newly failing, "
        "new token mismatches, or, for exports of the same variant, dtype and ep: decode latency, "
        "node count or weight bytes above the thresholds, or changed graph I/O), 2 bad input.",
    )
    p.add_argument("old", type=Path, help="baseline export directory (A)")
    p.add_argument("new", type=Path, help="export directory to judge (B)")
    p.add_argument("--out", type=Path, default=None, help="also write diff.json and diff.md into this directory")
    p.add_argument("--latency-pct", type=float, default=10.0, help="decode ms/token increase that flags (default 10)")
    p.add_argument("--node-count-pct", type=float, default=10.0, help="node count increase that flags (default 10)")
    p.add_argument("--size-pct", type=float, default=10.0, help="weight bytes increase that flags (default 10)")
    p.set_defaults(func=_cmd_diff)


def _cmd_diff(args) -> int:
    from exporter.reports.diff import ExportArtifacts, Thresholds, diff_exports, write_diff

    for name in ("latency_pct", "node_count_pct", "size_pct"):
        if getattr(args, name) < 0:
            raise ExportError(f"--{name.replace('_', '-')} must be at least 0")
    thresholds = Thresholds(latency_pct=args.latency_pct, node_count_pct=args.node_count_pct, size_pct=args.size_pct)
    diff = diff_exports(ExportArtifacts.from_dir(args.old), ExportArtifacts.from_dir(args.new), thresholds)
    print(diff.to_markdown(), end="")
    if args.out is not None:
        paths = write_diff(diff, args.out)
        print(f"diff: {paths[0]} and {paths[1].name}", file=sys.stderr)
    return 1 if diff.regression else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exportfarm", description="ONNX export farm for Hugging Face LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    add_validate_parser(sub)
    add_bench_parser(sub)
    add_diff_parser(sub)
    add_layout_parser(sub)
    add_quant_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and dispatch; user errors become one line on stderr and exit status 2."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ExportError as err:
        print(f"exportfarm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("exportfarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
