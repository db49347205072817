"""Image-text speed at a real geometry (issue 48): image encode, time to first token with an image, and decode
ms/token of our image-text package beside the onnxruntime-genai builder's text decoder of the same checkpoint (the
builder has no vision graph) and mobius's package where it builds, same run.

    python benchmarks/vlm_speed.py --geometry qwen2.5-vl-7b --text-layers 4 --peers genai,mobius --out r.json

The checkpoint: random bf16 weights from the real config (vision tower at full depth, language model cut to
``--text-layers``), built by transformers' model class, with the tiny tokenizer and an image processor of the
geometry's own sizes (the image token ids are the tiny tokenizer's; the vocabulary stays the real one).

How each package is driven, all in onnxruntime-genai (og.Model on the folder, its own genai_config.json, greedy):
- an image prompt: the package's multimodal processor on a PNG of ``--image`` pixels, then Generator.set_inputs and
  the first generate_next_token timed together (vision, embedding and prefill: time to first token), then
  ``--steps`` more tokens (decode ms/token, median);
- a text prompt of ``--ctx`` tokens, the same ids into every package by Generator.append_tokens; prefill and
  decode as above (the packages' first 8 tokens kept: one checkpoint, so they should agree to fp16's rounding);
- image encode alone: an onnxruntime session of the package's vision graph on the device, the processor's tensors
  bound there once (IO binding, output left on the device), median of ``--encode-runs``.
Rounds alternate the packages; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The real configs (Qwen/Qwen2.5-VL-7B-Instruct, google/gemma-3-12b-it), the token ids moved to the tiny
# tokenizer's (exporter/vision/tiny_checkpoint.py: 300 ids, then the image tokens).
GEOMETRIES = {
    "qwen2.5-vl-7b": ("Qwen2_5_VLConfig", dict(
        text_config=dict(model_type="qwen2_5_vl_text", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6,
                         max_position_embeddings=128000, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2),
        tie_word_embeddings=False, vision_start_token_id=300, vision_end_token_id=301, image_token_id=302,
        video_token_id=303)),
    "gemma-3-12b": ("Gemma3Config", dict(
        text_config=dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                         query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131072,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=300, eoi_token_index=301, image_token_index=302)),
}
# Smoke-test sizes of the same two (a 2-layer tower of hidden 64): the script end to end on a CPU.
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512)
GEOMETRIES["qwen2.5-vl-tiny"] = ("Qwen2_5_VLConfig", dict(
    GEOMETRIES["qwen2.5-vl-7b"][1],
    text_config={**GEOMETRIES["qwen2.5-vl-7b"][1]["text_config"], **_TINY_TEXT,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
    vision_config={**GEOMETRIES["qwen2.5-vl-7b"][1]["vision_config"], "depth": 2, "hidden_size": 64,
                   "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64, "fullatt_block_indexes": [1]}))
GEOMETRIES["gemma-3-tiny"] = ("Gemma3Config", dict(
    GEOMETRIES["gemma-3-12b"][1], text_config={**GEOMETRIES["gemma-3-12b"][1]["text_config"], **_TINY_TEXT,
                                              "query_pre_attn_scalar": 16, "sliding_window": 64},
    vision_config={**GEOMETRIES["gemma-3-12b"][1]["vision_config"], "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 2}))
IMAGE_PROMPTS = {"qwen": "describe <|vision_start|><|image_pad|><|vision_end|> the picture",
                 "gemma": "describe <start_of_image> the picture"}
PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
DEVICES = {"cuda": "cuda", "cpu": "cpu"}
WORDS = "the quick brown fox jumps over the lazy dog while onnx runtime decodes every token ".split()


def build_checkpoint(name: str, layers: int, image: int, root: Path) -> Path:
    import torch
    import transformers

    from exporter.vision.tiny_checkpoint import make_tiny_image_text_processor, make_tiny_qwen_processor

    folder = root / f"{name}-L{layers}"
    if (folder / ".complete").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    class_name, kwargs = GEOMETRIES[name]
    kwargs = {**kwargs, "text_config": {**kwargs["text_config"], "num_hidden_layers": layers}}
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    if name.startswith("gemma"):  # the projector's weight is zeros at init: every image would embed alike
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.save_pretrained(folder, max_shard_size="2GB")
    del model
    if name.startswith("gemma"):
        make_tiny_image_text_processor(folder, image, config.mm_tokens_per_image)
    else:
        make_tiny_qwen_processor(folder, config.vision_config, min_pixels=image * image, max_pixels=image * image)
    (folder / ".complete").touch()
    return folder


def export_ours(checkpoint: Path, out: Path, max_seq_len: int, ep: str, dtype: str) -> str:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    request = ExportRequest(model=str(checkpoint), dtype=dtype, ep=ep, variant="gqa", max_seq_len=max_seq_len)
    export_model(request, out, overwrite=True, validate=False)
    return f"exportfarm export --model {checkpoint} --dtype {dtype} --ep {ep} --variant gqa --max-seq-len {max_seq_len}"


# The builder 0.18 reads a Gemma-3 config as transformers 4 wrote it (rope_parameters one dict with a rope_type,
# rope_local_base_freq); transformers 5 gives it rope_parameters per layer type and it stops on KeyError 'rope_type'.
# This shim hands it the transformers 4 attributes (the full-attention layers' rope, the sliding ones' theta)
# and runs the builder's own main unchanged.
BUILDER_SHIM = """
import runpy, sys, transformers
load = transformers.AutoConfig.from_pretrained
def flat(*args, **kwargs):
    config = load(*args, **kwargs)
    for part in (config, getattr(config, "text_config", None)):
        rope = getattr(part, "rope_parameters", None)
        if isinstance(rope, dict) and "full_attention" in rope and "rope_type" not in rope:
            part.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
            part.rope_parameters = dict(rope["full_attention"])
    return config
transformers.AutoConfig.from_pretrained = flat
sys.argv[0] = "builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def export_genai_text(checkpoint: Path, out: Path, ep: str, dtype: str) -> str:
    """The builder's defaults for ``-p dtype -e ep``: for a *ForConditionalGeneration checkpoint, its text decoder
    on input_ids (genai_config model.type qwen2_5_vl_text / gemma3_vl_text); a Gemma-3 config through
    BUILDER_SHIM."""
    args = ["-i", str(checkpoint), "-o", str(out), "-p", dtype, "-e", ep, "-c", str(out.parent / f"{out.name}-cache")]
    gemma = json.loads((checkpoint / "config.json").read_text())["model_type"] == "gemma3"
    cmd = [sys.executable, *(["-c", BUILDER_SHIM] if gemma else ["-m", "onnxruntime_genai.models.builder"]), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(out.parent / f"{out.name}-cache", ignore_errors=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        raise RuntimeError(f"builder exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2500:]}")
    return ("(through vlm_speed.BUILDER_SHIM) " if gemma else "") + "-m onnxruntime_genai.models.builder " + " ".join(args)


def export_mobius(checkpoint: Path, out: Path, ep: str, dtype: str) -> str:
    """mobius (PyPI mobius-onnx, CLI ``mobius build``) as it builds a genai package for CUDA; ``MOBIUS_PATH`` puts
    its own onnxscript (it needs >= 0.7.1; transformers' exporter, which we use, is tested with 0.7.0) first."""
    cmd = [sys.executable, "-m", "mobius", "build", "--config", str(checkpoint), "--dtype", {"fp16": "f16", "fp32": "f32"}[dtype], "--ep", ep,
           "--runtime", "ort-genai", str(out)]
    env = dict(os.environ)
    if os.environ.get("MOBIUS_PATH"):
        env["PYTHONPATH"] = os.environ["MOBIUS_PATH"] + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        raise RuntimeError(f"mobius exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2500:]}")
    for f in checkpoint.iterdir():  # its processor and tokenizer come from the checkpoint
        if f.suffix == ".json" and ("token" in f.name or "processor" in f.name) and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return " ".join(cmd[1:])


def make_image(path: Path, size: int) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def text_prompt(tokenizer_dir: Path, ctx: int) -> list[int]:
    """The ids of a prompt of about ``ctx`` tokens (words repeated), special tokens added as the tokenizer does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = ""
    while len(tokenizer(text, add_special_tokens=True)["input_ids"]) < ctx:
        text += " ".join(WORDS) + " "
    return tokenizer(text, add_special_tokens=True)["input_ids"]


class Package:
    """One genai package, loaded once."""

    def __init__(self, label: str, folder: Path, multimodal: bool, max_length: int):
        import onnxruntime_genai as og

        self.og, self.label, self.folder, self.multimodal, self.max_length = og, label, folder, multimodal, max_length
        self.model = og.Model(str(folder))
        self.processor = self.model.create_multimodal_processor() if multimodal else None
        self.config = json.loads((folder / "genai_config.json").read_text())

    def _generate(self, feed, prompt_len: int, steps: int, warmup: int = 2, after=None, after_steps: int = 0) -> dict:
        """``feed``, the first token timed with it, then ``steps`` decode steps (median ms over those past
        ``warmup``); ``after(generator)``: run on the same generator after them, its ``after_steps`` steps counted
        into the lengths, its result kept as "after"."""
        og = self.og
        params = og.GeneratorParams(self.model)
        # One max_length for every package (the export's context): the builder's Gemma-3 decoder refuses a KV
        # capacity below its sliding window; min_length keeps an end-of-sequence token from stopping the loop.
        total = prompt_len + steps + 1 + after_steps
        params.set_search_options(do_sample=False, max_length=max(total, self.max_length), min_length=total)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        feed(generator)
        generator.generate_next_token()
        first = time.perf_counter() - start
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - start)
        tokens = [int(t) for t in generator.get_sequence(0)][prompt_len: prompt_len + 8]
        out = {"first_token_ms": first * 1000, "decode_ms": float(np.median(times[warmup:]) * 1000),
               "prompt_tokens": prompt_len, "tokens": tokens}
        if after is not None:
            out["after"] = after(generator)
        del generator
        return out

    def text(self, ids: list[int], steps: int, **more) -> dict:
        """A text prompt by append_tokens (``more``: _generate's warmup / after / after_steps)."""
        return self._generate(lambda g: g.append_tokens(np.asarray([ids], dtype=np.int32)), len(ids), steps, **more)

    def image(self, prompt: str, image: Path, steps: int) -> dict:
        start = time.perf_counter()
        inputs = self.processor(prompt, images=self.og.Images.open(str(image)))
        processor_ms = (time.perf_counter() - start) * 1000
        n = int(inputs["input_ids"].as_numpy().shape[-1])
        result = self._generate(lambda g: g.set_inputs(inputs), n, steps)
        return {**result, "processor_ms": processor_ms}

    def vision_feeds(self, prompt: str, image: Path) -> dict:
        inputs = self.processor(prompt, images=self.og.Images.open(str(image)))
        return {name: inputs[name].as_numpy() for name in ("pixel_values", "image_grid_thw", "image_sizes")
                if name in inputs}


def encode_ms(vision_file: Path, feeds: dict, runs: int, ep: str) -> dict:
    """The vision graph alone on ``ep``: its inputs bound on the device once, its outputs left there."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(vision_file), options, providers=[PROVIDERS[ep]])
    types = {i.name: i.type for i in session.get_inputs()}
    names = set(types)
    binding = session.io_binding()
    for name, value in feeds.items():
        if name in names:
            # in the graph's own element type, as genai hands a package's vision graph its processor's pixels
            # (mobius's fp16 vision graph takes fp16 pixel_values; ours casts fp32 pixels inside)
            if types[name] == "tensor(float16)":
                value = value.astype(np.float16)
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, DEVICES[ep], 0))
    missing = names - set(feeds)
    if missing:
        raise RuntimeError(f"{vision_file.name} takes {sorted(missing)}, which the processor did not make")
    for output in session.get_outputs():
        binding.bind_output(output.name, DEVICES[ep])
    times = []
    for _ in range(runs + 2):
        binding.synchronize_inputs()
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - start)
    shape = binding.get_outputs()[0].shape()
    del session
    return {"ms": float(np.median(times[2:]) * 1000), "runs": runs, "features_shape": list(shape),
            "inputs": {k: list(v.shape) for k, v in feeds.items()}}


GENAI_TYPES = {"qwen": "qwen2_5_vl", "gemma": "gemma3"}  # genai 0.18's image-text model types


def genai_typed_copy(folder: Path, model_type: str) -> Path:
    """A copy of a genai package (files hard-linked) whose genai_config.json names ``model_type``."""
    copy = folder.parent / f"{folder.name}-as-{model_type}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy, copy_function=os.link, ignore=shutil.ignore_patterns("genai_config.json"))
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["type"] = model_type
    (copy / "genai_config.json").write_text(json.dumps(config, indent=2))
    return copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--image", type=int, default=0, help="image side in pixels (default: qwen 448, gemma 896)")
    parser.add_argument("--ctx", type=int, default=1024, help="text prompt tokens")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--encode-runs", type=int, default=20)
    parser.add_argument("--peers", default="genai,mobius")
    parser.add_argument("--ep", default="cuda", choices=sorted(PROVIDERS), help="cpu: a smoke test (fp32)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlm-speed"))
    parser.add_argument("--export-only", action="store_true", help="build and export, measure nothing")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    image_side = args.image or (448 if args.geometry.startswith("qwen") else 896)

    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "vlm_speed", "command": "python benchmarks/vlm_speed.py " + " ".join(sys.argv[1:]),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "geometry": args.geometry,
              "text_layers": args.text_layers, "image_pixels": [image_side, image_side], "machine": platform.node(),
              "exports": {}, "how": __doc__.split("How each package is driven", 1)[1].strip()}
    start = time.perf_counter()
    checkpoint = build_checkpoint(args.geometry, args.text_layers, image_side, args.work / "ckpt")
    result["checkpoint_s"] = round(time.perf_counter() - start, 1)
    print(f"checkpoint {checkpoint} in {result['checkpoint_s']} s", flush=True)

    dtype = "fp16" if args.ep == "cuda" else "fp32"
    result["ep"], result["dtype"] = args.ep, dtype
    makers = {"ours": (lambda out: export_ours(checkpoint, out, args.ctx + 512, args.ep, dtype), True)}
    peers = [p for p in args.peers.split(",") if p]
    if "genai" in peers:
        makers["genai builder (text decoder)"] = (lambda out: export_genai_text(checkpoint, out, args.ep, dtype), False)
    if "mobius" in peers:
        makers["mobius"] = (lambda out: export_mobius(checkpoint, out, args.ep, dtype), True)
    folders = {}
    for label, (make, multimodal) in makers.items():
        out = args.work / f"{args.geometry}-L{args.text_layers}-{label.split()[0]}"
        done = out / ".exported"
        entry = {}
        if done.is_file():
            entry = json.loads(done.read_text())
        else:
            start = time.perf_counter()
            try:
                entry = {"command": make(out), "export_s": round(time.perf_counter() - start, 1)}
            except Exception as err:  # the finding is which builder cannot, and why
                entry = {"error": f"{type(err).__name__}: {str(err)[-1500:]}"}
            if "error" not in entry:
                entry["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
                done.write_text(json.dumps(entry))
        result["exports"][label] = entry
        print(label, json.dumps(entry)[:600], flush=True)
        if "error" not in entry:
            folders[label] = (out, multimodal)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.export_only:
        return 0

    import onnxruntime_genai as og

    prompt_family = "qwen" if args.geometry.startswith("qwen") else "gemma"
    prompt = IMAGE_PROMPTS[prompt_family]
    image = make_image(args.work / f"image-{image_side}.png", image_side)
    ids = text_prompt(checkpoint, args.ctx)
    packages = {}
    for label, (folder, multimodal) in folders.items():
        try:
            packages[label] = Package(label, folder, multimodal, args.ctx + 512)
        except Exception as err:
            result["exports"][label]["load_error"] = f"{type(err).__name__}: {str(err)[:800]}"
            if label == "mobius":  # its best chance: the model.type genai 0.18 runs this family's images under
                try:
                    packages[label] = Package(label, genai_typed_copy(folder, GENAI_TYPES[prompt_family]),
                                              multimodal, args.ctx + 512)
                    result["exports"][label]["note"] = (f"run with genai_config model.type set to "
                                                        f"{GENAI_TYPES[prompt_family]!r} (a linked copy)")
                except Exception as retry:
                    result["exports"][label]["typed_load_error"] = f"{type(retry).__name__}: {str(retry)[:800]}"
    samples: dict[str, dict[str, list]] = {label: {} for label in packages}
    for _ in range(args.rounds + 1):  # the first round warms up (kernel tuning, allocations) and is dropped
        for label, package in packages.items():
            rows = samples[label]
            try:
                rows.setdefault("text", []).append(package.text(ids, args.steps))
                if package.multimodal:
                    rows.setdefault("image", []).append(
                        package.image(prompt, image, args.steps))
            except Exception as err:
                result["exports"][label]["run_error"] = f"{type(err).__name__}: {str(err)[:800]}"
    figures: dict[str, dict] = {label: {} for label in folders}
    for label, rows in samples.items():
        for kind, runs in rows.items():
            runs = runs[1:] or runs
            if not runs:
                continue
            figures[label][kind] = {
                "prompt_tokens": runs[0]["prompt_tokens"], "rounds": len(runs),
                "first_token_ms": statistics.median(r["first_token_ms"] for r in runs),
                "decode_ms_per_token": statistics.median(r["decode_ms"] for r in runs),
                "decode_ms_range": [min(r["decode_ms"] for r in runs), max(r["decode_ms"] for r in runs)],
                "tokens": runs[0]["tokens"]}
            if kind == "image":
                figures[label][kind]["processor_ms"] = statistics.median(r["processor_ms"] for r in runs)
    # Image encode: every package's vision graph on the tensors our package's processor made of the image (the
    # same patches for each; a package genai cannot load is measured too).
    feeds = packages["ours"].vision_feeds(prompt, image) if "ours" in packages else None
    for label, (folder, multimodal) in folders.items():
        if multimodal and feeds is not None:
            try:
                config = json.loads((folder / "genai_config.json").read_text())
                figures[label]["vision_encode"] = encode_ms(folder / config["model"]["vision"]["filename"], feeds,
                                                            args.encode_runs, args.ep)
            except Exception as err:
                figures[label]["vision_encode"] = {"error": f"{type(err).__name__}: {str(err)[:800]}"}
    result["figures"] = figures
    result["versions"] = {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__,
                          "device": ort.get_device()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
