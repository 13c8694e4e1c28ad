"""The package's layering: imports point one way between the rooms, no module-level cycle, the PS needs no pyspark.

The rooms, lowest first (a room may import its own modules and any room below it):

    base      errors, config, combinations, memory, transforms, models, plots, integrations, the package root
    data      Arrow columns and RDD rows -> arrays, row checks, the partition cache and its readers
    training  what the PS and the workers share: flat buffers, optimizers, losses, the step loop, pipeline cuts
    ps        the parameter server (no pyspark)
    spark     session, backend, preflight, the barrier-stage runner, the task wrapper, failures, rendezvous, devices
    modes     the driver side and the task body of each training mode
    ml        the pyspark.ml front end
    top       sparkdl._internal.settings_page (the settings reference writer)

The graph is read from the source (``ast``), so a test fails on an upward import even where
it happens to be lazy, and on a cycle of module-level imports before any interpreter trips on it.
"""
from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import sparkdl

PACKAGE_DIR = Path(sparkdl.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(sparkdl.__path__, "sparkdl."))
ROOMS = ["base", "data", "training", "ps", "spark", "modes", "ml", "top"]
_BASE = {"sparkdl", "sparkdl.errors", "sparkdl.config", "sparkdl._internal", "sparkdl._internal.combinations",
         "sparkdl._internal.memory", "sparkdl._internal.mode", "sparkdl.transforms", "sparkdl.models", "sparkdl.plots",
         "sparkdl.integrations"}
#: the parameter server's floors, lowest first; modules on one floor do not import each other across packages
PS_FLOORS = [{"sparkdl._internal.ps", "sparkdl._internal.ps.tables", "sparkdl._internal.ps.row_steps"}, {"wire"}, {"server", "worker"}, {"shards"}]


def room_of(module: str) -> str:
    """The room a module lives in (``base`` for the package root and its plain modules, else its sub-package)."""
    if module in _BASE:
        return "base"
    if module in ("sparkdl._internal.settings_page", "sparkdl.daemon"):   # above everything they import
        return "top"
    parts = module.split(".")
    room = parts[2] if parts[1] == "_internal" else parts[1]
    assert room in ROOMS, f"{module} is in no room of the layering; add its package to ROOMS"
    return room


def _source(module: str) -> tuple[Path, bool]:
    path = PACKAGE_DIR.joinpath(*module.split(".")[1:])
    if path.is_dir():
        return path / "__init__.py", True
    return path.with_suffix(".py"), False


def imports_of(module: str) -> list[tuple[str, bool]]:
    """The sparkdl modules ``module`` imports, each with whether the import runs when the module loads."""
    path, is_package = _source(module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if is_package else module.rsplit(".", 1)[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = at_load and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue                       # type-only imports never run
            if isinstance(child, ast.Import):
                found.extend((a.name, inside) for a in child.names if a.name.split(".")[0] == "sparkdl")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "sparkdl":
                    continue
                for alias in child.names:      # ``from . import protocol`` imports a module
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in MODULES else target, inside))
            visit(child, inside)

    visit(tree, True)
    return found


def test_every_module_has_a_room():
    for module in MODULES:
        room_of(module)


def test_imports_point_down_the_rooms():
    upward = [f"{module} ({room_of(module)}) imports {target} ({room_of(target)})"
              for module in MODULES for target, _ in imports_of(module)
              if ROOMS.index(room_of(target)) > ROOMS.index(room_of(module))]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def ps_floor(module: str) -> tuple[int, str]:
    """A parameter-server module's floor inside ``ps`` and its package there (``tables`` for the shared modules)."""
    parts = module.split(".")
    side = parts[3] if len(parts) > 4 else "tables"
    return next(i for i, floor in enumerate(PS_FLOORS) if side in floor or module in floor), side


def test_the_parameter_servers_sides_import_down_and_not_each_other():
    ps_modules = [m for m in MODULES if room_of(m) == "ps"]
    wrong = [f"{module} imports {target}" for module in ps_modules for target, _ in imports_of(module)
             if room_of(target) == "ps" and ps_floor(target)[1] != ps_floor(module)[1]
             and ps_floor(target)[0] >= ps_floor(module)[0]]
    assert not wrong, "imports against the parameter server's floors:\n" + "\n".join(wrong)


def test_no_cycle_of_module_level_imports():
    graph = {m: {t for t, at_load in imports_of(m) if at_load and t != m and t in MODULES} for m in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module)


def test_the_layering_check_sees_an_upward_import(tmp_path):
    """The checks above read real imports: a data module importing the parameter server is one."""
    assert ("sparkdl._internal.memory", True) in imports_of("sparkdl._internal.data.cache")
    assert ROOMS.index(room_of("sparkdl._internal.ps.worker.client")) > ROOMS.index(room_of("sparkdl._internal.data.cache"))


def test_every_module_imports_in_one_interpreter():
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in MODULES)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_parameter_server_does_not_import_pyspark():
    code = ("import sys, sparkdl._internal.ps.server.server, sparkdl._internal.ps.worker.client, sparkdl._internal.ps.server.policy, sparkdl._internal.ps.worker.overlap; "
            "sys.exit(1 if any(m.startswith('pyspark') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
