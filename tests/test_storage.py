"""Object storage and publishing, against a real SeaweedFS S3 server and the local directory store.

Every store test runs on both implementations: they must behave the same, because which one a
deployment uses is only a setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from s3_server import HoldingProxy, SeaweedS3, free_ports

from exporter.errors import ExportError
from exporter.packaging.package import DATA_FILE, MANIFEST_FILE, MODEL_FILE, file_entry
from services.publish import export_prefix, files_match_store, publish_export, read_published_manifest, unpublish
from services.storage import (LocalStore, Precondition, PreconditionFailed, S3Store, StorageError,
                              verify_local_signature)

BUCKET = "exportfarm-test"
PART = 5 << 20  # the smallest multipart part S3 allows: files above it really go up in parts
SECRET = "local-signing-secret"
BASE_URL = "http://farm.test"


@pytest.fixture(scope="module")
def seaweed():
    with SeaweedS3() as server:
        yield server


def s3_store(server: SeaweedS3, bucket: str = BUCKET, secret_key: str | None = None, **kwargs) -> S3Store:
    """An S3Store on the test server that gives up quickly unless a test asks for patience."""
    options = {"attempts": 2, "backoff_s": 0.05, "client_attempts": 1,
               "multipart_threshold_bytes": PART, "multipart_chunk_bytes": PART} | kwargs
    return S3Store(options.pop("endpoint_url", server.endpoint_url), bucket, server.access_key, secret_key or server.secret_key, **options)


@pytest.fixture(scope="module")
def bucket(seaweed) -> str:
    s3_store(seaweed).ensure_bucket()
    return BUCKET


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    """Each implementation in turn; the S3 one only starts SeaweedFS when a test needs it."""
    if request.param == "local":
        local = LocalStore(tmp_path / "store", BASE_URL, SECRET)
        local.ensure_bucket()
        return local
    request.getfixturevalue("bucket")
    return s3_store(request.getfixturevalue("seaweed"))


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix, so tests sharing the bucket never see each other's objects."""
    return f"test-{uuid.uuid4().hex[:12]}/"


class RecordingStore:
    """Passes every call to ``store``; records the key of each completed put, in order, and runs
    ``after_put(key)`` after it (a test uses that to take S3 down in the middle of a publish)."""

    def __init__(self, store, after_put=None):
        self.store = store
        self.puts: list[str] = []
        self.after_put = after_put or (lambda key: None)

    def __getattr__(self, name):
        return getattr(self.store, name)

    def put_file(self, key, path, sha256, guard=None, expect=None):
        info = self.store.put_file(key, path, sha256, guard, expect)
        self.puts.append(key)
        self.after_put(key)
        return info

    def put_bytes(self, key, data, content_type="application/octet-stream", guard=None, expect=None):
        info = self.store.put_bytes(key, data, content_type, guard, expect)
        self.puts.append(key)
        self.after_put(key)
        return info


def make_export(directory: Path, data_bytes: int = 256 << 10) -> Path:
    """A small export directory as exporter.pipeline writes it: files plus a manifest vouching for them."""
    directory.mkdir(parents=True)
    (directory / DATA_FILE).write_bytes(os.urandom(data_bytes))
    (directory / MODEL_FILE).write_bytes(b"onnx graph " + os.urandom(64))
    (directory / "parity_report.json").write_text('{"passed": true}\n')
    (directory / "parity_report.md").write_text("# parity\nall gates passed\n")
    names = [DATA_FILE, MODEL_FILE, "parity_report.json", "parity_report.md"]
    manifest = {
        "schema": 1,
        "export_id": uuid.uuid4().hex,
        "request": {"model": "org/tiny-llama@main", "dtype": "fp16", "ep": "cuda", "static_cache": True,
                    "max_seq_len": 128, "variant": None},
        "variant": "attn_static",
        "source": {"kind": "hub", "path": "/cache/snapshots/0123abcd", "repo_id": "org/tiny-llama",
                   "revision": "0123abcd"},
        "versions": {"onnxruntime": "1.32.0"},
        "files": {name: file_entry(directory / name) for name in names},
        "status": "ready",
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return directory


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the store interface, on both implementations ----------------------------------------------


def test_round_trip(store, prefix):
    info = store.put_bytes(prefix + "a/one.json", b'{"x": 1}', "application/json")
    store.put_bytes(prefix + "a/two.bin", b"\x00" * 10)
    store.put_bytes(prefix + "b/three.bin", b"3")

    assert info.size == 8 and info.sha256 == sha256(b'{"x": 1}')
    assert store.get_bytes(prefix + "a/one.json") == b'{"x": 1}'
    assert store.head(prefix + "a/two.bin").size == 10
    assert store.head(prefix + "a/two.bin").sha256 == sha256(b"\x00" * 10)
    assert store.head(prefix + "a/missing") is None
    assert store.get_bytes(prefix + "a/missing") is None
    assert store.list_keys(prefix + "a/") == [prefix + "a/one.json", prefix + "a/two.bin"]

    assert store.delete_prefix(prefix + "a/") == 2
    assert store.list_keys(prefix) == [prefix + "b/three.bin"]


def test_put_file_records_its_sha256(store, prefix, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(3 * PART // 2))

    store.put_file(prefix + "weights.bin", path, sha256(path.read_bytes()))

    assert store.head(prefix + "weights.bin").sha256 == sha256(path.read_bytes())
    assert store.get_bytes(prefix + "weights.bin") == path.read_bytes()


def test_put_file_refuses_a_file_that_does_not_hash_to_its_sha256(store, prefix, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"changed after the manifest was written")

    with pytest.raises(StorageError, match="refusing"):
        store.put_file(prefix + "weights.bin", path, sha256(b"what the manifest says"))
    assert store.head(prefix + "weights.bin") is None


@pytest.mark.parametrize("key", ["../escape", "/absolute", "a/../../b", "a//b", "a\\b"])
def test_unsafe_keys_are_refused(store, key):
    with pytest.raises(StorageError, match="unsafe object key"):
        store.put_bytes(key, b"x")


def test_delete_prefix_only_takes_whole_directories(store, prefix):
    store.put_bytes(prefix + "ab", b"x")
    with pytest.raises(StorageError, match="ending in '/'"):
        store.delete_prefix(prefix + "a")
    with pytest.raises(StorageError):
        store.delete_prefix("")
    assert store.list_keys(prefix) == [prefix + "ab"]


# --- S3 specifics --------------------------------------------------------------------------------


def test_s3_multipart_upload_keeps_the_sha256(seaweed, bucket, prefix, tmp_path):
    path = tmp_path / DATA_FILE
    path.write_bytes(os.urandom(2 * PART + 12345))
    store = s3_store(seaweed)

    store.put_file(prefix + DATA_FILE, path, sha256(path.read_bytes()))

    # A multipart object's ETag ends in "-<parts>"; with ChecksumAlgorithm=SHA256 SeaweedFS keeps a
    # composite SHA256 of the three parts, which is why the file's own sha256 travels as metadata.
    raw = seaweed.client().head_object(Bucket=bucket, Key=prefix + DATA_FILE, ChecksumMode="ENABLED")
    assert raw["ETag"].strip('"').endswith("-3")
    assert raw["ChecksumSHA256"].endswith("-3")
    assert store.head(prefix + DATA_FILE).sha256 == sha256(path.read_bytes())
    assert sha256(store.get_bytes(prefix + DATA_FILE)) == sha256(path.read_bytes())


def test_s3_wrong_secret_key_is_refused_clearly(seaweed, bucket, prefix, tmp_path):
    store = s3_store(seaweed, secret_key="not-the-secret")
    path = tmp_path / "f"
    path.write_bytes(b"x")

    refused = f"{re.escape(seaweed.endpoint_url)} refused the credentials for bucket '{BUCKET}'"
    with pytest.raises(StorageError, match=refused):
        store.check()
    with pytest.raises(StorageError, match="check the access key and secret key"):
        store.put_file(prefix + "f", path, sha256(b"x"))
    with pytest.raises(StorageError, match="refused the credentials"):
        store.put_bytes(prefix + "g", b"x")


def test_s3_check_says_what_is_wrong(seaweed, bucket):
    s3_store(seaweed).check()

    missing = s3_store(seaweed, bucket=f"missing-{uuid.uuid4().hex[:8]}")
    with pytest.raises(StorageError, match="does not exist: create it"):
        missing.check()
    missing.ensure_bucket()
    missing.check()

    nobody = S3Store(f"http://127.0.0.1:{free_ports(1)[0]}", BUCKET, "k", "s", client_attempts=1)
    with pytest.raises(StorageError, match=r"cannot reach S3 .*check the endpoint URL"):
        nobody.check()


def test_s3_presigned_url_serves_plain_http(seaweed, bucket, prefix):
    store = s3_store(seaweed)
    store.put_bytes(prefix + "report.md", b"# parity\n")

    url = store.presigned_url(prefix + "report.md", expires_s=60)
    assert urllib.request.urlopen(url).read() == b"# parity\n"

    tampered = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(tampered)
    assert refused.value.code == 403


def test_s3_presigned_url_expires(seaweed, bucket, prefix):
    store = s3_store(seaweed)
    store.put_bytes(prefix + "report.md", b"# parity\n")
    url = store.presigned_url(prefix + "report.md", expires_s=1)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url).read()
        except urllib.error.HTTPError as err:
            assert err.code == 403
            return
        time.sleep(0.2)
    pytest.fail("a presigned URL was still served 10 s after it expired")


# --- LocalStore specifics ------------------------------------------------------------------------


def test_local_presigned_url_is_signed_for_its_key_and_time(tmp_path):
    store = LocalStore(tmp_path, BASE_URL, SECRET)
    store.put_bytes("m/r/model.onnx", b"graph")

    url = urllib.parse.urlsplit(store.presigned_url("m/r/model.onnx", expires_s=60))
    query = dict(urllib.parse.parse_qsl(url.query))
    key = urllib.parse.unquote(url.path.removeprefix("/files/"))

    assert f"{url.scheme}://{url.netloc}" == BASE_URL and key == "m/r/model.onnx"
    assert store.open_file(key).read_bytes() == b"graph"
    assert store.open_file("m/r/absent") is None
    assert verify_local_signature(SECRET, key, query["expires"], query["signature"])
    tampered = ("1" if query["signature"][0] == "0" else "0") + query["signature"][1:]
    assert not verify_local_signature(SECRET, key, query["expires"], tampered)
    assert not verify_local_signature(SECRET, "m/r/model.onnx.data", query["expires"], query["signature"])
    assert not verify_local_signature(SECRET, key, int(query["expires"]) + 1, query["signature"])
    assert not verify_local_signature("another-secret", key, query["expires"], query["signature"])
    assert not verify_local_signature(SECRET, key, query["expires"], query["signature"], now=int(query["expires"]) + 1)
    assert not verify_local_signature(SECRET, key, "soon", query["signature"])


def test_local_store_never_shows_a_partial_object(tmp_path):
    store = LocalStore(tmp_path, BASE_URL, SECRET)
    store.put_bytes("k/v", b"old")
    bad = tmp_path / "bad"
    bad.write_bytes(b"new bytes")

    with pytest.raises(StorageError):
        store.put_file("k/v", bad, sha256(b"something else"))

    assert store.get_bytes("k/v") == b"old" and store.head("k/v").sha256 == sha256(b"old")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_local_check_refuses_a_missing_root(tmp_path):
    store = LocalStore(tmp_path / "nowhere", BASE_URL, SECRET)
    with pytest.raises(StorageError, match="does not exist"):
        store.check()
    store.ensure_bucket()
    store.check()


# --- publishing ----------------------------------------------------------------------------------


class LeaseLost(Exception):
    pass


@pytest.mark.parametrize("size", [64 << 10, 3 * PART])  # one request, and a multipart upload
def test_a_guard_that_raises_mid_upload_leaves_no_object(store, prefix, tmp_path, size):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(size))
    calls = []

    def guard():  # the lease is lost while the bytes go out
        calls.append(1)
        if len(calls) > 2:
            raise LeaseLost()

    with pytest.raises(LeaseLost):
        store.put_file(prefix + "blob", path, sha256(path.read_bytes()), guard)
    assert store.head(prefix + "blob") is None and store.list_keys(prefix) == []
    with pytest.raises(LeaseLost):
        store.put_bytes(prefix + "manifest.json", b"{}", guard=guard)
    assert store.list_keys(prefix) == []


def test_unpublish_withdraws_the_manifest_first(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    published = publish_export(store, export, prefix, status="ready", attempt=1)
    order = []

    class Watching:
        def __getattr__(self, name):
            return getattr(store, name)

        def put_bytes(self, key, data, *args, **kwargs):
            order.append(("put", key.removeprefix(prefix), json.loads(data)["status"]))
            return store.put_bytes(key, data, *args, **kwargs)

        def delete_key(self, key, expect=None, guard=None):
            order.append(("delete", key.removeprefix(prefix)))
            return store.delete_key(key, expect, guard)

    assert unpublish(Watching(), prefix, export_id=published.manifest["export_id"], reason="cancelled") == 4
    assert order[0] == ("put", MANIFEST_FILE, "withdrawn")  # the prefix stops being an export first
    assert sorted(order[1:]) == sorted(("delete", name) for name in published.manifest["files"])
    # The withdrawn manifest stays (a tombstone): no export is read from it, and none is published over it.
    assert store.list_keys(prefix) == [prefix + MANIFEST_FILE] and read_published_manifest(store, prefix) is None
    with pytest.raises(StorageError, match="was withdrawn .*cancelled"):
        publish_export(store, export, prefix, status="ready", attempt=2)


def test_an_earlier_attempts_late_cleanup_leaves_the_takeovers_export(store, prefix, tmp_path):
    """Attempt 1, failing, withdraws its uploads, but the request arrives after attempt 2 took the
    job over and published: nothing of attempt 2's export goes (it once wrote its tombstone over the
    takeover's ready manifest and deleted the files under it)."""
    first = make_export(tmp_path / "attempt1")
    second = _another_attempt(first, tmp_path / "attempt2")
    publish_export(store, first, prefix, status="ready", attempt=1)
    takeover = publish_export(store, second, prefix, status="ready", attempt=2)
    export_id = takeover.manifest["export_id"]

    assert unpublish(store, prefix, export_id=export_id, reason="attempt 1 ended failed", final=False, attempt=1) == 0
    assert read_published_manifest(store, prefix) == takeover.manifest
    assert files_match_store(store, prefix, takeover.manifest)

    # A file deleted in the version its lister saw: one replaced since is left to whoever wrote it.
    key = prefix + "parity_report.json"
    seen = store.head(key)
    store.put_bytes(key, b'{"rewritten": true}')
    with pytest.raises(PreconditionFailed):
        store.delete_key(key, expect=Precondition(seen.etag))
    assert store.get_bytes(key) == b'{"rewritten": true}'


def test_a_cleanup_that_stalls_after_its_withdrawal_deletes_nothing_the_takeover_published(store, prefix, tmp_path):
    """Attempt 1, failing, withdraws its export and stalls before deleting the files; its lease runs
    out meanwhile and attempt 2 publishes over the withdrawal, keeping the weights it finds identical.
    Attempt 1 comes back: its lease refuses every delete. It once asked only before the withdrawal,
    and deleted the takeover's files from under its ready manifest."""
    first = make_export(tmp_path / "attempt1")
    second = _another_attempt(first, tmp_path / "attempt2")
    export_id = publish_export(store, first, prefix, status="ready", attempt=1).manifest["export_id"]
    lease = {"live": True}
    takeover = []

    def guard():
        if not lease["live"]:
            raise LeaseLost()

    class StallsAfterWithdrawing:
        def __getattr__(self, name):
            return getattr(store, name)

        def put_bytes(self, key, data, *args, **kwargs):
            info = store.put_bytes(key, data, *args, **kwargs)
            if json.loads(data)["status"] == "withdrawn":  # stopped here, long enough to lose the job
                lease["live"] = False
                takeover.append(publish_export(store, second, prefix, status="ready", attempt=2))
            return info

    with pytest.raises(LeaseLost):
        unpublish(StallsAfterWithdrawing(), prefix, guard, export_id, "attempt 1 ended failed", final=False, attempt=1)
    [published] = takeover
    assert {DATA_FILE, MODEL_FILE} <= set(published.skipped)  # attempt 1's objects, now the takeover's
    assert read_published_manifest(store, prefix) == published.manifest
    assert files_match_store(store, prefix, published.manifest)


@pytest.mark.parametrize("attempt", [2, None])  # None: a publish outside the farm (no attempt number)
def test_a_later_attempt_publishes_over_a_failed_attempts_own_cleanup(store, prefix, tmp_path, attempt):
    """Attempt 1 failed during publish and withdrew its uploads, but had lost the job before the
    catalog recorded the failure: attempt 2 publishes over that withdrawal (not over a cancel's)."""
    export = make_export(tmp_path / "export")
    manifest = json.loads((export / MANIFEST_FILE).read_text())
    publish_export(store, export, prefix, status="ready", attempt=1)
    unpublish(store, prefix, export_id=manifest["export_id"], reason="attempt 1 ended failed", final=False)
    assert read_published_manifest(store, prefix) is None
    result = publish_export(store, export, prefix, status="ready", attempt=attempt)
    assert not result.already_published
    assert read_published_manifest(store, prefix) == result.manifest
    assert result.manifest["published"]["attempt"] == attempt
    assert files_match_store(store, prefix, result.manifest)


def test_conditional_writes_refuse_a_key_that_changed(store, prefix, tmp_path):
    key = prefix + "object"
    first = store.put_bytes(key, b"one", expect=Precondition(None))
    with pytest.raises(PreconditionFailed):  # expected no object: there is one now
        store.put_bytes(key, b"two", expect=Precondition(None))
    second = store.put_bytes(key, b"two", expect=Precondition.of(store.head(key)))
    assert second.etag != first.etag and store.head(key).etag == second.etag
    with pytest.raises(PreconditionFailed):  # expected the first version: it was replaced
        store.put_bytes(key, b"three", expect=Precondition(first.etag))
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 * PART))  # multipart on S3: the condition rides on the completing request
    with pytest.raises(PreconditionFailed):
        store.put_file(key, big, sha256(big.read_bytes()), expect=Precondition(None))
    assert store.get_bytes(key) == b"two"
    store.put_file(key, big, sha256(big.read_bytes()), expect=Precondition(second.etag))
    assert store.head(key).sha256 == sha256(big.read_bytes())


def test_every_write_request_is_preceded_by_its_guard(tmp_path):
    """A server that takes requests and never answers: each try of a guarded write is one request,
    after one guard check (botocore's own retry once sent a second copy nobody had fenced)."""
    requests, guards = [], []
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: requests.extend(
                chunk for chunk in iter(lambda: c.recv(65536), b"") if chunk.startswith(b"PUT ")), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        store = S3Store(f"http://127.0.0.1:{server.getsockname()[1]}", BUCKET, "key", "secret", attempts=2,
                        backoff_s=0.05, client_attempts=3, read_timeout_s=0.5)
        with pytest.raises(StorageError, match="after 2 attempts"):
            store.put_bytes("k/manifest.json", b"{}", guard=lambda: guards.append(1))
        wait_until(lambda: len(requests) >= 2)
        time.sleep(0.5)
        assert len(requests) == len(guards) == 2
    finally:
        server.close()


def _another_attempt(export: Path, directory: Path) -> Path:
    """The same export as a later attempt makes it: same id and weights, its own measured report
    (as benchmark.json differs between runs)."""
    shutil.copytree(export, directory)
    (directory / "parity_report.json").write_text(f'{{"passed": true, "run": "{uuid.uuid4().hex}"}}\n')
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"]["parity_report.json"] = file_entry(directory / "parity_report.json")
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return directory


@pytest.mark.parametrize("lands", ["after the takeover published", "before the takeover published"])
def test_a_lost_attempts_late_manifest_write_cannot_replace_the_takeovers(seaweed, bucket, prefix, tmp_path, lands):
    """Attempt 1's manifest request reaches S3 only after its lease was given away (held in a
    partitioned network here, a real TCP proxy in front of SeaweedFS). Unfenced, it replaced the
    takeover's manifest: the catalog's sha256 of parity_report.json disagreed with the store's."""
    first_dir = make_export(tmp_path / "attempt1")
    second_dir = _another_attempt(first_dir, tmp_path / "attempt2")
    direct = s3_store(seaweed)
    with HoldingProxy(seaweed.endpoint_url) as proxy:
        cut_off = s3_store(seaweed, endpoint_url=proxy.url, attempts=1, client_attempts=1, read_timeout_s=1.0)

        class Partitioned(RecordingStore):
            def put_bytes(self, key, *args, **kwargs):
                proxy.hold()  # the network loses the manifest request, for now
                return self.store.put_bytes(key, *args, **kwargs)

        with pytest.raises(StorageError, match="cannot reach S3"):
            publish_export(Partitioned(cut_off), first_dir, prefix, status="ready", attempt=1)
        answered = len(proxy.answers)
        if lands.startswith("before"):
            proxy.release()
            wait_until(lambda: read_published_manifest(direct, prefix) is not None)
        takeover = publish_export(direct, second_dir, prefix, status="ready", attempt=2)
        proxy.release()
        wait_until(lambda: len(proxy.answers) > answered)  # attempt 1's request did reach S3, and was answered

    stored = read_published_manifest(direct, prefix)
    assert stored == takeover.manifest and stored["published"]["attempt"] == 2
    assert files_match_store(direct, prefix, stored)
    late = proxy.answers[answered]
    assert late.startswith(b"HTTP/1.1 412" if lands.startswith("after") else b"HTTP/1.1 200"), \
        [a[:40] for a in proxy.answers]


def test_publish_uploads_data_first_and_manifest_last(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    recording = RecordingStore(store)

    result = publish_export(recording, export, prefix, status="ready")

    names = [key.removeprefix(prefix) for key in recording.puts]
    assert names == [DATA_FILE, MODEL_FILE, "parity_report.json", "parity_report.md", MANIFEST_FILE]
    local_manifest = json.loads((export / MANIFEST_FILE).read_text())
    for name, entry in local_manifest["files"].items():
        assert sha256(store.get_bytes(prefix + name)) == entry["sha256"]
        assert store.head(prefix + name).size == entry["size"]
    published = read_published_manifest(store, prefix)
    assert published == result.manifest
    assert published["status"] == "ready" and published["published"]["prefix"] == prefix
    assert published["export_id"] == local_manifest["export_id"]


def test_publishing_again_is_a_no_op(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    first = publish_export(store, export, prefix, status="quarantined")
    recording = RecordingStore(store)

    again = publish_export(recording, export, prefix, status="quarantined")

    assert again.already_published and again.manifest == first.manifest
    assert recording.puts == []


def test_publish_skips_objects_that_are_already_there(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    entry = json.loads((export / MANIFEST_FILE).read_text())["files"][DATA_FILE]
    store.put_file(prefix + DATA_FILE, export / DATA_FILE, entry["sha256"])  # left by an interrupted publish

    result = publish_export(store, export, prefix, status="ready")

    assert result.skipped == [DATA_FILE]
    assert result.uploaded == [MODEL_FILE, "parity_report.json", "parity_report.md"]


def test_publish_refuses_a_file_that_does_not_match_the_manifest(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    (export / "parity_report.md").write_text("# parity\nedited after export\n")

    with pytest.raises(StorageError, match=r"parity_report\.md"):
        publish_export(store, export, prefix, status="ready")

    assert store.head(prefix + MANIFEST_FILE) is None
    assert read_published_manifest(store, prefix) is None


def test_publish_verifies_what_the_store_holds_before_the_manifest(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    manifest = json.loads((export / MANIFEST_FILE).read_text())
    manifest["files"][MODEL_FILE]["size"] += 1  # right bytes, wrong size: only the check after upload sees it
    (export / MANIFEST_FILE).write_text(json.dumps(manifest))

    with pytest.raises(StorageError, match=f"{MODEL_FILE} does not match the manifest after upload"):
        publish_export(store, export, prefix, status="ready")

    assert store.list_keys(prefix) == [prefix + MODEL_FILE, prefix + DATA_FILE]


def test_publish_needs_every_file_the_manifest_lists(store, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    (export / MODEL_FILE).unlink()

    with pytest.raises(ExportError, match=f"has no {MODEL_FILE}"):
        publish_export(store, export, prefix, status="ready")
    assert read_published_manifest(store, prefix) is None


def test_publish_refuses_another_export_at_the_same_prefix(store, prefix, tmp_path):
    publish_export(store, make_export(tmp_path / "one"), prefix, status="ready")
    with pytest.raises(StorageError, match="already holds export"):
        publish_export(store, make_export(tmp_path / "two"), prefix, status="ready")


def test_publish_waits_for_s3_to_come_back(seaweed, bucket, prefix, tmp_path, caplog):
    export = make_export(tmp_path / "export", data_bytes=PART + 1)
    store = s3_store(seaweed, attempts=30, backoff_s=0.2, max_backoff_s=0.5)
    outcome: dict = {}

    def publish() -> None:
        try:
            outcome["result"] = publish_export(store, export, prefix, status="ready")
        except Exception as err:  # handed to the test thread, which asserts on it
            outcome["error"] = err

    seaweed.stop()
    try:
        worker = threading.Thread(target=publish)
        worker.start()
        # S3 stays down until the publish has been turned away twice (or has given up).
        wait_until(lambda: retries_logged(caplog) >= 2 or not worker.is_alive())
    finally:
        seaweed.start()
    worker.join(timeout=30)

    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].uploaded == [DATA_FILE, MODEL_FILE, "parity_report.json", "parity_report.md"]
    assert read_published_manifest(store, prefix)["status"] == "ready"


def test_publish_that_loses_s3_leaves_no_manifest_and_resumes(seaweed, bucket, prefix, tmp_path):
    export = make_export(tmp_path / "export")
    store = s3_store(seaweed, attempts=2, backoff_s=0.05)

    def stop_after_the_weights(key: str) -> None:
        """S3 goes away right after the weights are uploaded, and stays away longer than we retry."""
        if key.endswith(DATA_FILE):
            seaweed.stop()

    dropping = RecordingStore(store, after_put=stop_after_the_weights)

    try:
        with pytest.raises(StorageError, match="cannot reach S3"):
            publish_export(dropping, export, prefix, status="ready")
    finally:
        seaweed.start()

    assert store.list_keys(prefix) == [prefix + DATA_FILE]
    resumed = publish_export(store, export, prefix, status="ready")
    assert resumed.skipped == [DATA_FILE]
    assert resumed.uploaded == [MODEL_FILE, "parity_report.json", "parity_report.md"]
    assert read_published_manifest(store, prefix)["export_id"] == resumed.manifest["export_id"]


def retries_logged(caplog) -> int:
    return sum("cannot reach S3" in record.getMessage() for record in caplog.records)


def wait_until(condition, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(0.05)


# --- key layout ----------------------------------------------------------------------------------


def manifest_for(model: str, source: dict, **request) -> dict:
    return {
        "export_id": "e0f1",
        "request": {"model": model, "dtype": "fp16", "ep": "cuda", "max_seq_len": None} | request,
        "variant": "gqa",
        "source": source,
        "versions": {"onnxruntime": "1.32.0"},
    }


def test_export_prefix_for_a_hub_model_at_a_revision():
    manifest = manifest_for(
        "Qwen/Qwen2.5-0.5B@main", {"kind": "hub", "repo_id": "Qwen/Qwen2.5-0.5B", "revision": "9a7c0de"}
    )
    assert export_prefix(manifest) == "Qwen/Qwen2.5-0.5B/9a7c0de/gqa-fp16-cuda/ort-1.32.0/e0f1/"

    static = manifest | {"variant": "attn_static", "request": manifest["request"] | {"max_seq_len": 4096}}
    assert export_prefix(static) == "Qwen/Qwen2.5-0.5B/9a7c0de/attn_static-fp16-cuda-ms4096/ort-1.32.0/e0f1/"


def test_export_prefix_for_a_local_checkpoint_uses_its_directory_name():
    source = {"kind": "local", "path": "/models/my llama (v2)", "repo_id": None, "revision": "local-00ff"}
    manifest = manifest_for("./my llama (v2)", source, dtype="fp32", ep="cpu")
    assert export_prefix(manifest) == "my-llama-v2/local-00ff/gqa-fp32-cpu/ort-1.32.0/e0f1/"


@pytest.mark.parametrize("model", ["../../etc", "org/../../x", "/org/name", "org//name"])
def test_export_prefix_refuses_path_traversal(model):
    manifest = manifest_for(model, {"kind": "hub", "repo_id": None, "revision": "abc"})
    with pytest.raises(StorageError):
        export_prefix(manifest)


def test_export_prefix_sanitizes_every_level():
    source = {"kind": "hub", "repo_id": "org/name", "revision": "../../main"}
    manifest = manifest_for("org/name", source) | {"export_id": "../id", "versions": {"onnxruntime": "1.32.0+cu12"}}
    prefix = export_prefix(manifest)
    assert ".." not in prefix and not prefix.startswith("/")
    assert prefix == "org/name/main/gqa-fp16-cuda/ort-1.32.0-cu12/id/"


def test_presigned_links_name_the_public_endpoint(seaweed):
    """Links are signed for the host clients use (S3_PUBLIC_ENDPOINT_URL), not the internal name."""
    public = seaweed.endpoint_url.replace("127.0.0.1", "localhost")
    store = S3Store(seaweed.endpoint_url, "public-links", seaweed.access_key, seaweed.secret_key,
                    public_endpoint_url=public, attempts=1)
    store.ensure_bucket()
    store.put_bytes("a/b.txt", b"hello")
    url = store.presigned_url("a/b.txt", 60)
    assert url.startswith(public)
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.read() == b"hello"


def test_workers_share_reference_runs_through_the_store(store, exported, tmp_path, monkeypatch):
    """A variant validated on a second worker (its own local cache) reads the reference run the first
    worker computed from the store, and keeps it locally; transformers runs once."""
    import exporter.validation.reference as reference
    from exporter.validation.validate import validate_export
    from services.publish import REFERENCES_PREFIX, StoreReferences

    calls = []
    real = reference.reference_greedy
    monkeypatch.setattr(reference, "reference_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = validate_export(exported("qwen2", "gqa"), reference_cache=tmp_path / "worker-a",
                            shared_references=StoreReferences(store))
    second = validate_export(exported("qwen2", "attn_dynamic"), reference_cache=tmp_path / "worker-b",
                             shared_references=StoreReferences(store))
    assert first.passed and second.passed and len(calls) == 1
    assert [first.timings_s["reference_cached"], second.timings_s["reference_cached"]] == [0.0, 1.0]
    assert second.parity["tokens"] == first.parity["tokens"]
    (key,) = store.list_keys(REFERENCES_PREFIX)
    name = key.removeprefix(REFERENCES_PREFIX)
    assert name.startswith("greedy-") and (tmp_path / "worker-b" / name).read_bytes() == store.get_bytes(key)


def test_a_store_that_is_down_costs_the_shared_reference_not_the_validation(exported, tmp_path):
    from exporter.validation.validate import validate_export
    from services.publish import StoreReferences

    nobody = S3Store(f"http://127.0.0.1:{free_ports(1)[0]}", BUCKET, "k", "s", attempts=1, backoff_s=0.01,
                     client_attempts=1)
    errors = []
    report = validate_export(exported("qwen2", "gqa"), reference_cache=tmp_path / "worker",
                             shared_references=StoreReferences(nobody, on_error=errors.append))
    assert report.passed and report.timings_s["reference_cached"] == 0.0
    assert len(errors) == 2 and "computing it here" in errors[0] and "kept on this worker" in errors[1]


def test_a_worker_that_lost_its_lease_shares_no_reference_run(store):
    from services.publish import REFERENCES_PREFIX, StoreReferences

    class LeaseLost(Exception):
        pass

    def lost():
        raise LeaseLost

    name = f"greedy-{uuid.uuid4().hex}.npz"
    with pytest.raises(LeaseLost):
        StoreReferences(store, guard=lost).publish(name, b"run")
    assert store.get_bytes(REFERENCES_PREFIX + name) is None


def test_a_write_asks_its_fence_before_every_retry():
    """A worker cut off from the catalog and S3 must not write once S3 is back after its lease went
    to another attempt: the guard is asked before every try of the patient store, and what it raises
    ends the retries (the write is never sent)."""
    from services.storage import S3Store

    class Fenced(Exception):
        pass

    store = S3Store("http://127.0.0.1:9", "bucket", "k", "s", attempts=4, backoff_s=0.01, client_attempts=1,
                    connect_timeout_s=0.2)
    asked = []

    def guard():
        asked.append(len(asked))
        if len(asked) == 3:
            raise Fenced("the lease was taken away")

    with pytest.raises(Fenced):
        store.put_bytes("exports/x/manifest.json", b"{}", guard=guard)
    assert len(asked) == 3  # before the first try and before each retry, until it refused
