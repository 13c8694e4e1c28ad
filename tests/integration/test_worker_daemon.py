"""sparkdl's sessions fork their Python workers from sparkdl.daemon, which has torch imported already."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


def parent_of_this_worker() -> tuple[str, bool]:
    """(the parent process's command line, whether libtorch is mapped in the parent), from a Python task."""
    import os

    parent = Path(f"/proc/{os.getppid()}")
    command = (parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return command, "libtorch" in (parent / "maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the parent process from /proc")
def test_python_workers_are_forked_from_a_daemon_that_imported_torch(spark):
    seen = set(spark.sparkContext.parallelize(range(4), 2).map(lambda _: parent_of_this_worker()).collect())
    assert seen and all("sparkdl.daemon" in command and torch_loaded for command, torch_loaded in seen), seen
