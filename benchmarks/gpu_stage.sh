# Sourced by the benchmarks/gpu_issue*.sh phase scripts on the device tool's GPU machine: "stage KK" copies
# part KK of .gpu-stage (made by benchmarks/stage_node_bundle.sh) to /tmp/parts and exits; any other phase
# installs the bundle once into /tmp/site and sets the environment the benchmarks run in.
if [ "${1:-}" = stage ]; then
  mkdir -p /tmp/parts && cp ".gpu-stage/c$2/part.$2" /tmp/parts/ && ls /tmp/parts | wc -l
  exit
fi
if ! test -f /tmp/site/onnxruntime/__init__.py; then
  cat /tmp/parts/part.* > /tmp/bundle.tar && mkdir -p /tmp/b && tar xf /tmp/bundle.tar -C /tmp/b && rm /tmp/bundle.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/b/*.whl /tmp/b/wheels/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export EXPORTFARM_CACHE=/tmp/efcache HF_HUB_OFFLINE=1 PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
