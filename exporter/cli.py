"""``exportfarm``: the command line over the same stage functions the workers call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter.errors import ExportError
from exporter.pipeline import Progress


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


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="export a Hugging Face checkpoint to ONNX")
    p.add_argument("--model", required=True, help="checkpoint directory, or hub id[@revision]")
    p.add_argument("--dtype", default="fp32", help="fp32 | fp16 | bf16 (default fp32)")
    p.add_argument("--ep", default="cpu", help="cpu | cuda: the execution provider the export targets")
    p.add_argument("--static-cache", action="store_true", help="fixed-size KV cache (attn_static)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length; required with --static-cache")
    p.add_argument("--variant", default=None, help="attn_static | gqa | attn_dynamic (default: chosen from the request)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    p.set_defaults(func=_cmd_export)


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
    )
    progress = TerminalProgress()
    try:
        result = export_model(request, args.out, progress, overwrite=args.overwrite)
    finally:
        progress.close()
    manifest = result.manifest.data
    print(f"exported {manifest['variant']} ({manifest['request']['dtype']}, {manifest['request']['ep']}) to {result.out_dir}")
    for name, entry in manifest["files"].items():
        print(f"  {name:<18} {entry['size']:>14,d} bytes  sha256 {entry['sha256'][:16]}")
    print(f"  {'manifest.json':<18} ops: {sum(manifest['op_census'].values())} nodes, "
          f"{len(manifest['initializers'])} initializers, opsets {manifest['opset_imports']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exportfarm", description="ONNX export farm for Hugging Face LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
