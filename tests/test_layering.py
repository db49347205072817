"""Dependencies point one way: exporter/ is a pure library, services/ never imports workers/.

Each check imports every module of a package in a fresh interpreter and lists what came with it.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import exporter
import services


def imported_with(package) -> tuple[list[str], set[str]]:
    modules = [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
               if ".migrations" not in m.name]  # Alembic scripts only run under Alembic
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(','.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return modules, set(out.stdout.strip().split(","))


def test_exporter_imports_no_service_framework_and_nothing_of_the_farm():
    modules, loaded = imported_with(exporter)
    assert len(modules) > 10
    assert loaded & {"celery", "fastapi", "boto3", "sqlalchemy", "services", "workers"} == set()


def test_services_never_import_workers():
    modules, loaded = imported_with(services)
    assert len(modules) > 10 and "services.api.app" in modules
    assert "workers" not in loaded
