#!/usr/bin/env bash
# Issue 46's GPU measurements on the device tool's machine, one phase per call (each call: at most 10 min).
# Staged first, here: SERVERS=0 EXTRA_WHEELS="transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3
#   safetensors==0.8.0 onnx-ir==1.1.0" bash benchmarks/stage_node_bundle.sh   (call K carries .gpu-stage/cKK:
#   bash benchmarks/gpu_issue46.sh stage KK)
# Phases:
#   stage KK   copy part KK to /tmp/parts
#   parity     every hybrid family's fp16 / bf16 cuda exports against transformers (benchmarks/hybrid_cuda.py)
#   speed      decode / prefill of depth-truncated real geometries (the same script)
#   peers      ours beside the genai builder's cuda export, fp16 and int4 (FAMILY=lfm2|qwen3_5_text, LAYERS)
# Results go to $OUT.
set -uo pipefail
phase=${1:?phase}
source "$(dirname "$0")/gpu_stage.sh" "$@"
case "$phase" in
  parity)
    python3 benchmarks/hybrid_cuda.py --speed "" --out "$OUT/hybrid_cuda_parity.json" 2>&1 | grep -v "Warning\|falling back" | tail -40 ;;
  peers)
    # ours beside the genai builder's cuda export of the same checkpoint (benchmarks/hybrid_speed.py --ep cuda); genai's
    # CUDA library finds cuBLAS / cudart where the image's torch keeps them.
    export LD_LIBRARY_PATH=$(python3 -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib"))))')
    python3 benchmarks/hybrid_speed.py --ep cuda --family "${FAMILY:-lfm2}" --layers "${LAYERS:-16}" \
      --precisions ${PRECISIONS:-fp16 int4} --peers ours genai --rounds "${ROUNDS:-3}" --steps 64 --warmup 8 \
      --out "$OUT/hybrid_speed_cuda_${FAMILY:-lfm2}.json" 2>&1 | grep -v "Warning\|falling back" | tail -30 ;;
  speed)
    python3 benchmarks/hybrid_cuda.py --arch --speed "${SPEED:-qwen3_5_text,lfm2,granitemoehybrid}" --layers "${LAYERS:-8}" \
      --out "$OUT/hybrid_cuda_speed.json" 2>&1 | grep -v "Warning\|falling back" | tail -20 ;;
esac
