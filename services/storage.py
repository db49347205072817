"""Object storage for published exports: one small interface, an S3 store and an embedded local one.

Both stores take '/'-separated keys relative to the store (``<prefix>/model.onnx``), record each
object's full sha256 so a publish can be verified whatever the server computes, and raise
``StorageError`` with a message that says what to check. The API, the workers and the tests use
``ArtifactStore`` only; which implementation they get is a deployment setting.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import hmac
import io
import logging
import os
import re
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import boto3
import botocore.config
import botocore.exceptions
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig

from exporter.packaging.package import sha256_file

T = TypeVar("T")
Guard = Callable[[], None]
logger = logging.getLogger(__name__)

# S3 metadata key that carries an object's full sha256 (hex): S3 itself only keeps per-part
# checksums for multipart uploads, so this is what lets a reader verify a whole object.
SHA256_METADATA = "sha256"
_UNSAFE_KEY_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


class StorageError(Exception):
    """Object storage failed or refused; the message names the store and what to check."""


class PreconditionFailed(StorageError):
    """A conditional write was refused: the object is not (any more) what the writer expected."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object: its size, its sha256 (hex) when recorded, and its
    entity tag (a version stamp a conditional write can name; S3's ETag)."""

    size: int
    sha256: str | None
    etag: str | None = None


@dataclasses.dataclass(frozen=True)
class Precondition:
    """What a write expects to replace: no object (``etag`` None), or the object with ``etag``.

    The store checks it atomically with the write (S3 ``If-None-Match: *`` / ``If-Match``), so a
    request that reaches the server late, after another writer changed the key, is refused there
    with ``PreconditionFailed`` instead of overwriting (DESIGN.md, Publishing: fenced writes).
    """

    etag: str | None

    @classmethod
    def of(cls, info: ObjectInfo | None) -> Precondition:
        """Expect exactly what ``info`` (a head of the key) saw: absent, or that version."""
        return cls(None if info is None else info.etag)


def check_key(key: str, *, prefix: bool = False) -> str:
    """Return ``key`` if it is a safe relative object key, else raise ``StorageError``.

    Keys become file paths in ``LocalStore`` and URL paths everywhere, so a leading '/', a '..'
    or '.' segment, a backslash or a control character is refused rather than interpreted. With
    ``prefix`` an empty key (the whole store) is allowed.
    """
    if not key:
        if prefix:
            return key
        raise StorageError("empty object key")
    segments = key.removesuffix("/").split("/") if prefix else key.split("/")
    if key.startswith("/") or _UNSAFE_KEY_CHARS.search(key) or any(s in ("", ".", "..") for s in segments):
        raise StorageError(f"unsafe object key {key!r}: use a relative '/'-separated path without '.' or '..'")
    return key


def _no_guard() -> None:
    pass


def _check_directory_prefix(prefix: str) -> str:
    """Deleting by prefix is only allowed on a whole 'directory', so 'a/b' can never take 'a/bc'."""
    check_key(prefix, prefix=True)
    if not prefix.endswith("/"):
        raise StorageError(f"delete_prefix needs a non-empty prefix ending in '/', got {prefix!r}")
    return prefix


class _GuardedReader(io.RawIOBase):
    """A file that calls ``guard()`` before every read, for uploads that must stop the moment it raises."""

    def __init__(self, raw: BinaryIO, guard: Guard):
        self._raw, self._guard = raw, guard

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self._guard()
        return self._raw.read(size)

    def readinto(self, buffer) -> int:
        self._guard()
        return self._raw.readinto(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()


class ArtifactStore(abc.ABC):
    """Where exports are published: put, read, list, delete and hand out time-limited links."""

    @abc.abstractmethod
    def put_file(self, key: str, path: Path, sha256: str, guard: Guard | None = None,
                 expect: Precondition | None = None) -> ObjectInfo:
        """Upload the file at ``path`` as ``key`` if its content hashes to ``sha256``.

        The file is hashed before it is stored, so bytes that changed since the caller computed
        ``sha256`` (a manifest written earlier) are refused with ``StorageError`` instead of being
        published under a checksum they do not have. The sha256 is recorded with the object.
        ``guard()`` is called before and while the bytes go out; whatever it raises aborts the
        upload, and no object is created (a worker that lost its job's lease stops mid-file).
        With ``expect`` the write only lands if the key still holds what it names (else
        ``PreconditionFailed``), however late the request reaches the store.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream",
                  guard: Guard | None = None, expect: Precondition | None = None) -> ObjectInfo:
        """Store ``data`` as ``key`` (replacing any object there), recording its sha256; ``guard``
        and ``expect`` as for put_file."""

    @abc.abstractmethod
    def delete_key(self, key: str, expect: Precondition | None = None, guard: Guard | None = None) -> None:
        """Delete one object (no error if it is absent); with ``expect`` (an etag) only that version:
        ``PreconditionFailed`` if the key was replaced since. ``guard()`` is asked before the request
        (and before every retry), as for a write: whatever it raises, nothing is deleted."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """Read a whole object into memory (for small objects such as manifests); None if absent."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and sha256 of ``key`` without reading it; None when there is no such object."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """All keys that start with ``prefix`` (a plain string match), sorted."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (which must end in '/'); returns how many."""

    @abc.abstractmethod
    def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        """A URL anyone can GET ``key`` from for ``expires_s`` seconds, without credentials."""

    @abc.abstractmethod
    def check(self) -> None:
        """Readiness probe: return if the store can be used now, else raise a clear ``StorageError``."""

    @abc.abstractmethod
    def ensure_bucket(self) -> None:
        """Create the bucket (or root directory) if it does not exist yet; idempotent."""


# --- S3 -------------------------------------------------------------------------------------------

# Failures that mean "could not talk to the endpoint" (refused, reset, timed out): worth waiting for.
_UNREACHABLE = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)
_AUTH_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION_CODES = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
# Server-side failures a write may try again (its guard asked first); botocore retries them for reads.
_RETRYABLE_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}


def _client_error(err: Exception) -> botocore.exceptions.ClientError | None:
    """The S3 error response behind ``err``; boto3's upload_file wraps it in S3UploadFailedError."""
    if isinstance(err, S3UploadFailedError):
        err = err.__context__
    return err if isinstance(err, botocore.exceptions.ClientError) else None


def _error_code(err: botocore.exceptions.ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _server_sha256(response: dict) -> str | None:
    """The server's own full-object sha256 (hex), if it has one: multipart objects only get a
    composite checksum of their parts ('...-N'), which is not the sha256 of the content."""
    checksum = response.get("ChecksumSHA256")
    if not checksum or "-" in checksum or response.get("ChecksumType") == "COMPOSITE":
        return None
    return base64.b64decode(checksum).hex()


class S3Store(ArtifactStore):
    """An S3-compatible bucket (AWS, SeaweedFS, MinIO, ...) reached through boto3.

    Files go up with boto3's managed transfer, multipart above ``multipart_threshold_bytes``, each
    part carrying a ``checksum_algorithm`` checksum the server verifies on receipt (pass None for
    servers that do not support it); the whole file's sha256 is stored as metadata. botocore retries
    each request in standard mode; on top of that every operation is retried ``attempts`` times with
    exponential backoff (``backoff_s`` doubling, at most ``max_backoff_s``) while the endpoint is
    unreachable, so a storage restart during a publish delays it instead of failing it.

    Writes are fenced: they go through a client that never retries on its own, so every try of a
    write asks its guard first (a worker that lost its lease sends nothing more), and a write with a
    ``Precondition`` carries it as ``If-None-Match: *`` / ``If-Match`` on the request that creates
    the object (PutObject, or CompleteMultipartUpload), so the server itself refuses a request that
    arrives after another attempt changed the key.
    """

    def __init__(
        self,
        endpoint_url: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        region: str = "us-east-1",
        *,
        multipart_threshold_bytes: int = 64 << 20,
        multipart_chunk_bytes: int = 64 << 20,
        checksum_algorithm: str | None = "SHA256",
        attempts: int = 8,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        client_attempts: int = 3,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        public_endpoint_url: str | None = None,
    ) -> None:
        if attempts < 1 or client_attempts < 1:
            raise ValueError("attempts and client_attempts must be at least 1")
        self.endpoint_url = endpoint_url
        self.bucket = bucket
        self.region = region
        self._checksum_algorithm = checksum_algorithm
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        config = botocore.config.Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},  # SeaweedFS / MinIO do not serve bucket subdomains
            retries={"mode": "standard", "total_max_attempts": client_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
        )
        session = boto3.session.Session()
        client_args = {"endpoint_url": endpoint_url, "aws_access_key_id": access_key,
                       "aws_secret_access_key": secret_key, "region_name": region}
        self._client = session.client("s3", config=config, **client_args)
        self._write_client = session.client(
            "s3", config=config.merge(botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 1})),
            **client_args)
        # Preconditions of uploads in flight by key, added to the request that creates the object:
        # s3transfer's managed upload does not pass If-None-Match / If-Match through its arguments.
        self._expect: dict[str, Precondition] = {}
        for operation in ("PutObject", "CompleteMultipartUpload"):
            self._write_client.meta.events.register(f"before-parameter-build.s3.{operation}", self._add_precondition)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold_bytes, multipart_chunksize=multipart_chunk_bytes
        )
        # Links are signed for the host that will fetch them: the in-cluster endpoint, or a public one.
        self._presign_client = self._client if not public_endpoint_url else boto3.session.Session().client(
            "s3", endpoint_url=public_endpoint_url, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key, region_name=region, config=config,
        )

    def __repr__(self) -> str:
        return f"S3Store({self.endpoint_url!r}, bucket={self.bucket!r})"

    def _where(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint_url}"

    def _storage_error(self, action: str, err: Exception) -> StorageError:
        """Translate a boto3 failure into one line that says what to check, not a traceback."""
        client_err = _client_error(err)
        if client_err is None:
            return StorageError(f"cannot {action} in {self._where()}: {err}")
        code = _error_code(client_err)
        message = client_err.response.get("Error", {}).get("Message") or code
        if code in _PRECONDITION_CODES:
            return PreconditionFailed(
                f"{self._where()} refused to {action}: the object is no longer the version this write "
                f"expected ({code}); another writer changed it"
            )
        if code in _AUTH_CODES:
            return StorageError(
                f"S3 at {self.endpoint_url} refused the credentials for bucket {self.bucket!r} ({code}) "
                f"while trying to {action}: check the access key and secret key, and that they may use this bucket"
            )
        if code == "NoSuchBucket":
            return StorageError(f"{self._where()} does not exist: create it (ensure_bucket) or fix the bucket name")
        return StorageError(f"cannot {action} in {self._where()}: {code}: {message}")

    def _add_precondition(self, params: dict, **_kwargs) -> None:
        params.update(self._precondition_args(self._expect.get(params.get("Key"))))

    @staticmethod
    def _precondition_args(expect: Precondition | None) -> dict:
        if expect is None:
            return {}
        return {"IfNoneMatch": "*"} if expect.etag is None else {"IfMatch": expect.etag}

    def _call(self, action: str, operation: Callable[[], T], guard: Guard | None = None) -> T:
        """Run one S3 operation, waiting out an unreachable endpoint, and raise only StorageError.
        ``guard`` (a write's fence: does this attempt still own its job?) is asked before every try,
        so a worker cut off from the catalog and the store does not write once S3 comes back after
        its lease was given away; whatever it raises ends the retries. A guarded write also tries
        again after a server error (5xx, SlowDown), which its client does not retry by itself."""
        attempt = 1
        while True:
            if guard is not None:
                guard()
            try:
                return operation()
            except (*_UNREACHABLE, botocore.exceptions.ClientError, S3UploadFailedError) as err:
                client_err = _client_error(err)
                server_busy = client_err is not None and _error_code(client_err) in _RETRYABLE_CODES
                if not (isinstance(err, _UNREACHABLE) or (guard is not None and server_busy)):
                    raise self._storage_error(action, err) from None
                if attempt >= self._attempts:
                    raise StorageError(
                        f"cannot reach S3 to {action} in {self._where()} after {attempt} attempts ({err}): "
                        "check the endpoint URL and that the server is up"
                    ) from None
                delay = min(self._backoff_s * 2 ** (attempt - 1), self._max_backoff_s)
                logger.warning(
                    "cannot reach S3 at %s to %s (attempt %d of %d): %s; retrying in %.1f s",
                    self.endpoint_url, action, attempt, self._attempts, err, delay,
                )
                time.sleep(delay)
                attempt += 1

    def _checksum_args(self) -> dict:
        return {"ChecksumAlgorithm": self._checksum_algorithm} if self._checksum_algorithm else {}

    def put_file(self, key: str, path: Path, sha256: str, guard: Guard | None = None,
                 expect: Precondition | None = None) -> ObjectInfo:
        check_key(key)
        path = Path(path)
        guard = guard or _no_guard
        guard()
        actual = sha256_file(path)
        if actual != sha256:
            raise StorageError(
                f"{path} hashes to sha256 {actual}, not the expected {sha256}: "
                f"the file changed after it was checksummed; refusing to upload it as {key}"
            )
        extra = {"Metadata": {SHA256_METADATA: sha256}, **self._checksum_args()}
        guard()

        def upload() -> None:
            # The guard runs on every read of the body and on s3transfer's progress callbacks (every
            # 256 KiB sent, per part); whatever it raises aborts the request, or the whole multipart
            # upload, before the object exists.
            with path.open("rb") as raw:
                self._write_client.upload_fileobj(_GuardedReader(raw, guard), self.bucket, key, ExtraArgs=extra,
                                                  Config=self._transfer, Callback=lambda _sent: guard())

        if expect is not None:
            self._expect[key] = expect
        try:
            self._call(f"upload {key}", upload, guard)
        finally:
            self._expect.pop(key, None)
        return ObjectInfo(path.stat().st_size, sha256)

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream",
                  guard: Guard | None = None, expect: Precondition | None = None) -> ObjectInfo:
        check_key(key)
        sha256 = hashlib.sha256(data).hexdigest()
        response = self._call(
            f"upload {key}",
            lambda: self._write_client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType=content_type,
                Metadata={SHA256_METADATA: sha256}, **self._checksum_args(), **self._precondition_args(expect),
            ),
            guard or _no_guard,
        )
        return ObjectInfo(len(data), sha256, response.get("ETag"))

    def get_bytes(self, key: str) -> bytes | None:
        check_key(key)

        def read() -> bytes | None:
            try:
                return self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except botocore.exceptions.ClientError as err:
                if _error_code(err) in _MISSING_CODES:
                    return None
                raise

        return self._call(f"read {key}", read)

    def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        checksum_mode = {"ChecksumMode": "ENABLED"} if self._checksum_algorithm else {}

        def head_object() -> dict | None:
            try:
                return self._client.head_object(Bucket=self.bucket, Key=key, **checksum_mode)
            except botocore.exceptions.ClientError as err:
                if _error_code(err) in _MISSING_CODES:
                    return None
                raise

        response = self._call(f"look up {key}", head_object)
        if response is None:
            return None
        # Prefer the server's own checksum of the content; multipart objects only have ours.
        sha256 = _server_sha256(response) or response.get("Metadata", {}).get(SHA256_METADATA)
        return ObjectInfo(response["ContentLength"], sha256, response.get("ETag"))

    def list_keys(self, prefix: str = "") -> list[str]:
        check_key(prefix, prefix=True)

        def list_all() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            return sorted(obj["Key"] for page in pages for obj in page.get("Contents", ()))

        return self._call(f"list {prefix or '/'}", list_all)

    def delete_key(self, key: str, expect: Precondition | None = None, guard: Guard | None = None) -> None:
        check_key(key)
        condition = {"IfMatch": expect.etag} if expect is not None and expect.etag else {}
        client = self._write_client if condition else self._client

        def delete() -> None:
            try:
                client.delete_object(Bucket=self.bucket, Key=key, **condition)
            except botocore.exceptions.ClientError as err:
                if not (condition and _error_code(err) in _MISSING_CODES):
                    raise  # a version that is already gone is deleted

        self._call(f"delete {key}", delete, guard)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list_keys(_check_directory_prefix(prefix))
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = {"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True}
            response = self._call(
                f"delete {prefix}", functools.partial(self._client.delete_objects, Bucket=self.bucket, Delete=batch)
            )
            if errors := response.get("Errors"):
                first = errors[0]
                raise StorageError(
                    f"cannot delete {len(errors)} objects under {prefix} in {self._where()}: "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
        return len(keys)

    def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        check_key(key)
        if expires_s <= 0:
            raise ValueError(f"expires_s must be positive, got {expires_s}")
        return self._presign_client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
        )

    def _bucket_exists(self) -> bool:
        """Whether the bucket exists (HeadBucket), with no retry loop of ours: a probe must answer promptly."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return True
        except botocore.exceptions.ClientError as err:
            if _error_code(err) in ("404", "NoSuchBucket"):
                return False
            raise self._storage_error("open the bucket", err) from None
        except _UNREACHABLE as err:
            raise StorageError(
                f"cannot reach S3 at {self.endpoint_url} (bucket {self.bucket!r}): {err}; "
                "check the endpoint URL and that the server is up"
            ) from None

    def check(self) -> None:
        if not self._bucket_exists():
            raise StorageError(f"{self._where()} does not exist: create it (ensure_bucket) or fix the bucket name")

    def ensure_bucket(self) -> None:
        if self._bucket_exists():
            return
        location = {} if self.region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": self.region}
        }
        self._call("create the bucket", lambda: self._client.create_bucket(Bucket=self.bucket, **location))


# --- local directory ------------------------------------------------------------------------------


def local_signature(secret: str, key: str, expires: int) -> str:
    """HMAC-SHA256 (hex) of a local link: binds the key and its expiry time to ``secret``."""
    return hmac.new(secret.encode(), f"{key}\n{expires}".encode(), hashlib.sha256).hexdigest()


def verify_local_signature(secret: str, key: str, expires: int | str, signature: str, now: float | None = None) -> bool:
    """True if ``signature`` was made by ``LocalStore.presigned_url`` for ``key`` and has not expired.

    ``expires`` and ``signature`` come straight from a request's query string, so malformed values
    are a plain False. The comparison is constant-time so a caller cannot guess a signature byte
    by byte from response times.
    """
    try:
        expires = int(expires)
    except (TypeError, ValueError):
        return False
    if expires < (time.time() if now is None else now):
        return False
    # bytes: compare_digest refuses a str with non-ASCII characters (a TypeError, a 500 for the caller)
    return hmac.compare_digest(local_signature(secret, key, expires).encode(), str(signature).encode("utf-8", "replace"))


class LocalStore(ArtifactStore):
    """The embedded default: objects are files under ``root``, links are HMAC-signed API URLs.

    Layout: ``root/objects/<key>`` holds the bytes and ``root/sha256/<key>`` each object's sha256,
    so listing never sees checksums and no key can collide with one. Writes go to a temp file in
    ``root/tmp`` and are renamed into place, so a reader sees a whole object or none; the checksum
    is removed before an object is replaced and written after, so a crash can leave an object
    without a recorded sha256 (which a publish re-uploads) but never one with a wrong sha256.
    An object's etag is its file's identity and change time (a new one for every write, even of
    the same bytes); a conditional write checks it and renames under one lock on the store.
    """

    def __init__(self, root: Path, base_url: str, secret: str) -> None:
        if not secret:
            raise ValueError("LocalStore needs a non-empty signing secret")
        self.root = Path(root).absolute()
        self.base_url = base_url.rstrip("/")
        self._secret = secret

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _object_path(self, key: str) -> Path:
        return self.root / "objects" / check_key(key)

    def _sha256_path(self, key: str) -> Path:
        return self.root / "sha256" / check_key(key)

    def _temp_file(self, write: Callable[[BinaryIO], object]) -> Path:
        """A complete file written by ``write`` in ``root/tmp`` (same file system: renames are atomic)."""
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        return Path(name)

    def _rename_into(self, tmp: Path, target: Path) -> None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @staticmethod
    def _etag(path: Path) -> str | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'

    @contextlib.contextmanager
    def _locked(self):
        """The store's write lock: a conditional write's check and rename happen under it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _store(self, key: str, sha256: str, write: Callable[[BinaryIO], object], guard: Guard,
               expect: Precondition | None) -> str | None:
        """Write an object whole, then record its sha256 (see the class docstring for the order);
        returns its etag."""
        target, sha256_path = self._object_path(key), self._sha256_path(key)
        try:
            tmp = self._temp_file(write)
            try:
                guard()  # the last moment a write can still be refused: nothing is visible yet
                with self._locked():  # (the guard may wait for the catalog: never while holding the lock)
                    if expect is not None and self._etag(target) != expect.etag:
                        raise PreconditionFailed(
                            f"{key} under {self.root} is no longer the version this write expected "
                            f"({expect.etag or 'no object'}): another writer changed it")
                    sha256_path.unlink(missing_ok=True)
                    self._rename_into(tmp, target)
                    self._rename_into(self._temp_file(lambda f: f.write(sha256.encode())), sha256_path)
                    return self._etag(target)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as err:
            raise StorageError(f"cannot write {key} under {self.root}: {err}") from None

    def put_file(self, key: str, path: Path, sha256: str, guard: Guard | None = None,
                 expect: Precondition | None = None) -> ObjectInfo:
        path = Path(path)
        guard = guard or _no_guard
        guard()

        def copy(out: BinaryIO) -> None:
            """Hash while copying, so the bytes stored are exactly the bytes checked."""
            digest = hashlib.sha256()
            with path.open("rb") as src:
                while block := src.read(8 << 20):
                    guard()
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != sha256:
                raise StorageError(
                    f"{path} hashes to sha256 {digest.hexdigest()}, not the expected {sha256}: "
                    f"the file changed after it was checksummed; refusing to store it as {key}"
                )

        etag = self._store(key, sha256, copy, guard, expect)
        return ObjectInfo(path.stat().st_size, sha256, etag)

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream",
                  guard: Guard | None = None, expect: Precondition | None = None) -> ObjectInfo:
        guard = guard or _no_guard
        guard()
        sha256 = hashlib.sha256(data).hexdigest()
        etag = self._store(key, sha256, lambda f: f.write(data), guard, expect)
        return ObjectInfo(len(data), sha256, etag)

    def delete_key(self, key: str, expect: Precondition | None = None, guard: Guard | None = None) -> None:
        if guard is not None:
            guard()  # (it may wait for the catalog: never while holding the store's lock)
        # The checksum goes first, as in _store: an object may lack a sha256, never have a wrong one.
        try:
            with self._locked():
                current = self._etag(self._object_path(key))
                if expect is not None and expect.etag and current is not None and current != expect.etag:
                    raise PreconditionFailed(f"{key} under {self.root} was replaced since it was read: not deleted")
                self._sha256_path(key).unlink(missing_ok=True)
                self._object_path(key).unlink(missing_ok=True)
        except OSError as err:
            raise StorageError(f"cannot delete {key} under {self.root}: {err}") from None

    def get_bytes(self, key: str) -> bytes | None:
        path = self._object_path(key)
        return path.read_bytes() if path.is_file() else None

    def head(self, key: str) -> ObjectInfo | None:
        path = self._object_path(key)
        if not path.is_file():
            return None
        sha256_path = self._sha256_path(key)
        sha256 = sha256_path.read_text().strip() if sha256_path.is_file() else None
        return ObjectInfo(path.stat().st_size, sha256, self._etag(path))

    def list_keys(self, prefix: str = "") -> list[str]:
        check_key(prefix, prefix=True)
        objects = self.root / "objects"
        if not objects.is_dir():
            return []
        keys = (p.relative_to(objects).as_posix() for p in objects.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> int:
        count = len(self.list_keys(_check_directory_prefix(prefix)))
        for tree in ("objects", "sha256"):
            shutil.rmtree(self.root / tree / prefix, ignore_errors=True)
        return count

    def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        check_key(key)
        if expires_s <= 0:
            raise ValueError(f"expires_s must be positive, got {expires_s}")
        expires = int(time.time()) + expires_s
        query = urllib.parse.urlencode({"expires": expires, "signature": local_signature(self._secret, key, expires)})
        return f"{self.base_url}/files/{urllib.parse.quote(key)}?{query}"

    def verify_link(self, key: str, expires: int | str, signature: str) -> bool:
        """Whether a download link (key, expiry, signature from its query) was made here and is still valid."""
        return verify_local_signature(self._secret, key, expires, signature)

    def open_file(self, key: str) -> Path | None:
        """The file holding ``key``, for the API to stream after checking a signature; None if absent."""
        path = self._object_path(key)
        return path if path.is_file() else None

    def check(self) -> None:
        if not self.root.is_dir():
            raise StorageError(f"local store root {self.root} does not exist: run ensure_bucket() or fix DATA_DIR")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageError(f"local store root {self.root} is not writable: fix its permissions or DATA_DIR")

    def ensure_bucket(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(f"cannot create the local store root {self.root}: {err}") from None
