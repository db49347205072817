"""Deployment: the Helm chart and docker-compose.yml are valid and say the things that matter.

The chart is rendered with `helm template` (no cluster) for its default values and for
values-gpu-cluster.yaml; the manifests go through `kubernetes-validate --strict` and the checks
below read them as data: one GPU per GPU worker, one beat, the migration hook, no credential in a
ConfigMap, probes on every Deployment, KEDA scaling on the Celery queue.

Tools: helm (deploy/tools/fetch-helm.sh puts it at .tools/helm/helm), kubernetes-validate (the
`test` extra) and Debian's docker-compose. CI installs all three, so a missing one fails here;
EXPORTFARM_SKIP_DEPLOY_TOOLS=1 skips instead, on a machine that cannot have them.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "exportfarm"
DEPLOY = ROOT / "deploy"
RELEASE, NAMESPACE = "farm", "exportfarm"
# The newest Kubernetes the chart targets (helm 4.1's client version) and the oldest it allows
# (Chart.yaml kubeVersion); kubernetes-validate ships the schemas of both.
KUBE_VERSIONS = ["1.35.0", "1.29.0"]
VALUES = {"default": [], "gpu-cluster": ["-f", str(CHART / "values-gpu-cluster.yaml")]}
# Custom resources kubernetes-validate has no schema for; test_gpu_autoscaling checks their shape.
CRD_GROUPS = ("keda.sh/",)


def _tool_missing(what: str, how: str):
    message = f"{what} is not available: {how}"
    if os.environ.get("EXPORTFARM_SKIP_DEPLOY_TOOLS") == "1":
        pytest.skip(f"{message} (EXPORTFARM_SKIP_DEPLOY_TOOLS=1)")
    pytest.fail(f"{message}. CI installs it (.ci/run); set EXPORTFARM_SKIP_DEPLOY_TOOLS=1 to skip these tests")


@functools.cache
def _helm_path() -> str | None:
    local = ROOT / ".tools" / "helm" / "helm"
    return str(local) if os.access(local, os.X_OK) else shutil.which("helm")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = _helm_path()
    if binary is None:
        _tool_missing("helm", "run deploy/tools/fetch-helm.sh")
    result = subprocess.run([binary, *args], check=False, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@functools.cache
def _render(args: tuple[str, ...]) -> tuple[dict, ...]:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSIONS[0], *args)
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render(*args: str) -> list[dict]:
    """The chart's manifests for these helm arguments, as parsed YAML documents."""
    return list(_render(args))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, suffix: str) -> dict:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == f"{RELEASE}-exportfarm-{suffix}"]
    return doc


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


# --- the chart as a whole ------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUES)
def test_chart_lints_strict(values):
    result = helm("lint", "--strict", str(CHART), *VALUES[values])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUES)
def test_rendered_manifests_are_valid_kubernetes(values, kube_version, tmp_path):
    docs = render(*VALUES[values])
    files = []
    for i, doc in enumerate(docs):
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        files.append(tmp_path / f"{i:02d}-{doc['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(doc))
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        _tool_missing("kubernetes-validate", "pip install -e '.[test]'")
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version, *map(str, files)],
                            check=False, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # An unknown kind is only a warning to kubernetes-validate: make sure every object was checked.
    assert "Couldn't find schema" not in output, output
    assert output.count(" passed for resource ") == len(files), output


def test_default_values_render_the_whole_farm():
    docs = render()
    deployments = {d["metadata"]["name"] for d in of_kind(docs, "Deployment")}
    assert deployments == {f"{RELEASE}-exportfarm-{c}" for c in ("api", "gpu-worker", "cpu-worker", "beat")}
    assert {d["kind"] for d in docs} >= {"Service", "ConfigMap", "Secret", "Job", "PodDisruptionBudget", "ServiceAccount"}


# --- what matters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUES)
def test_gpu_workers_get_one_gpu_each_and_time_to_finish_a_job(values):
    docs = render(*VALUES[values])
    gpu = named(docs, "Deployment", "gpu-worker")
    (worker,) = containers(gpu)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["args"][:3] == ["worker", "--queues", "gpu"]
    assert gpu["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 3600
    assert gpu["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # an update never asks for an extra GPU
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["spec"]["template"]["spec"]["tolerations"])
    # Every GPU worker class (gpu-large in the cluster values) has one GPU per pod; nothing else has any.
    gpu_classes = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith(("gpu-worker", "gpu-large-worker"))]
    assert len(gpu_classes) == {"default": 1, "gpu-cluster": 2}[values]
    for other in of_kind(docs, "Deployment"):
        limits = [c["resources"].get("limits", {}) for c in containers(other)]
        if other in gpu_classes:
            assert [limit["nvidia.com/gpu"] for limit in limits] == [1]
        else:
            assert all("nvidia.com/gpu" not in limit for limit in limits)


def test_gpu_cluster_values_place_workers_on_gpu_nodes():
    pod = named(render(*VALUES["gpu-cluster"]), "Deployment", "gpu-worker")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (work,) = [v for v in pod["volumes"] if v["name"] == "work"]
    claim = work["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "fast-ssd" and claim["resources"]["requests"]["storage"] == "500Gi"


def test_values_cannot_give_a_worker_more_than_one_gpu():
    docs = render("--set", "gpuWorker.resources.limits.nvidia\\.com/gpu=4")
    (worker,) = containers(named(docs, "Deployment", "gpu-worker"))
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_every_worker_class_is_a_deployment_and_the_farm_places_jobs_by_their_sizes(tmp_path):
    """QUEUE_CLASSES names every worker class with what one of its workers has: the memory limit
    its pod gets, its GPU's memory, its scratch volume; the farm reads it as its own setting."""
    import json

    from services.settings import Settings

    docs = render(*VALUES["gpu-cluster"])
    large = named(docs, "Deployment", "gpu-large-worker")
    (worker,) = containers(large)
    assert worker["args"][:3] == ["worker", "--queues", "gpu-large"]
    assert worker["resources"]["limits"] == {"memory": "240Gi", "nvidia.com/gpu": 1}
    assert large["spec"]["replicas"] == 2
    data = next(d["data"] for d in of_kind(docs, "ConfigMap") if "QUEUE_CLASSES" in d["data"])
    classes = json.loads(data["QUEUE_CLASSES"])
    assert classes == {"gpu": {"ep": "cuda", "memory_gb": 120, "gpu_memory_gb": 79, "disk_gb": 500},
                       "cpu": {"ep": "cpu", "memory_gb": 16, "disk_gb": 100},
                       "gpu-large": {"ep": "cuda", "memory_gb": 240, "gpu_memory_gb": 139, "disk_gb": 1000}}
    assert Settings(_env_file=None, queue_classes=data["QUEUE_CLASSES"], data_dir=tmp_path).queue_classes == classes


def test_a_worker_class_the_farm_cannot_size_is_refused_by_the_chart():
    result = helm("template", RELEASE, str(CHART), "--set", "gpuWorker.resources.limits.memory=64G", check=False)
    assert result.returncode != 0 and "limits.memory must be whole GiB like 64Gi" in result.stderr, result.stderr
    result = helm("template", RELEASE, str(CHART), "--set-json",
                  'extraWorkerClasses=[{"name": "gpu", "ep": "cuda"}]', check=False)
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr


@pytest.mark.parametrize("values", VALUES)
def test_beat_is_one_replica_replaced_with_recreate(values):
    beat = named(render(*VALUES[values]), "Deployment", "beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    assert containers(beat)[0]["args"] == ["beat"]


def test_beat_replicas_are_not_a_value():
    result = helm("template", RELEASE, str(CHART), "--set", "beat.replicaCount=2", check=False)
    assert result.returncode != 0 and "replicaCount" in result.stderr


@pytest.mark.parametrize("values", VALUES)
def test_migration_is_a_pre_install_and_pre_upgrade_hook(values):
    docs = render(*VALUES[values])
    job = named(docs, "Job", "migrate")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][-1].rstrip().endswith("exec exportfarm db-upgrade")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # Hooks run before the release's Secret exists: the Job reads a hook Secret made before it, or
    # the user's existing Secret.
    (secret_ref,) = [e["secretRef"]["name"] for e in container["envFrom"]]
    hook_secrets = [s for s in of_kind(docs, "Secret") if "helm.sh/hook" in s["metadata"].get("annotations", {})]
    if values == "gpu-cluster":
        assert secret_ref == "exportfarm-credentials" and hook_secrets == []
    else:
        (hook_secret,) = hook_secrets
        assert secret_ref == hook_secret["metadata"]["name"]
        weight = int(hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"])
        assert weight < int(annotations["helm.sh/hook-weight"])
        assert set(hook_secret["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}


def test_no_credential_ends_up_in_a_configmap():
    secrets = {
        "credentials.databaseUrl": "postgresql+psycopg://farm:pg-SENTINEL-1@db:5432/farm",
        "credentials.redisUrl": "redis://:redis-SENTINEL-2@redis:6379/0",
        "credentials.s3AccessKey": "access-SENTINEL-3",
        "credentials.s3SecretKey": "secret-SENTINEL-4",
        "credentials.adminToken": "admin-SENTINEL-5",
        "credentials.signingSecret": "signing-SENTINEL-6",
        "credentials.extraSecret.HF_TOKEN": "hf-SENTINEL-7",
    }
    args = [a for key, value in secrets.items() for a in ("--set-string", f"{key}={value}")]
    docs = render("--set-string", "config.s3EndpointUrl=http://s3:8333", *args)
    (release,) = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == f"{RELEASE}-exportfarm"]
    stored = {k: base64.b64decode(v).decode() for k, v in release["data"].items()}
    assert stored["DATABASE_URL"] == secrets["credentials.databaseUrl"]
    assert stored["HF_TOKEN"] == secrets["credentials.extraSecret.HF_TOKEN"]
    assert set(stored) == {"DATABASE_URL", "REDIS_URL", "S3_ACCESS_KEY", "S3_SECRET_KEY", "ADMIN_TOKEN",
                           "SIGNING_SECRET", "HF_TOKEN"}
    for doc in docs:
        if doc["kind"] != "Secret":
            text = yaml.safe_dump(doc)
            assert "SENTINEL" not in text, f"a credential is in {doc['kind']} {doc['metadata']['name']}"
    (configmap,) = of_kind(docs, "ConfigMap")
    config = configmap["data"]
    assert config["S3_ENDPOINT_URL"] == "http://s3:8333"
    assert not {"DATABASE_URL", "REDIS_URL", "S3_ACCESS_KEY", "S3_SECRET_KEY", "ADMIN_TOKEN"} & set(config)


def test_an_existing_secret_replaces_the_charts_secret():
    docs = render("--set", "credentials.existingSecret=farm-creds")
    assert of_kind(docs, "Secret") == []
    for deployment in of_kind(docs, "Deployment"):
        refs = [e["secretRef"]["name"] for c in containers(deployment) for e in c["envFrom"] if "secretRef" in e]
        assert refs == ["farm-creds"]
        assert "checksum/secret" not in deployment["spec"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize("values", VALUES)
def test_every_deployment_has_liveness_and_readiness_probes(values):
    docs = render(*VALUES[values])
    for deployment in of_kind(docs, "Deployment"):
        for container in containers(deployment):
            where = f"{deployment['metadata']['name']}/{container['name']}"
            assert "livenessProbe" in container and "readinessProbe" in container, where
    (api,) = containers(named(docs, "Deployment", "api"))
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind in ("gpu-worker", "cpu-worker"):
        (worker,) = containers(named(docs, "Deployment", kind))
        assert worker["livenessProbe"]["exec"]["command"][:4] == ["python", "-m", "services.health", "worker"]


@pytest.mark.parametrize("values", VALUES)
def test_workers_may_mark_their_pods_deletion_cost_and_no_other_pod_gets_a_token(values, tmp_path):
    """A worker running a job patches its own pod's deletion cost (workers/pod_deletion_cost.py): each
    worker class runs as a service account that may patch pods in the release's namespace (and
    nothing else), with its token and its pod's name and namespace; the API, beat and the migration
    get no token. Off, no pod gets one and there is no Role."""
    from workers.pod_deletion_cost import OwnPod

    docs = render(*VALUES[values], "--set-json", 'serviceAccount.annotations={"eks.amazonaws.com/role-arn": "s3"}')
    workers = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-worker")]
    assert len(workers) == {"default": 2, "gpu-cluster": 3}[values]
    account = named(docs, "ServiceAccount", "worker")
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "s3"}  # S3 access as the others
    role, binding = named(docs, "Role", "worker"), named(docs, "RoleBinding", "worker")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    name = account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    (tmp_path / "token").write_text("a token")
    for pod in [d["spec"]["template"]["spec"] for d in of_kind(docs, "Deployment") + of_kind(docs, "Job")]:
        (container,) = pod["containers"]
        if any(pod is w["spec"]["template"]["spec"] for w in workers):
            assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"]
            fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
            assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
            # What the pod's environment holds is what the worker looks for (Kubernetes adds the API's address).
            seen = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", **fields}
            url = OwnPod.find(seen, tmp_path).url
            assert url == "https://10.96.0.1:443/api/v1/namespaces/metadata.namespace/pods/metadata.name"
        else:
            assert pod["automountServiceAccountToken"] is False
    off = render(*VALUES[values], "--set", "workerDeletionCost.enabled=false")
    assert not of_kind(off, "Role") and not of_kind(off, "RoleBinding")
    assert all(d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
               for d in of_kind(off, "Deployment") + of_kind(off, "Job"))


def test_pods_restart_when_settings_change():
    def checksums(*args):
        pod = named(render(*args), "Deployment", "gpu-worker")["spec"]["template"]["metadata"]["annotations"]
        return pod["checksum/config"], pod["checksum/secret"]

    config, secret = checksums()
    assert checksums("--set", "config.s3Bucket=other-bucket")[0] != config
    assert checksums("--set-string", "credentials.redisUrl=redis://other:6379/0")[1] != secret


def test_gpu_autoscaling_is_a_keda_scaledobject_on_the_catalog():
    docs = render(*VALUES["gpu-cluster"])
    (scaled,) = of_kind(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": f"{RELEASE}-exportfarm-gpu-worker"}
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"  # the catalog: waiting and running jobs, every GPU queue
    assert re.fullmatch(r"[1-9][0-9]*", trigger["metadata"]["targetQueryValue"])
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA metadata is map[string]string
    (auth,) = of_kind(docs, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "connection", "name": "exportfarm-credentials",
                                                "key": "CATALOG_CONNECTION"}]
    # KEDA owns the replica count: the Deployment must not fight it on every upgrade.
    assert "replicas" not in named(docs, "Deployment", "gpu-worker")["spec"]
    assert of_kind(render(), "ScaledObject") == []
    refused = helm("template", RELEASE, str(CHART), "--set", "gpuWorker.autoscaling.enabled=true", check=False)
    assert refused.returncode != 0 and "gpuWorker.autoscaling needs the catalog" in refused.stderr


def test_gpu_autoscaling_counts_every_waiting_and_running_gpu_job(tmp_path):
    """The query KEDA runs, rendered from the chart with the farm's own database URL, run against a
    real migrated catalog: queued and running jobs of every GPU queue (runtime-pinned ones too) count;
    CPU jobs and ended ones do not. (It once read only Celery's `gpu` list: running jobs and
    `gpu.ort-<version>` re-exports were invisible, so busy GPUs were given back.)"""
    import sqlalchemy

    from services.catalog.database import session_scope, upgrade_schema
    from services.catalog.models import Export, ExportStatus
    from tests.services_fixtures import fresh_postgres_database

    with fresh_postgres_database() as url:
        docs = render("--set", "gpuWorker.autoscaling.enabled=true", "--set-string", f"credentials.databaseUrl={url}")
        (scaled,) = of_kind(docs, "ScaledObject")
        query = scaled["spec"]["triggers"][0]["metadata"]["query"]
        (secret,) = [d for d in of_kind(docs, "Secret") if "CATALOG_CONNECTION" in d.get("data", {})][:1]
        connection = base64.b64decode(secret["data"]["CATALOG_CONNECTION"]).decode()
        assert connection.startswith("postgresql://")  # libpq's form, as KEDA's driver reads it
        upgrade_schema(url)
        jobs = [("gpu", ExportStatus.QUEUED), ("gpu", ExportStatus.RUNNING), ("gpu.ort-1.33.0", ExportStatus.QUEUED),
                ("gpu", ExportStatus.READY), ("gpu.ort-1.33.0", ExportStatus.FAILED), ("cpu", ExportStatus.QUEUED),
                ("cpu", ExportStatus.RUNNING), ("gpu-large", ExportStatus.QUEUED),
                (None, ExportStatus.QUEUED)]  # placed before rows recorded a queue: its EP's (cuda: gpu)
        with session_scope(url) as session:
            for index, (queue, status) in enumerate(jobs):
                session.add(Export(model=f"m{index}", revision="r", cache_key=f"k{index}", request_key=f"r{index}",
                                   variant="attn_dynamic", dtype="fp16", ep="cpu" if queue == "cpu" else "cuda",
                                   ort_version="1.32.0", exporter_version="0", queue=queue, status=status))
            session.add(Export(model="mcpu", revision="r", cache_key="kc", request_key="rc", variant="attn_dynamic",
                               dtype="fp32", ep="cpu", ort_version="1.32.0", exporter_version="0", queue=None,
                               status=ExportStatus.QUEUED))
        engine = sqlalchemy.create_engine(connection.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            with engine.connect() as db:
                assert db.execute(sqlalchemy.text(query)).scalar_one() == 4
        finally:
            engine.dispose()


@pytest.mark.parametrize(("bad", "where"), [
    ("logLevel=LOUD", "/logLevel"),
    ("config.validateEp=tpu", "/config/validateEp"),
    ("credentials.databaseUrl=postgresql://farm:pw@db/farm", "/credentials/databaseUrl"),  # psycopg2: not in the images
    ("gpuWorker.autoscaling.jobsPerWorker=0", "/gpuWorker/autoscaling/jobsPerWorker"),
    ("gpuWorker.replicaCount=-1", "/gpuWorker/replicaCount"),
    ("api.ingress.enabled=yes-please", "/api/ingress/enabled"),
])
def test_schema_refuses_bad_values(bad, where):
    result = helm("template", RELEASE, str(CHART), "--set-string" if "Url" in bad else "--set", bad, check=False)
    assert result.returncode != 0, f"{bad} was accepted"
    assert "schema" in result.stderr and f"'{where}'" in result.stderr, result.stderr


@pytest.mark.parametrize("values", VALUES)
def test_the_charts_settings_are_ones_the_farm_accepts(values, tmp_path):
    """Every pod reads the ConfigMap as settings: they must pass the farm's own checks (a redelivery
    shorter than the hard time limit, a lease shorter than two heartbeats are refused at start)."""
    from services.settings import Settings

    data = next(d["data"] for d in of_kind(render(*VALUES[values]), "ConfigMap") if "TASK_TIME_LIMIT_S" in d["data"])
    settings = Settings(_env_file=None, **{k.lower(): v for k, v in data.items() if k.lower() in Settings.model_fields
                                          and k not in ("DATA_DIR", "WORK_DIR")}, data_dir=tmp_path)
    assert settings.broker_visibility_timeout_s >= settings.task_time_limit_s
    assert settings.lease_s >= 2 * settings.heartbeat_s


@pytest.mark.parametrize(("bad", "words"), [
    ("config.visibilityTimeoutS=3600", "shorter than config.taskTimeLimitS"),
    ("config.leaseS=10", "at least twice config.heartbeatS"),
])
def test_chart_refuses_lifecycle_settings_the_farm_would_refuse(bad, words):
    result = helm("template", RELEASE, str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr


# --- docker compose ---------------------------------------------------------------------------------

COMPOSE_VARS = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")
FILLED = {"POSTGRES_PASSWORD": "pg0secret", "REDIS_PASSWORD": "redis0secret", "S3_SECRET_KEY": "s30secret"}


def docker_compose(env_file: Path, *args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        _tool_missing("docker-compose", "apt-get install docker-compose")
    compose_text = (DEPLOY / "docker-compose.yml").read_text()
    # Variables set in the environment win over --env-file: leave only the file's.
    env = {k: v for k, v in os.environ.items() if k not in set(COMPOSE_VARS.findall(compose_text))}
    return subprocess.run([binary, "-f", str(DEPLOY / "docker-compose.yml"), "--env-file", str(env_file), *args],
                          check=False, capture_output=True, text=True, cwd=DEPLOY, env=env, timeout=120)


@pytest.fixture
def filled_env(tmp_path) -> Path:
    """deploy/.env.example with its empty passwords filled in, as a user's deploy/.env would be."""
    lines = []
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        name = line.partition("=")[0]
        lines.append(f"{name}={FILLED[name]}" if name in FILLED else line)
    path = tmp_path / ".env"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_compose_file_validates(filled_env):
    result = docker_compose(filled_env, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_passwords():
    result = docker_compose(DEPLOY / ".env.example", "config", "-q")
    assert result.returncode != 0
    assert "set POSTGRES_PASSWORD in deploy/.env" in result.stderr


def test_env_example_names_every_compose_variable():
    used = set(COMPOSE_VARS.findall((DEPLOY / "docker-compose.yml").read_text()))
    example = {line.partition("=")[0] for line in (DEPLOY / ".env.example").read_text().splitlines()
               if line and not line.startswith("#")}
    assert used <= example, f"missing from .env.example: {sorted(used - example)}"


def test_compose_services_are_wired_for_one_host(filled_env):
    result = docker_compose(filled_env, "config")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"api", "gpu-worker", "cpu-worker", "beat", "migrate", "redis", "postgres", "s3"}
    (gpu,) = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    assert services["gpu-worker"]["environment"]["WORKER_QUEUES"] == "gpu"
    assert services["beat"]["command"] == ["beat"] and "scale" not in services["beat"]
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    for name, service in services.items():
        if name != "migrate":
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"
    for name in ("api", "gpu-worker", "cpu-worker", "beat"):
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
        for server in ("postgres", "redis", "s3"):
            assert services[name]["depends_on"][server] == {"condition": "service_healthy"}
    for name, volume in (("postgres", "postgres-data"), ("redis", "redis-data"), ("s3", "s3-data")):
        assert any(str(v).startswith(f"{volume}:") for v in services[name]["volumes"]), name


# --- images -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "gpu-worker.Dockerfile"])
def test_images_pin_their_base_and_run_as_a_non_root_user(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    bases = re.findall(r"^ARG (?:PYTHON|CUDA)_IMAGE=(\S+)$", text, re.MULTILINE)
    assert bases and all(re.search(r":\d+\.\d+\.\d+-", b) for b in bases), bases
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and all(u == "10001:10001" for u in users)
    assert 'torch==${TORCH_VERSION}+cpu' in text and "download.pytorch.org/whl/cpu" in text
    assert "deploy/constraints.txt" in text and 'ENTRYPOINT ["exportfarm"]' in text


def test_gpu_image_is_cuda_13_with_onnxruntime_gpu():
    text = (DEPLOY / "gpu-worker.Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.0\.\d+-cudnn-runtime-ubuntu24\.04$", text, re.MULTILINE)
    assert "ARG ORT_GPU_VERSION=1.31.1" in text and '"onnxruntime-gpu==${ORT_GPU_VERSION}"' in text
    assert "nvidia-ml-py==" in text
    pins = dict(line.split("==") for line in (DEPLOY / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["onnxruntime"] == "1.31.1"  # CPU and GPU workers run the same ORT
