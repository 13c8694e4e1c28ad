"""pyproject.toml uses metadata forms that current setuptools builds without deprecation warnings."""
from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def test_license_is_an_spdx_expression_not_a_table():
    # setuptools deprecates the {text = ...} / {file = ...} table and warns on every install
    license = pyproject()["project"]["license"]
    assert not isinstance(license, dict), f"project.license is the deprecated table form {license!r}"
    assert license == "Apache-2.0"


def test_the_build_requires_a_setuptools_that_reads_spdx_licenses():
    requires = [Requirement(r) for r in pyproject()["build-system"]["requires"]]
    setuptools = next(r for r in requires if r.name == "setuptools")
    # the SPDX string form needs setuptools >= 77; older ones refuse it
    assert not setuptools.specifier.contains("76.1") and setuptools.specifier.contains("77.0")
