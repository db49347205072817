"""Prefill and decode speed of a hybrid (recurrent-state) LLM on the CPU (or, ``--ep cuda``, the GPU): our
export beside onnxruntime-genai's model builder and transformers' own exporter, one random checkpoint, one run.

    python benchmarks/hybrid_speed.py --family qwen3_5_text            # Qwen3.5-0.8B-like, truncated to 4 layers
    python benchmarks/hybrid_speed.py --family lfm2 --layers 16        # LFM2-350M-like, all 16 layers
    python benchmarks/hybrid_speed.py --family qwen3_5_text --hidden 256 --layers 4 --prompt 256 --vocab 4096  # small
    python benchmarks/hybrid_speed.py --ep cuda --precisions fp16 int4 --peers ours genai --family lfm2 --layers 16

On CUDA (onnxruntime-gpu, onnxruntime-genai-cuda): ours exported for ep cuda, driven by Decoder's device binding
(caches and states on the GPU, no CUDA graph: a hybrid's states alternate buffers); genai's builder export for
``-e cuda`` in genai's Generator as it configures it; transformers.exporters' graph is a CPU one and not run there.
Each step's time is also taken as the whole decode's wall time over its steps (genai may return before the GPU
finishes a step; the wall of all steps cannot hide that).

What it measures, per peer: the prefill of one ``--prompt``-token prompt as ONE call (ms), then the
decode (ms per token: the median of ``--steps`` greedy steps after ``--warmup`` steps), batch 1,
onnxruntime's intra-op threads = ``--threads`` (2) for every session. ``--rounds`` rounds alternate the
peers (each once per round, sessions made once before the first round), so drift of the machine touches
each alike; every sample is kept, the figures are medians over rounds.

Geometry: the real model's dimensions (the family's defaults below, each overridable on the command line)
with the layers truncated to ``--layers`` keeping the real layer pattern (Qwen3.5: 3 linear-attention
layers, then one full; LFM2-350M: attention on layers 2, 5, 8, 10, 12, 14, conv elsewhere). Qwen3.5's
real vocabulary is 248320: a 2048-token fp32 prefill returns 2 GB of logits per peer (``--vocab`` shrinks it).

How each peer is driven (each the way its own runtime drives it):

- ours: ``exportfarm export --variant gqa --ep cpu --dtype fp32|int4 --no-validate`` (the pipeline's
  ``export_model``), driven as ``exportfarm bench`` drives it: ``Decoder.prefill_bound`` for the prompt,
  ``decode_bound`` steps with the KV cache in one shared buffer bound as past and present (as genai binds
  GroupQueryAttention's) and each recurrent state (``past_conv.i`` / ``past_recurrent.i``, zeros at the
  start) alternating between two bound buffers. (A first run fed host numpy arrays per step, copying
  every KV cache each step: LFM2-350M decoded 19-27% slower than genai that way.)
- genai: ``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32|int4 -e cpu`` on the same
  checkpoint (the builder takes Qwen3.5 only as ``Qwen3_5ForConditionalGeneration``, so for
  qwen3_5_text it reads a relabelled view of the same weights: config wrapped as the image-text model,
  tensors renamed model.* -> model.language_model.*). Its genai_config.json gets
  ``session_options.intra_op_num_threads``; driven by onnxruntime-genai's Generator: ``append_tokens(prompt)``
  (timed: prefill), then ``generate_next_token()`` timed per step, greedy.
- transformers: ``transformers.exporters`` (it needs onnxscript 0.7.0, not a dependency of the project: install it
  apart, e.g. ``pip install --target /tmp/oscript --no-deps onnxscript==0.7.0`` and ``PYTHONPATH=/tmp/oscript``):
  ``decompose_prefill_decode`` (a real ``generate()`` run)
  captures a prefill call (empty cache) and a decode call (the cache after the prefill); each is exported
  with ``OnnxExporter().export(model, inputs, config=OnnxConfig(dynamic=True, ort_fusions="cpu"))``, fp32.
  The prefill graph takes input_ids / position_ids (and the cache's scalar counters) and returns the cache
  (``cache.layers.i.*``); the decode graph takes it as ``input.cache.layers.i.*`` and returns
  ``output.cache.layers.i.*``. Both run in plain onnxruntime sessions, numpy in and out, each step's cache
  outputs fed to the next. The prefill is captured at the benchmark's prompt length (its chunked delta rule
  is traced for that many chunks). A peer that cannot be built is recorded with its error text.

Greedy tokens: the tokens each peer chose in the timed run (same prompt) are compared, and ours and
genai are also compared on a short prompt. Reported, not asserted.
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
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Real models' dimensions (Qwen/Qwen3.5-0.8B text_config; LiquidAI/LFM2-350M), before truncation.
GEOMETRIES = {
    "qwen3_5_text": dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    ),
    "lfm2": dict(
        vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, head_dim=64, conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, tie_word_embeddings=True, full_attn_idxs=[2, 5, 8, 10, 12, 14],
    ),
    # Granite-4.0-H-Tiny's width (as benchmarks/hybrid_cuda.py): Mamba2 of 48 heads x 64, d_state 128, 64 experts of
    # 512 (6 a token) and a shared MLP of 1024 on every layer, NoPE attention; the layers here 3 Mamba2 to 1 attention.
    "granitemoehybrid": dict(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4,
        mamba_n_heads=48, mamba_d_head="auto", mamba_expand=2, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
        num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
        position_embedding_type="nope", tie_word_embeddings=True,
    ),
}


def geometry(args) -> dict:
    """The checkpoint's config overrides: the family's real dims, command-line overrides, truncated layers."""
    g = dict(GEOMETRIES[args.family])
    full_layers = g["num_hidden_layers"]
    for key, value in (("hidden_size", args.hidden), ("vocab_size", args.vocab), ("intermediate_size", args.intermediate),
                       ("num_attention_heads", args.heads), ("num_key_value_heads", args.kv_heads), ("head_dim", args.head_dim)):
        if value is not None:
            g[key] = value
    g.update(json.loads(args.override or "{}"))
    n = args.layers
    if args.family == "lfm2":
        if args.hidden is not None and args.head_dim is None:
            g["head_dim"] = g["hidden_size"] // g["num_attention_heads"]
        g["full_attn_idxs"] = [i for i in g["full_attn_idxs"] if i < n] or [n - 1]
    elif args.family == "granitemoehybrid":
        g["layer_types"] = ["attention" if (i + 1) % 4 == 0 else "mamba" for i in range(n)]
    else:  # Qwen3.5: every 4th layer full attention (3:1)
        g["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(full_layers)][:n]
        if "full_attention" not in g["layer_types"]:
            g["layer_types"][-1] = "full_attention"
    g["num_hidden_layers"] = n
    rope = g.get("rope_parameters")
    if rope and "mrope_section" in rope:  # Qwen3.5's interleaved M-RoPE: sections rescaled to the rotary half
        half = int(g["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        a = round(half * 11 / 32)
        g["rope_parameters"] = {**rope, "mrope_section": [a, a, half - 2 * a]}
    g["max_position_embeddings"] = max(4096, args.prompt + args.warmup + args.steps + 64)
    return g


def qwen35_genai_view(checkpoint: Path, out: Path) -> Path:
    """The same Qwen3.5 text weights as the image-text checkpoint the genai builder accepts
    (Qwen3_5ForConditionalGeneration, a tiny vision tower in the config only, tensors under model.language_model)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    text = transformers.AutoConfig.from_pretrained(str(checkpoint))
    config = transformers.Qwen3_5Config(
        text_config=text.to_dict(), tie_word_embeddings=text.tie_word_embeddings,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.hidden_size,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16))
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(out)
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        for name, value in load_file(str(file)).items():
            tensors[("model.language_model." + name.removeprefix("model.")) if name.startswith("model.") else name] = value
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in checkpoint.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    del torch
    return out


# --- peers ---------------------------------------------------------------------------------------------------

class Ours:
    """Our gqa export as the project's bench drives it (``exportfarm bench``: Decoder's device binding, CPU
    here): the prompt in one bound call, then one-token steps with the KV cache in one shared
    max-length buffer bound as both past and present (GroupQueryAttention's contract, as onnxruntime-genai
    binds it) and each recurrent state alternating between two bound buffers. The bound steps feed a fixed
    token (compute does not depend on which); the greedy tokens come from an untimed host-array run."""

    def __init__(self, folder: Path, threads: int, ep: str = "cpu"):
        import onnxruntime as ort

        from exporter.runtime.session import Decoder

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.decoder = Decoder(folder, ep, session_options=options)

    def generate(self, prompt: list[int], warmup: int, steps: int) -> dict:
        d = self.decoder
        buffer = len(prompt) + warmup + steps + 8
        caches = d.new_caches(buffer)
        prefill, _ = d.prefill_bound(np.array([prompt], np.int64), caches, buffer)
        t0 = time.perf_counter()
        times, _ = d.decode_bound(caches, len(prompt), buffer, steps, warmup)
        wall = (time.perf_counter() - t0) * 1e3 / (steps + warmup)
        state = d.new_state(1)  # greedy tokens, untimed, through host arrays
        logits = d.forward(np.array([prompt], np.int64), state)[:, -1]
        tokens = [int(logits[0].argmax())]
        for _ in range(warmup + steps):
            tokens.append(int(d.step([tokens[-1]], state)[0].argmax()))
        return {"prefill_ms": prefill * 1e3, "step_ms": list(times), "tokens": tokens, "wall_ms_per_step": wall}


class Genai:
    """The builder's export in onnxruntime-genai's Generator."""

    def __init__(self, folder: Path, threads: int):
        import onnxruntime_genai as og

        path = folder / "genai_config.json"
        config = json.loads(path.read_text())
        config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
        path.write_text(json.dumps(config, indent=2))
        self.og, self.model = og, og.Model(str(folder))

    def generate(self, prompt: list[int], warmup: int, steps: int) -> dict:
        og = self.og
        total = len(prompt) + warmup + steps + 1
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(self.model, params)
        t0 = time.perf_counter()
        generator.append_tokens(prompt)  # runs the prompt: the prefill
        prefill = time.perf_counter() - t0
        times, start = [], time.perf_counter()
        while not generator.is_done():
            t0 = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - t0)
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt):]]  # on the host: every step finished
        wall = (time.perf_counter() - start) * 1e3 / len(times)
        return {"prefill_ms": prefill * 1e3, "step_ms": [t * 1e3 for t in times[warmup:]], "tokens": tokens,
                "wall_ms_per_step": wall}


def _state_key(name: str) -> str:
    """transformers.exporters' cache names without their in/out prefix: cache.layers.i.keys ..."""
    return name.removeprefix("input.").removeprefix("output.")


class TransformersExporters:
    """transformers.exporters' prefill and decode graphs in plain onnxruntime sessions."""

    def __init__(self, checkpoint: Path, work: Path, prompt_len: int, threads: int, info: dict):
        import onnx_ir
        import onnxruntime as ort
        import torch
        import transformers
        from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter
        from transformers.exporters.utils import decompose_prefill_decode

        model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        ids = torch.randint(3, model.config.vocab_size, (1, prompt_len))
        stages = decompose_prefill_decode(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.sessions = {}
        for name, (module, inputs) in stages.items():
            t0 = time.perf_counter()
            exported = OnnxExporter().export(module, inputs, config=OnnxConfig(dynamic=True, ort_fusions="cpu"))
            info[f"{name}_export_s"] = round(time.perf_counter() - t0, 1)
            path = work / f"transformers_{name}.onnx"
            onnx_ir.save(exported.program, str(path), external_data=path.name + ".data")
            self.sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            info[f"{name}_inputs"] = [i.name for i in self.sessions[name].get_inputs()]
            info[f"{name}_outputs"] = [o.name for o in self.sessions[name].get_outputs()]
        self.decode_in = {i.name: i for i in self.sessions["decode"].get_inputs()}

    @staticmethod
    def _feeds(session, ids: np.ndarray, past: int, cache: dict) -> dict:
        feeds = {}
        for i in session.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = ids
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(past, past + ids.shape[1], dtype=np.int64)[None]
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones((1, past + ids.shape[1]), np.int64)
            elif _state_key(i.name) in cache:
                feeds[i.name] = cache[_state_key(i.name)]
            elif i.shape == []:  # the cache's counters (cumulative_length_linear) at the start
                feeds[i.name] = np.zeros((), np.int64)
            else:
                raise KeyError(f"no value for transformers graph input {i.name} {i.shape}")
        return feeds

    def _run(self, stage: str, ids: np.ndarray, past: int, cache: dict):
        session = self.sessions[stage]
        outputs = session.run(None, self._feeds(session, ids, past, cache))
        names = [o.name for o in session.get_outputs()]
        new_cache = {_state_key(n): v for n, v in zip(names, outputs) if n != "logits"}
        return outputs[names.index("logits")], new_cache

    def generate(self, prompt: list[int], warmup: int, steps: int) -> dict:
        t0 = time.perf_counter()
        logits, cache = self._run("prefill", np.array([prompt], np.int64), 0, {})
        prefill = time.perf_counter() - t0
        tokens, times, past = [int(logits[0, -1].argmax())], [], len(prompt)
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            logits, cache = self._run("decode", np.array([[tokens[-1]]], np.int64), past, cache)
            times.append(time.perf_counter() - t0)
            past += 1
            tokens.append(int(logits[0, -1].argmax()))
        return {"prefill_ms": prefill * 1e3, "step_ms": [t * 1e3 for t in times[warmup:]], "tokens": tokens}


# --- building ------------------------------------------------------------------------------------------------

def build_ours(checkpoint: Path, work: Path, dtype: str, ep: str = "cpu") -> tuple[Path, str]:
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest

    out = work / f"ours_{dtype}_gqa_{ep}"
    export_model(ExportRequest(model=str(checkpoint), dtype=dtype, ep=ep, variant="gqa"), out, validate=False,
                 overwrite=True)
    return out, f"exportfarm export --model <ckpt> --out <out> --variant gqa --dtype {dtype} --ep {ep} --no-validate"


def build_genai(checkpoint: Path, work: Path, precision: str, ep: str = "cpu") -> tuple[Path, str]:
    out = work / f"genai_{precision}_{ep}"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
           "-p", precision, "-e", ep, "-c", str(work / "genai_cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise RuntimeError(f"builder exited {proc.returncode}: {tail}")
    return out, " ".join(cmd[1:]).replace(str(work), "<work>")


def summary(samples: list[dict]) -> dict:
    prefill = [round(s["prefill_ms"], 3) for s in samples]
    decode = [round(float(np.median(s["step_ms"])), 3) for s in samples]
    wall = [round(s["wall_ms_per_step"], 3) for s in samples if "wall_ms_per_step" in s]
    return {"prefill_ms": float(np.median(prefill)), "decode_ms_per_token": float(np.median(decode)),
            **({"decode_wall_ms_per_token": float(np.median(wall)), "decode_wall_ms_per_token_rounds": wall} if wall else {}),
            "prefill_ms_rounds": prefill, "decode_ms_per_token_rounds": decode,
            "decode_step_ms_all": [[round(t, 3) for t in s["step_ms"]] for s in samples]}


def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {"same": first is None and len(a) == len(b), "compared": n, "first_difference_at": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_5_text", choices=sorted(GEOMETRIES))
    parser.add_argument("--layers", type=int, default=4, help="truncate to this many layers (real pattern kept)")
    parser.add_argument("--hidden", type=int), parser.add_argument("--vocab", type=int)
    parser.add_argument("--intermediate", type=int), parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int), parser.add_argument("--head-dim", type=int)
    parser.add_argument("--override", help="JSON of more config overrides, e.g. '{\"linear_num_value_heads\": 8}'")
    parser.add_argument("--weights", default="bfloat16", choices=["bfloat16", "float32"], help="checkpoint dtype")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int4"], choices=["fp32", "fp16", "int4"])
    parser.add_argument("--peers", nargs="+", default=["ours", "genai", "transformers"],
                        choices=["ours", "genai", "transformers"])
    parser.add_argument("--ep", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/hybrid_speed_cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()
    started = time.time()

    import onnxruntime
    if args.ep == "cuda" and hasattr(onnxruntime, "preload_dlls"):
        onnxruntime.preload_dlls()
    import onnxruntime_genai as og
    import torch
    import transformers

    from exporter.tiny_checkpoint import make_tiny_checkpoint, make_tiny_tokenizer

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hybrid-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = geometry(args)
    checkpoint = make_tiny_checkpoint(args.family, work / "checkpoint", dtype=args.weights, init_std=0.02,
                                      **{k: v for k, v in overrides.items() if k != "tie_word_embeddings"},
                                      tie_word_embeddings=overrides.get("tie_word_embeddings", False))
    make_tiny_tokenizer(checkpoint)  # the genai builder writes the tokenizer files beside its model
    config = json.loads((checkpoint / "config.json").read_text())
    print(f"checkpoint {checkpoint}: {args.family} {json.dumps(overrides)}", flush=True)

    peers, built, failed, how = {}, {}, {}, {}
    def attempt(label, make):
        t0 = time.perf_counter()
        try:
            peers[label] = make()
            built[label] = round(time.perf_counter() - t0, 1)
            print(f"{label}: ready in {built[label]} s", flush=True)
        except Exception as err:  # recorded with the tool's own words, not hidden
            failed[label] = f"{type(err).__name__}: {str(err)[-1500:]}"
            print(f"{label}: FAILED {failed[label]}", flush=True)
            traceback.print_exc()

    commands = {}
    for precision in args.precisions:
        if "ours" in args.peers:
            def make_ours(p=precision):
                folder, commands[f"ours {p}"] = build_ours(checkpoint, work, p, args.ep)
                return Ours(folder, args.threads, args.ep)
            attempt(f"ours {precision} gqa", make_ours)
            how[f"ours {precision} gqa"] = ("exporter.runtime.session.Decoder's IO binding as exportfarm bench drives it: "
                                            "prefill_bound(prompt) once, decode_bound steps (KV in one shared buffer "
                                            "bound as past and present, states alternating two buffers); greedy tokens "
                                            f"from an untimed host-array run; intra_op_num_threads {args.threads}")
        if "genai" in args.peers:
            def make_genai(p=precision):
                source = checkpoint
                if args.family == "qwen3_5_text":
                    source = work / "checkpoint_genai_view"
                    if not source.exists():
                        qwen35_genai_view(checkpoint, source)
                folder, commands[f"genai {p}"] = build_genai(source, work, p, args.ep)
                return Genai(folder, args.threads)
            attempt(f"genai builder {precision}", make_genai)
            how[f"genai builder {precision}"] = ("onnxruntime-genai og.Model/Generator: append_tokens(prompt) timed as the "
                                                 "prefill, generate_next_token() timed per step, greedy; genai_config "
                                                 f"session_options.intra_op_num_threads {args.threads}")
    if "transformers" in args.peers and args.ep == "cuda":
        failed["transformers.exporters fp32"] = "not run on cuda: its graph here is fused for the CPU (ort_fusions='cpu')"
    elif "transformers" in args.peers:
        info = {}
        attempt("transformers.exporters fp32",
                lambda: TransformersExporters(checkpoint, work, args.prompt, args.threads, info))
        how["transformers.exporters fp32"] = (
            "decompose_prefill_decode (generate() capture) -> OnnxExporter().export(..., OnnxConfig(dynamic=True, "
            "ort_fusions='cpu')) for the prefill and decode calls; plain onnxruntime sessions, numpy IO, each step's "
            f"output.cache.* fed back as input.cache.*; intra_op_num_threads {args.threads}")
        commands["transformers.exporters fp32"] = info

    # Timing: rounds alternate between the peers.
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, config.get("vocab_size", 256), size=args.prompt)]
    samples = {label: [] for label in peers}
    tokens = {}
    for r in range(args.rounds):
        for label, peer in peers.items():
            time.sleep(0.5)  # the previous session's spinning threads settle
            try:
                s = peer.generate(prompt, args.warmup, args.steps)
            except Exception as err:
                failed[f"{label} (run)"] = f"{type(err).__name__}: {str(err)[-1500:]}"
                print(f"round {r} {label}: FAILED {failed[f'{label} (run)']}", flush=True)
                continue
            samples[label].append(s)
            tokens.setdefault(label, s["tokens"])
            print(f"round {r} {label:28s} prefill {s['prefill_ms']:9.1f} ms  decode {np.median(s['step_ms']):7.2f} ms/token",
                  flush=True)

    results = {label: summary(s) for label, s in samples.items() if s}
    greedy = {"bench_prompt": {}, "short_prompt": {}}
    pairs = [(f"ours {p} gqa", f"genai builder {p}") for p in args.precisions]
    pairs += [(f"ours fp32 gqa", "transformers.exporters fp32"), ("genai builder fp32", "transformers.exporters fp32")]
    for a, b in pairs:
        if a in tokens and b in tokens:
            greedy["bench_prompt"][f"{a} / {b}"] = agreement(tokens[a], tokens[b])
    short = prompt[:12]
    for p in args.precisions:
        a, b = f"ours {p} gqa", f"genai builder {p}"
        if a in peers and b in peers:
            try:
                ta, tb = peers[a].generate(short, 0, 16)["tokens"], peers[b].generate(short, 0, 16)["tokens"]
                greedy["short_prompt"][f"{a} / {b}"] = {**agreement(ta, tb), "ours": ta, "genai": tb}
            except Exception as err:
                greedy["short_prompt"][f"{a} / {b}"] = {"error": f"{type(err).__name__}: {str(err)[-800:]}"}
    greedy["tokens_bench_prompt"] = tokens

    record = {
        "benchmark": "hybrid_speed",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/hybrid_speed.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "ep": args.ep, "device": (torch.cuda.get_device_name(0) if args.ep == "cuda" and torch.cuda.is_available() else None),
        "versions": {"onnxruntime": onnxruntime.__version__, "onnxruntime_genai": og.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "family": args.family, "checkpoint": {"weights": args.weights, "config_overrides": overrides,
                                              "architectures": config.get("architectures")},
        "protocol": {"prompt_tokens": args.prompt, "decode_steps": args.steps, "warmup_steps": args.warmup,
                     "rounds": args.rounds, "threads": args.threads, "batch": 1,
                     "prefill": "one call over the whole prompt", "decode": "median step of each round, median over rounds"},
        "how_driven": how, "build_commands": commands, "build_seconds": built,
        "results": results, "failed": failed, "greedy_tokens": greedy,
        "wall_seconds": round(time.time() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for label, r in results.items():
        print(f"{label:28s} prefill {r['prefill_ms']:9.1f} ms  decode {r['decode_ms_per_token']:7.2f} ms/token")
    print(json.dumps({k: v for k, v in greedy.items() if k != "tokens_bench_prompt"}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
