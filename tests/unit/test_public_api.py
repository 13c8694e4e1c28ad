"""The public boundary: what the user-facing docs name is public and imports; everything else is marked internal.

The rule (docs/reference/api.md): a module whose import path has a part that starts with ``_``
(``sparkdl._internal...``, ``sparkdl.ml._params``) is internal and may change in any release; the
public modules are those listed in :data:`PUBLIC_MODULES`, each declaring its names in ``__all__``.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest

import sparkdl

REPO = Path(__file__).resolve().parents[2]
PUBLIC_MODULES = ["sparkdl", "sparkdl.config", "sparkdl.errors", "sparkdl.models", "sparkdl.transforms",
                  "sparkdl.integrations", "sparkdl.plots", "sparkdl.ml", "sparkdl.ml.estimator", "sparkdl.ml.model",
                  "sparkdl.ml.vocabulary", "sparkdl.daemon"]
#: the pages a user reads (the design pages and the benchmarks may name internals)
USER_FACING = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/guides", "docs/reference", "examples"]
_DOTTED = re.compile(r"\bsparkdl(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_FROM_IMPORT = re.compile(r"from (sparkdl(?:\.[A-Za-z_]\w*)*) import ([\w, ]+)")


def _user_facing_texts() -> list[tuple[str, str]]:
    texts = []
    for entry in USER_FACING:
        path = REPO / entry
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.suffix == ".ipynb":
                cells = json.loads(file.read_text())["cells"]
                texts.append((str(file.relative_to(REPO)), "\n".join("".join(c["source"]) for c in cells)))
            elif file.suffix == ".md":
                texts.append((str(file.relative_to(REPO)), file.read_text()))
    return texts


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a module's attribute (or an attribute of one, e.g. a method)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def documented_names() -> list[tuple[str, str]]:
    """Every ``sparkdl...`` path a user-facing page or example names, with the page."""
    found = []
    for page, text in _user_facing_texts():
        found.extend((page, name) for name in _DOTTED.findall(text))
        for module, names in _FROM_IMPORT.findall(text):
            found.extend((page, f"{module}.{name.strip()}") for name in names.split(",") if name.strip())
    return found


def test_the_docs_name_public_api_only():
    named = documented_names()
    assert len({name for _, name in named}) > 20   # the scan reads the pages (a broken scan finds nothing)
    internal = [f"{page}: {name}" for page, name in named if any(part.startswith("_") for part in name.split("."))]
    assert not internal, "user-facing pages name internal paths:\n" + "\n".join(internal)


def test_every_documented_name_imports():
    missing = sorted({f"{page}: {name}" for page, name in documented_names()
                      if not name.endswith(".py") and not _resolves(name)})
    assert not missing, "documented names that do not import:\n" + "\n".join(missing)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_module_declares_what_it_exports(module):
    loaded = importlib.import_module(module)
    exported = getattr(loaded, "__all__", None)
    assert exported, f"{module} declares no __all__"
    assert all(hasattr(loaded, name) for name in exported), [n for n in exported if not hasattr(loaded, n)]
    assert not [n for n in exported if n.startswith("_") and n != "__version__"]


def test_every_other_module_is_marked_internal():
    modules = [m.name for m in pkgutil.walk_packages(sparkdl.__path__, "sparkdl.")]
    unmarked = [m for m in modules if m not in PUBLIC_MODULES
                and not any(part.startswith("_") for part in m.split(".")[1:])]
    assert not unmarked, f"modules neither public nor marked internal (an underscore in the path): {unmarked}"
    assert "sparkdl._internal.ps.server.core" in modules   # the walk reaches the internal packages
