#!/usr/bin/env bash
# Re-resolve deploy/constraints.txt, the exact Python packages the images install: a fresh Python
# 3.11 venv, the CPU build of torch, the project, pip check, pip freeze. Run it after changing
# dependencies in pyproject.toml, then rebuild the images.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
ORT_VERSION=${ORT_VERSION:-1.31.1}  # keep equal to ORT_GPU_VERSION in gpu-worker.Dockerfile

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/pip" --disable-pip-version-check -q)
"${pip[@]}" install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION+cpu"
"${pip[@]}" install . "onnxruntime==$ORT_VERSION"
"${pip[@]}" check

{
  sed -n '1,/^# Regenerate/p' deploy/constraints.txt
  "${pip[@]}" freeze --all --exclude pip --exclude exportfarm | sed 's/+cpu$//' | sort -f
} >"$tmp/constraints.txt"
mv "$tmp/constraints.txt" deploy/constraints.txt
echo "deploy/constraints.txt: $(grep -vc '^#' deploy/constraints.txt) packages"
