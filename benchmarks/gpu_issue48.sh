#!/usr/bin/env bash
# Issue 48's GPU measurements on the device tool's machine, one phase per call (each call: at most 10 min).
# Staged as for issue 47 (benchmarks/gpu_issue47.sh: stage KK for each part, then extras for mobius).
# Phases:
#   vlm GEOMETRY LAYERS   benchmarks/vlm_speed.py at a depth-truncated real geometry (qwen2.5-vl-7b, gemma-3-12b):
#                         ours beside the genai builder's text decoder and mobius (VLM_ARGS: more options)
#   check GEOMETRY LAYERS benchmarks/vlm_decode_check.py: the same geometry's ours and genai-builder packages (exported
#                         by vlm_speed.py --export-only) decoded by genai and by decode_check.py's plain harness, with
#                         the GPU kernels of each (CHECK_ARGS: more options); then which weight Transposes of the
#                         builder's decoder onnxruntime leaves unfolded on cuda (benchmarks/folded_constants.py)
#   parity                benchmarks/vlm_cuda.py: every tiny image-text family exported for cuda and put through the
#                         farm's own validation on the GPU (CASES, DTYPES, VARIANTS: its --cases / --dtypes / --variants)
#   routing               benchmarks/moe_routing_check.py: the tiny qwen3_5_moe's expert choices in our cuda exports
#                         (DTYPES) beside transformers' fp32 and transformers in each dtype on the GPU
# Results go to $OUT.
set -uo pipefail
phase=${1:?phase}
source "$(dirname "$0")/gpu_stage.sh" "$@"
case "$phase" in
  vlm)
    MOBIUS_PATH=/tmp/mobius python3 benchmarks/vlm_speed.py --geometry "$2" --text-layers "$3" ${VLM_ARGS:-} \
      --out "$OUT/vlm_speed_$2.json" 2>&1 | grep -v "Warning\|falling back" | cut -c1-600 | tail -60 ;;
  check)
    python3 benchmarks/vlm_speed.py --geometry "$2" --text-layers "$3" --peers genai --export-only \
      --out "$OUT/vlm_speed_exports_$2.json" 2>&1 | grep -v "Warning\|falling back" | cut -c1-400 | tail -8
    python3 benchmarks/vlm_decode_check.py --geometry "$2" --text-layers "$3" ${CHECK_ARGS:-} \
      --out "$OUT/vlm_decode_check_$2.json" 2>&1 | grep -v "Warning\|falling back" | cut -c1-600 | tail -30
    python3 benchmarks/folded_constants.py "/tmp/vlm-speed/$2-L$3-genai/model.onnx" --providers cuda \
      --out "$OUT/folded_constants_genai_$2.json" 2>&1 | cut -c1-600 | tail -4 ;;
  routing)
    python3 benchmarks/moe_routing_check.py --case qwen3_5_moe_genai --ep cuda --dtypes ${DTYPES:-bf16 fp16} \
      --out "$OUT/moe_routing_check_qwen3_5_moe_cuda.json" 2>&1 | grep -v "Warning\|falling back\|plugin EP" | cut -c1-1500 | tail -30 ;;
  parity)
    python3 benchmarks/vlm_cuda.py --cases ${CASES:-gemma3 llava idefics3 smolvlm qwen2_5_vl qwen3_5 qwen3_vl qwen3_vl_moe mistral3} \
      --dtypes ${DTYPES:-fp16 bf16} --variants ${VARIANTS:-gqa} --out "$OUT/vlm_cuda.json" 2>&1 \
      | grep -v "Warning\|falling back" | cut -c1-600 | tail -60 ;;
esac
