"""One local Spark Connect server at a time on this machine.

pyspark starts a local Connect server (``remote="local[...]"``) on the fixed port 15002 and its
client connects there, so two test processes (``make test`` runs two) must not start one at once:
the tests that do hold this lock while their server runs.
"""
from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "sparkdl-tests-connect-port.lock"


@contextmanager
def one_connect_server() -> Iterator[None]:
    """Hold the machine-wide lock of the local Connect server's port for the block."""
    with LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)     # released when the file closes, or the process dies
        yield
