#!/bin/sh
# SeaweedFS entrypoint for docker-compose.yml: write the S3 identities file from S3_ACCESS_KEY and
# S3_SECRET_KEY, then run `weed` with the given arguments plus -s3.config. With that file SeaweedFS
# refuses any other key, as a real S3 would. The file lives on tmpfs-like /tmp, never in the volume.
set -eu

: "${S3_ACCESS_KEY:?set S3_ACCESS_KEY (deploy/.env)}"
: "${S3_SECRET_KEY:?set S3_SECRET_KEY (deploy/.env)}"
# The keys go into JSON unescaped: allow only characters that need no escaping.
for key in "$S3_ACCESS_KEY" "$S3_SECRET_KEY"; do
  case $key in
    *[!A-Za-z0-9+/=_.-]*) echo "S3 keys may hold only A-Z a-z 0-9 + / = _ . -" >&2; exit 1 ;;
  esac
done

config=${S3_IDENTITIES_FILE:-/tmp/s3-identities.json}
umask 077
cat >"$config" <<EOF
{"identities": [{"name": "exportfarm",
  "credentials": [{"accessKey": "$S3_ACCESS_KEY", "secretKey": "$S3_SECRET_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF

exec "${WEED:-/usr/bin/weed}" "$@" -s3.config="$config"
