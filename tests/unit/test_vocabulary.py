"""One word per concept: a worker's data *partition* is not a PS *shard*; a *barrier stage* is not a pipeline stage.

The words are the project's glossary (docs/index.md); these checks keep the code from drifting back.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import sparkdl

PACKAGE = Path(sparkdl.__file__).parent
INTERNAL = PACKAGE / "_internal"


def _defined_names(path: Path) -> set[str]:
    """Classes, functions, methods, parameters and module-level names defined in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _room(path: Path) -> str:
    """A module's package under ``sparkdl/_internal`` or ``sparkdl`` (its file name at the top)."""
    inside = path.relative_to(INTERNAL if path.is_relative_to(INTERNAL) else PACKAGE)
    return inside.parts[0]


def test_the_data_path_speaks_of_partitions_never_shards():
    """``shard`` is a PS key range; the data rooms hold a worker's partition."""
    said = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
            for path in [*sorted((INTERNAL / "data").glob("*.py")), INTERNAL / "training" / "loop.py"]
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"shard", line, re.IGNORECASE)]
    assert not said, "the data path says 'shard' (a PS key range); say 'partition':\n" + "\n".join(said)


def test_only_the_parameter_server_its_modes_and_settings_name_shards():
    # the PS, the modes that host its shards, the mode that names them, and the settings table with its rules
    places = ("ps", "modes", "config.py", "combinations.py", "mode.py")
    # and fsdp's parameter shards (a worker's 1/N of every parameter: the glossary's other shard)
    parameter_shards = INTERNAL / "training" / "fully_sharded.py"
    named = [f"{path.relative_to(PACKAGE)}: {name}"
             for path in sorted(PACKAGE.rglob("*.py")) if _room(path) not in places and path != parameter_shards
             for name in sorted(_defined_names(path)) if "shard" in name.lower()
             and not name.startswith(("log_shard", "ps_shard", "shard_snapshot"))]   # settings and fields of PS shards
    assert not named, "names with 'shard' outside ps/ and modes/:\n" + "\n".join(named)


def test_the_spark_stage_is_always_a_barrier_stage():
    """In spark/ a stage is qualified: a barrier stage (what Spark runs) or a pipeline stage (a model cut)."""
    spark_names = set().union(*(_defined_names(p) for p in (INTERNAL / "spark").glob("*.py")))
    bare = sorted(n for n in spark_names if re.search(r"stage", n, re.IGNORECASE)
                  and not re.search(r"barrier|pipeline", n, re.IGNORECASE)
                  and n != "stage_id")   # the id of a stage Spark's status tracker reports, as Spark names it
    assert not bare, f"spark/ defines stage names that say neither 'barrier' nor 'pipeline': {bare}"


def test_one_word_for_scoring():
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    assert not modules & {"inference", "predict", "predictor"}, "scoring lives in sparkdl/ml/_scoring.py"
