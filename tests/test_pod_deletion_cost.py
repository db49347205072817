"""A worker marks its pod busy for a scale-down while it runs a job (workers/pod_deletion_cost.py).

The Kubernetes API server cannot run here: a small HTTPS server in the test stands in for it, with
its own certificate as the cluster CA and a service account directory as the kubelet mounts one.
The job is a real one on a real catalog (SQLite), whose one stage checks what the API heard while
the job ran, then fails the export (a full export would only make the test slower).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import ssl
import subprocess
import threading

import pytest

from exporter.errors import ExportError
from exporter.request import ExportRequest
from services.catalog.database import session_scope, upgrade_schema
from services.jobs import submit_export
from services.settings import Settings
from workers import pod_deletion_cost

TOKEN = "service-account-token-of-the-worker"
NAMESPACE, POD = "exportfarm", "farm-exportfarm-gpu-worker-7d9f-abcde"


class FakeKubernetesApi(http.server.ThreadingHTTPServer):
    """HTTPS on a loopback port; records every PATCH and answers ``status`` (200: the patched pod)."""

    def __init__(self, cert: str, key: str, status: int = 200):
        self.patches: list[dict] = []
        self.status = status
        super().__init__(("127.0.0.1", 0), _Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_PATCH(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.patches.append({"path": self.path, "authorization": self.headers["Authorization"],
                                    "content_type": self.headers["Content-Type"], "body": body})
        answer = json.dumps(body if self.server.status == 200 else {"kind": "Status", "code": self.server.status})
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer.encode())

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A pod's view of its cluster: the API's address in its environment, its service account's token
    and the CA in the directory the kubelet mounts, and POD_NAME / POD_NAMESPACE from the chart."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the fake API server's certificate: apt-get install openssl")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    cert, key = account / "ca.crt", tmp_path / "api.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    (account / "token").write_text(TOKEN + "\n")

    def api(status: int = 200) -> FakeKubernetesApi:
        server = FakeKubernetesApi(str(cert), str(key), status)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
        return server

    monkeypatch.setenv("POD_NAME", POD)
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    monkeypatch.setattr(pod_deletion_cost, "SERVICE_ACCOUNT_DIR", account)
    servers = []
    yield lambda status=200: servers.append(api(status)) or servers[-1]
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def settings(tmp_path, checkpoint):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    s = Settings(data_dir=tmp_path / "data", models_dir=models, lease_s=30, heartbeat_s=0.5)
    upgrade_schema(s.catalog_url)
    return s


def submitted(settings) -> str:
    with session_scope(settings.catalog_url) as session:
        export, _ = submit_export(session, settings, ExportRequest(model="tiny-llama", dtype="fp32", ep="cpu"))
        return export.id


def costs(api: FakeKubernetesApi) -> list[str]:
    return [p["body"]["metadata"]["annotations"][pod_deletion_cost.ANNOTATION] for p in api.patches]


def test_a_worker_marks_its_pod_busy_while_it_runs_a_job_and_idle_after(cluster, settings, monkeypatch):
    from workers import job as worker_job
    from workers.job import WorkerIdentity, run_export_job

    api = cluster()
    heard_during_the_job = []

    def stage(job, record):
        heard_during_the_job.extend(costs(api))
        raise ExportError("the checkpoint is gone")

    monkeypatch.setattr(worker_job, "STAGES", (("resolve", stage),))
    assert run_export_job(settings, submitted(settings), WorkerIdentity("w1", os.getpid())) == "failed"
    assert heard_during_the_job == [str(pod_deletion_cost.BUSY)]
    assert costs(api) == [str(pod_deletion_cost.BUSY), str(pod_deletion_cost.IDLE)]
    for patch in api.patches:  # the pod's own object, with the service account's token, as a merge patch
        assert patch["path"] == f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}"
        assert patch["authorization"] == f"Bearer {TOKEN}"
        assert patch["content_type"] == "application/merge-patch+json"
        assert patch["body"] == {"metadata": {"annotations": {pod_deletion_cost.ANNOTATION: patch["body"][
            "metadata"]["annotations"][pod_deletion_cost.ANNOTATION]}}}


def test_a_refused_patch_costs_the_job_nothing(cluster, settings, monkeypatch, caplog):
    """RBAC missing (403): the job runs and ends as it would have, and the log says why the pod is
    not marked."""
    from workers import job as worker_job
    from workers.job import WorkerIdentity, run_export_job

    api = cluster(403)

    def stage(job, record):
        raise ExportError("the checkpoint is gone")

    monkeypatch.setattr(worker_job, "STAGES", (("resolve", stage),))
    assert run_export_job(settings, submitted(settings), WorkerIdentity("w1", os.getpid())) == "failed"
    assert costs(api) == [str(pod_deletion_cost.BUSY), str(pod_deletion_cost.IDLE)]
    assert "could not set this pod's controller.kubernetes.io/pod-deletion-cost" in caplog.text and "403" in caplog.text


def test_outside_a_cluster_nothing_is_asked(tmp_path, monkeypatch):
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "POD_NAME", "POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    assert pod_deletion_cost.OwnPod.find() is None
    in_cluster = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443", "POD_NAME": POD,
                  "POD_NAMESPACE": NAMESPACE}
    assert pod_deletion_cost.OwnPod.find(in_cluster, tmp_path) is None  # no service account token mounted
    (tmp_path / "token").write_text(TOKEN)
    pod = pod_deletion_cost.OwnPod.find(in_cluster, tmp_path)
    assert pod.url == f"https://[fd00::1]:443/api/v1/namespaces/{NAMESPACE}/pods/{POD}"
