"""Every module imports on its own in a fresh interpreter (no cycles); the PS needs no pyspark."""
import pkgutil
import subprocess
import sys

import pytest

import sparkdl

MODULES = sorted(m.name for m in pkgutil.walk_packages(sparkdl.__path__, "sparkdl."))


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)


def test_parameter_server_does_not_import_pyspark():
    code = ("import sys, sparkdl.ps.transport, sparkdl.ps.client, sparkdl.ps.policy; "
            "sys.exit(1 if any(m.startswith('pyspark') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
