"""The artifact store the settings ask for: S3 when an endpoint is set, else a local directory."""

from __future__ import annotations

import os
import secrets

from exporter.errors import ExportError
from services.settings import Settings
from services.storage import ArtifactStore, LocalStore, S3Store

SIGNING_KEY_FILE = "signing.key"


def make_store(settings: Settings, patient: bool = True) -> ArtifactStore:
    """The store; ``patient`` (workers) waits out an unreachable S3 for minutes, the API for seconds."""
    if settings.s3_endpoint_url:
        retry = ({"attempts": settings.upload_attempts, "backoff_s": settings.upload_backoff_s} if patient else
                 {"attempts": 1, "client_attempts": 1, "connect_timeout_s": 2.0, "read_timeout_s": 3.0})
        return S3Store(
            settings.s3_endpoint_url, settings.s3_bucket, settings.s3_access_key or "", settings.s3_secret_key or "",
            settings.s3_region, multipart_threshold_bytes=settings.s3_multipart_threshold_bytes,
            multipart_chunk_bytes=settings.s3_multipart_chunk_bytes, public_endpoint_url=settings.s3_public_endpoint_url,
            **retry,
        )
    return LocalStore(settings.store_dir, settings.public_base_url.rstrip("/"), signing_secret(settings))


def signing_secret(settings: Settings) -> str:
    """The secret local download links are signed with: SIGNING_SECRET, or in embedded mode one kept
    in DATA_DIR/signing.key (made once), so links outlive a restart of the API."""
    if settings.signing_secret:
        return settings.signing_secret
    if not settings.embedded:
        raise ExportError(
            "SIGNING_SECRET is not set: the local artifact store signs download links with it, and every API "
            "and worker process must share it; set one (at least 32 characters), or use S3 (S3_ENDPOINT_URL)")
    path = settings.data_dir / SIGNING_KEY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path.read_text().strip()
