#!/usr/bin/env bash
# Issue 47's GPU measurements on the device tool's machine, one phase per call (each call: at most 10 min).
# Staged first, here: SERVERS=0 EXTRA_WHEELS="transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3
#   safetensors==0.8.0 onnx-ir==1.1.0" EXTRA_NODEPS="onnxruntime-genai-cuda==0.18.0" bash benchmarks/stage_node_bundle.sh
#   (call K carries .gpu-stage/cKK: bash benchmarks/gpu_issue47.sh stage KK)
# Phases:
#   stage KK   copy part KK to /tmp/parts
#   parity     every 2025-26 family's fp16 / bf16 cuda exports (gqa, attn_dynamic) against transformers' fp32 greedy
#              run (benchmarks/hybrid_cuda.py's harness: 70-token prompt, 24 steps, the fp16 bar)
#   speed      hand-built vs traced exports of depth-truncated real geometries (benchmarks/traced_speed.py)
#   extras     (carrying .gpu-stage/extras: pip download onnxruntime==1.32.0 for cp312 there, and for issue 48's
#              peer mobius-onnx==0.1.0 onnxscript==0.7.2 onnx-shape-inference==0.4.0) onnxruntime 1.32.0's CPU wheel
#              into /tmp/ortcpu (the CPU EP with MoEGroupRouter; the machine's onnxruntime-gpu is 1.31.1) and mobius
#              with its own onnxscript into /tmp/mobius (the bundle's onnxscript 0.7.0 is the traced fallback's:
#              EXTRA_NODEPS="onnxruntime-genai-cuda==0.18.0 onnxscript==0.7.0")
#   speed_cpu  the speed phase on the CPU EP, onnxruntime 1.32.0 from /tmp/ortcpu (SPEED_ARGS as for speed; twice
#              for a 3.7B-parameter fp32 pair: once with --export-only, then to measure)
# Results go to $OUT.
set -uo pipefail
phase=${1:?phase}
source "$(dirname "$0")/gpu_stage.sh" "$@"
case "$phase" in
  parity)
    python3 benchmarks/hybrid_cuda.py --speed "" --arch ${ARCHS:-glm4_moe deepseek_v3 ernie4_5_moe llama4_text lfm2_moe nemotron_h seed_oss ernie4_5 olmo3 exaone4 ministral3 hunyuan_v1_dense cohere2 apertus} \
      --out "$OUT/new_families_cuda_parity.json" 2>&1 | grep -v "Warning\|falling back" | cut -c1-400 | tail -60 ;;
  extras)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ortcpu .gpu-stage/extras/onnxruntime-*.whl &&
      PYTHONPATH=/tmp/ortcpu:$PYTHONPATH python3 -c "import onnxruntime as o, onnxscript; print(o.__version__, o.__file__, onnxscript.__version__)" &&
      if ls .gpu-stage/extras/mobius_onnx-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mobius .gpu-stage/extras/mobius_onnx-*.whl \
          .gpu-stage/extras/onnxscript-*.whl .gpu-stage/extras/onnx_shape_inference-*.whl &&
          PYTHONPATH=/tmp/mobius:$PYTHONPATH python3 -c "import mobius, onnxscript; print('mobius', onnxscript.__version__)"
      fi ;;
  speed_cpu)
    PYTHONPATH=/tmp/ortcpu:$PYTHONPATH python3 benchmarks/traced_speed.py --ep cpu ${SPEED_ARGS:-} \
      --out "$OUT/traced_speed_cpu.json" 2>&1 | grep -v "Warning\|falling back" | tail -40 ;;
  speed)
    python3 benchmarks/traced_speed.py --ep cuda ${SPEED_ARGS:-} --out "$OUT/traced_speed_cuda.json" 2>&1 \
      | grep -v "Warning\|falling back" | tail -40 ;;
esac
