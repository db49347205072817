"""exporter/ is a pure library: importing all of it pulls in no service framework."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import exporter


def test_exporter_imports_no_service_frameworks():
    modules = [m.name for m in pkgutil.walk_packages(exporter.__path__, "exporter.")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'celery', 'fastapi', 'boto3', 'sqlalchemy'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    assert len(modules) > 10
