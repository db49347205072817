"""Which model sizes each worker class of the Helm chart takes: the table in deploy/README.md.

For each real geometry (exporter.geometries) and dtype, the resource estimate of its export job
(exporter.resources, the figures the API and the workers place jobs by) against the worker classes
the chart's values define (QUEUE_CLASSES as the chart renders it). Run from the repository root:

    python deploy/tools/class_table.py [helm/exportfarm/values-gpu-cluster.yaml]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DTYPES = {"cuda": ("fp16", "int8", "int4"), "cpu": ("fp32", "fp16", "int8", "int4")}


def chart_classes(values: list[str]) -> dict:
    """QUEUE_CLASSES as the chart renders it for these values files."""
    import yaml

    helm = ROOT / ".tools" / "helm" / "helm"
    args = [str(helm), "template", "farm", str(ROOT / "helm" / "exportfarm")]
    for v in values:
        args += ["-f", v]
    docs = [d for d in yaml.safe_load_all(subprocess.run(args, check=True, capture_output=True, text=True).stdout) if d]
    data = next(d["data"] for d in docs if d["kind"] == "ConfigMap" and "QUEUE_CLASSES" in d.get("data", {}))
    return json.loads(data["QUEUE_CLASSES"])


def main() -> None:
    from exporter.errors import ExportError
    from exporter.geometries import GEOMETRIES, write_geometry_config
    from exporter.graph.architectures import ARCHITECTURES
    from exporter.graph.config import load_model_config
    from exporter.request import ExportRequest
    from exporter.resources import estimate_resources
    from services.placement import place
    from services.settings import Settings

    classes = chart_classes(sys.argv[1:])
    settings = Settings(_env_file=None, queue_classes=classes, database_url="sqlite://", s3_endpoint_url="http://s3")
    sizes = ", ".join(f"`{name}` {c['memory_gb']} GiB" + (f" + {c['gpu_memory_gb']} GiB GPU" if "gpu_memory_gb" in c else "")
                      + f", {c.get('disk_gb', '?')} GiB disk" for name, c in classes.items())
    print(f"Worker classes: {sizes}.\n")
    print("| model | dtype | ep | host GiB | GPU GiB | disk GiB | worker class |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in GEOMETRIES:
            config = load_model_config(write_geometry_config(name, Path(tmp) / name), ARCHITECTURES)
            for ep, dtypes in DTYPES.items():
                for dtype in dtypes:
                    request = ExportRequest(model=name, dtype=dtype, ep=ep)
                    estimate = estimate_resources(config, request)  # S3 store, reference on the host's CPU
                    try:
                        where = f"`{place(settings, request, estimate)}`"
                    except ExportError as err:
                        where = "refused: " + str(err).split(" needs ", 1)[1].split("; no worker class")[0]
                    figures = estimate.to_dict()
                    gpu = figures["gpu_gib"] if ep == "cuda" else "-"
                    print(f"| {name} | {dtype} | {ep} | {figures['host_gib']} | {gpu} | {figures['disk_gib']} | {where} |")


if __name__ == "__main__":
    main()
