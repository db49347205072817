#!/usr/bin/env bash
# Re-resolve deploy/constraints.txt, the exact Python packages the images install: a fresh Python
# 3.11 venv, the CPU build of torch, the project, pip check, pip freeze. Run it after changing
# dependencies in pyproject.toml, then rebuild the images. Resolve with the oldest Python an image
# runs (CI's Debian 12 base: 3.11.2), so that markers such as redis's async-timeout
# (python_full_version < "3.11.3") are in the lock; deploy/ci/README.md shows the podman command.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_PIP_SOURCE=${TORCH_PIP_SOURCE:---index-url https://download.pytorch.org/whl/cpu}
ORT_VERSION=${ORT_VERSION:-1.31.1}  # keep equal to ORT_GPU_VERSION in gpu-worker.Dockerfile

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/pip" --disable-pip-version-check -q)
# shellcheck disable=SC2086  # TORCH_PIP_SOURCE is several pip options
"${pip[@]}" install $TORCH_PIP_SOURCE "torch==$TORCH_VERSION+cpu"
"${pip[@]}" install . "onnxruntime==$ORT_VERSION"
"${pip[@]}" check

{
  sed -n '1,/^# Regenerate/p' deploy/constraints.txt
  "${pip[@]}" freeze --all --exclude pip --exclude exportfarm | sed 's/+cpu$//' | sort -f
} >"$tmp/constraints.txt"
mv "$tmp/constraints.txt" deploy/constraints.txt
echo "deploy/constraints.txt: $(grep -vc '^#' deploy/constraints.txt) packages"
