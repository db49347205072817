#!/usr/bin/env bash
# A local Debian 12 base image for building and running the deployment where no registry image is
# reachable (CI): mmdebstrap from Debian's archive, then `podman import`. It carries Python 3.11
# (Debian's python3, as `python` too) and CA certificates: what deploy/Dockerfile's PYTHON_IMAGE and
# the stand-ins in this directory need. Prints the image name; builds it only when it is missing.
#   deploy/ci/base-image.sh [name]      (default localhost/exportfarm-ci/debian:bookworm-<hash>)
set -euo pipefail

packages=python3,python3-venv,python-is-python3,ca-certificates
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The tag names what the image holds, so a change of the package list builds a new one.
tag=$(printf '%s %s' "$packages" "$mirror" | sha256sum | cut -c1-12)
image=${1:-localhost/exportfarm-ci/debian:bookworm-$tag}

if podman image exists "$image"; then
  echo "$image"
  exit 0
fi
for tool in mmdebstrap podman; do
  command -v "$tool" >/dev/null || { echo "base-image.sh: $tool is missing (apt-get install mmdebstrap podman)" >&2; exit 1; }
done
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT
mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$tarball" "$mirror" >&2
podman import --quiet "$tarball" "$image" >/dev/null
echo "$image"
