"""Task bodies that need no input still read it to the end: PySpark reuses a Python worker only when its
task did, and a worker started afresh imports torch again (the integration test of function runs,
tests/integration/test_user_code.py, measures the reuse itself)."""
from __future__ import annotations

import pickle
from collections.abc import Iterator

import pyarrow as pa

from sparkdl._internal.spark.preflight import executor_probe_function
from sparkdl.ml._connect_io import _ROW_COLUMNS, _emit_row


def placeholder_batches(read_to_the_end: list[bool]) -> Iterator[pa.RecordBatch]:
    """The one-row input of a placeholder stage (``spark.range(0, 1, 1, 1)``), noting when it was read past."""
    yield pa.RecordBatch.from_pydict({"id": [0]})
    read_to_the_end.append(True)


def test_the_executor_probe_reads_its_placeholder_row_to_the_end():
    read: list[bool] = []
    (out,) = list(executor_probe_function()(placeholder_batches(read)))
    assert read == [True]
    assert out.column("missing").to_pylist() == [""]      # this interpreter has sparkdl and torch


def test_the_connect_save_task_reads_its_placeholder_row_to_the_end():
    row = {column: None for column in _ROW_COLUMNS} | {"model": b"m", "loss": b"l", "state": b"s"}
    read: list[bool] = []
    (out,) = list(_emit_row(pickle.dumps(row), placeholder_batches(read)))
    assert read == [True]
    assert out.column("state").to_pylist() == [b"s"]
