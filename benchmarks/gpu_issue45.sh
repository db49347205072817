#!/usr/bin/env bash
# Issue 45's GPU measurements on the device tool's machine, one phase per call (each call: at most 10 min).
# Staged first, here: SERVERS=0 EXTRA_WHEELS="gguf==0.17.1" EXTRA_FILES="<gemma3-270m.gguf> <gemma3-270m.tokenizer.tar.gz>"
#   bash benchmarks/stage_node_bundle.sh   (then call K carries .gpu-stage/cKK: bash benchmarks/gpu_issue45.sh stage KK)
# Phases:
#   stage KK   copy part KK to /tmp/parts
#   crash      the bf16 bench crash before / after the fix (bf16_bench_crash.py) and a planted native crash in
#              the worker's bench stage (gpu_worker_e2e.py --crash-in bench)
#   gemma      the real Gemma-3-270M: default int4 cuda (validated), its measured activations, bench beside the other
#   8b         the Llama-3.1-8B geometry (random bf16, 32 layers): fp16 and default int4 exports timed, bench
#              of int4 in the measured activations beside the other
# Results go to $OUT.
set -uo pipefail
phase=${1:?phase}
source "$(dirname "$0")/gpu_stage.sh" "$@"
export EXPORTFARM_GGUF_DIR=/tmp/b/extra
case "$phase" in
  crash)
    python3 benchmarks/bf16_bench_crash.py --out "$OUT/bf16_bench_crash.json" 2>&1 | grep -v Warning | tail -20
    python3 benchmarks/gpu_worker_e2e.py --archs llama --dtypes int4 --variants gqa --contexts 64 --batches 1 \
      --crash-in bench --out "$OUT/gpu_worker_e2e_crash_in_bench.json" 2>&1 | tail -4 ;;
  gemma)
    python3 benchmarks/int4_activations.py --model gemma3-270m --ctx 128,2048 \
      --out "$OUT/int4_activations_gemma3-270m.json" 2>&1 | grep -v Warning | tail -12 ;;
  8b-build)
    python3 benchmarks/scale.py --geometry llama-3.1-8b --layers 32 --build-only --work /tmp/s8 2>&1 | tail -3 ;;
  8b)
    python3 benchmarks/int4_activations.py --model /tmp/s8/llama-3.1-8b-L32 --no-validate --fp16-baseline \
      --ctx 128,2048 --out "$OUT/int4_activations_llama-3.1-8b.json" 2>&1 | grep -v Warning | tail -12 ;;
esac
