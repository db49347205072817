# syntax=docker/dockerfile:1
# The GPU export worker: CUDA 13 + cuDNN 9 runtime and onnxruntime-gpu. Build from the repo root:
#   docker build -f deploy/gpu-worker.Dockerfile -t exportfarm/gpu-worker:0.1.0 .
# The host needs an NVIDIA driver for CUDA 13 (R580 or newer) and the NVIDIA container toolkit.
# Pinned: the base image by tag, onnxruntime-gpu / nvidia-ml-py / torch below, every other Python
# package by deploy/constraints.txt.

# onnxruntime-gpu 1.31.1 links libcudart.so.13, libcublas(Lt).so.13, libcurand.so.10 and cuDNN 9
# for CUDA 13: the cudnn-runtime flavour of the CUDA 13.0 image has all of them.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's own Python (3.12; exportfarm supports >= 3.11). Not pinned to a package version:
# Ubuntu drops superseded versions from its archive, so a pin would break the build at the next
# security update; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/exportfarm/bin:$PATH \
    DATA_DIR=/var/lib/exportfarm \
    WORKER_QUEUES=gpu

# The same uid/gid as the API image (10001), so volumes and runAsUser agree. The work and models
# directories exist here so named volumes mounted on them start out owned by that user.
RUN groupadd --system --gid 10001 exportfarm \
 && useradd --system --uid 10001 --gid exportfarm --home-dir /var/lib/exportfarm --create-home \
      --shell /usr/sbin/nologin exportfarm \
 && install -d -o exportfarm -g exportfarm /var/lib/exportfarm/work /models \
 && python3 -m venv /opt/exportfarm

# torch, the CPU build: the exporter uses torch on the CPU only (reading checkpoints, the
# transformers reference for parity); ONNX Runtime runs the model on the GPU with its own CUDA
# libraries, so torch's multi-GB CUDA build would only add weight.
ARG TORCH_VERSION=2.13.0
# TORCH_PIP_SOURCE says where pip finds it; a build without that index names a wheel directory
# mounted into the build instead (CI: --build-arg TORCH_PIP_SOURCE="--no-index --find-links /wheels"
# with podman build --volume /opt/wheels:/wheels:ro; deploy/ci/README.md).
ARG TORCH_PIP_SOURCE="--index-url https://download.pytorch.org/whl/cpu"
RUN pip install --no-deps ${TORCH_PIP_SOURCE} "torch==${TORCH_VERSION}+cpu"

# onnxruntime-gpu takes the place of the lock's onnxruntime: both install the `onnxruntime` module,
# and two copies would overwrite each other's files.
ARG ORT_GPU_VERSION=1.31.1
ARG NVIDIA_ML_PY_VERSION=13.615.71
COPY deploy/constraints.txt /opt/exportfarm/constraints.txt
RUN grep -v -E '^(torch|onnxruntime)==' /opt/exportfarm/constraints.txt >/tmp/requirements.txt \
 && pip install --no-deps -r /tmp/requirements.txt \
      "onnxruntime-gpu==${ORT_GPU_VERSION}" "nvidia-ml-py==${NVIDIA_ML_PY_VERSION}" \
 && rm /tmp/requirements.txt

# The project without dependencies (it names `onnxruntime`, which onnxruntime-gpu provides). pip
# check knows only distribution names, so that one line is expected; anything else fails the build,
# and so does an onnxruntime without the CUDA execution provider.
COPY pyproject.toml README.md /src/
COPY exporter /src/exporter
COPY services /src/services
COPY workers /src/workers
RUN pip install --no-deps --no-build-isolation /src \
 && rm -rf /src \
 && problems="$(pip check | grep -v -x -e 'No broken requirements found.' \
      -e 'exportfarm [^ ]* requires onnxruntime, which is not installed.' || true)" \
 && if [ -n "$problems" ]; then echo "$problems" >&2; exit 1; fi \
 && python -c "import onnxruntime as ort; p = ort.get_available_providers(); assert 'CUDAExecutionProvider' in p, p"

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/exportfarm
ENTRYPOINT ["exportfarm"]
# Healthy while this container's Celery node answers a ping over the broker (REDIS_URL, set where the
# worker runs); a busy worker answers too, a hung or disconnected one does not.
HEALTHCHECK --interval=60s --timeout=30s --start-period=120s --retries=3 \
  CMD ["python", "-m", "services.health", "worker"]
CMD ["worker", "--queues", "gpu"]
