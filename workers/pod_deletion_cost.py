"""A worker's pod tells Kubernetes to stop an idle worker first, never one in the middle of a job.

When a scale-down (KEDA on the catalog, or a lower replicaCount) takes a worker away, the ReplicaSet
picks which pod goes, and with nothing to tell them apart it may pick a busy one: its job is stopped
and starts over on another worker, hours of GPU time lost. The ReplicaSet deletes the pods with the
lowest ``controller.kubernetes.io/pod-deletion-cost`` first, so a worker sets its own pod's to
``BUSY`` while it runs a job and back to ``IDLE`` when it ends (and when it starts: a restarted
container keeps its pod's annotations). Only in a cluster, where the Helm chart gives the worker a
service account allowed to patch pods, and its pod's name and namespace (POD_NAME, POD_NAMESPACE);
anywhere else nothing is done. A PATCH that fails is logged and the job goes on: the annotation is
a preference for the scale-down, the job's lease is what keeps it safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import ssl
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
BUSY, IDLE = 1000, 0
# Where Kubernetes mounts a pod's service account token and the API server's CA.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class OwnPod:
    """This worker's pod as the Kubernetes API names it, and the credentials that may change it."""

    url: str
    token_file: Path
    ca_file: Path

    @classmethod
    def find(cls, environ: Mapping[str, str] | None = None, account: Path | None = None) -> OwnPod | None:
        """The pod this process runs in, from the environment Kubernetes and the chart give it; None
        outside a cluster (or without the service account token the chart mounts for workers)."""
        environ = os.environ if environ is None else environ
        account = SERVICE_ACCOUNT_DIR if account is None else account
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        name, namespace = environ.get("POD_NAME"), environ.get("POD_NAMESPACE")
        if not (host and port and name and namespace and (account / "token").is_file()):
            return None
        host = f"[{host}]" if ":" in host else host  # an IPv6 service address
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace, safe='')}/pods/{urllib.parse.quote(name, safe='')}"
        return cls(f"https://{host}:{port}{path}", account / "token", account / "ca.crt")

    def set_deletion_cost(self, cost: int) -> None:
        """PATCH the pod's deletion cost annotation; raises OSError (HTTPError, a TLS or connection
        error) when the API refuses or cannot be reached."""
        body = json.dumps({"metadata": {"annotations": {ANNOTATION: str(cost)}}}).encode()
        # Read at every call: the kubelet replaces the projected token before it expires.
        token = self.token_file.read_text().strip()
        request = urllib.request.Request(self.url, data=body, method="PATCH", headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json",
            "Accept": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            response.read()


def mark(cost: int, why: str) -> None:
    """Set this worker's pod deletion cost to ``cost`` where it runs in a cluster; never raises."""
    pod = OwnPod.find()
    if pod is None:
        return
    try:
        pod.set_deletion_cost(cost)
    except (OSError, ValueError) as err:
        log.warning("could not set this pod's %s to %d (%s): %s; a scale-down may pick it", ANNOTATION, cost,
                    why, err)


@contextlib.contextmanager
def running_job(what: str) -> Iterator[None]:
    """While a job runs, its worker's pod is the last a scale-down picks."""
    mark(BUSY, f"{what} started")
    try:
        yield
    finally:
        mark(IDLE, f"{what} ended")
