"""The task that writes a model's row when a Spark Connect session saves it: weights that its Python worker's
memory limit cannot hold are refused with what to do, before they are unpickled."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.conftest import refused_under_headroom

_ROW_SETUP = """
import pickle
from sparkdl.ml._connect_io import _ROW_COLUMNS, _emit_row

row = {column: None for column in _ROW_COLUMNS} | {"model": b"m", "loss": b"l", "state": bytes(200_000_000)}
shared = pickle.dumps(row)   # 200 MB of weights, as the saved row carries them
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_weights_the_save_task_cannot_hold_are_refused_before_they_are_unpickled():
    printed = refused_under_headroom(_ROW_SETUP, "list(_emit_row(shared, iter([])))", headroom_mb=150)
    assert "saving the model (its weights, in the saved row) needs 191 MiB" in printed
    assert "spark.executor.pyspark.memory" in printed
