"""Rebuild tests/file_seconds.json, the seconds each slow test file takes, from a JUnit report of a whole run.

    python -m pytest -n 2 --dist loadfile --junitxml=/tmp/suite.xml && python tests/file_seconds.py /tmp/suite.xml

The suite's two processes take test files longest first (tests/conftest.py), so that neither is left
running a long file alone once the other has finished; files under five seconds keep their order after them.
"""
from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("file_seconds.json")
SHORTEST_S = 5


def file_of(classname: str) -> str | None:
    """The test file of a JUnit ``classname`` (``tests.e2e.test_faults`` or ``tests.unit.test_x.TestClass``)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def file_seconds(report: Path) -> dict[str, int]:
    """Seconds per test file (setup, call and teardown of its tests), the longest first, those of ≥ 5 s."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return {path: round(s) for path, s in sorted(seconds.items(), key=lambda item: -item[1]) if s >= SHORTEST_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a pytest --junitxml report of the whole suite")
    table = file_seconds(parser.parse_args().report)
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table)} files, {sum(table.values())} s in all -> {TABLE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
