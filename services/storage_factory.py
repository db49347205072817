"""The artifact store the settings ask for: S3 when an endpoint is set, else a local directory."""

from __future__ import annotations

from services.settings import Settings
from services.storage import ArtifactStore, LocalStore, S3Store


def make_store(settings: Settings) -> ArtifactStore:
    if settings.s3_endpoint_url:
        return S3Store(
            settings.s3_endpoint_url, settings.s3_bucket, settings.s3_access_key or "", settings.s3_secret_key or "",
            settings.s3_region, multipart_threshold_bytes=settings.s3_multipart_threshold_bytes,
            multipart_chunk_bytes=settings.s3_multipart_chunk_bytes, attempts=settings.upload_attempts,
            backoff_s=settings.upload_backoff_s, public_endpoint_url=settings.s3_public_endpoint_url,
        )
    return LocalStore(settings.store_dir, settings.public_base_url.rstrip("/"), settings.signing_secret)
