"""A task loads its run's spec: one that its Python worker's memory limit cannot hold is refused with what to do,
and the driver reports that refusal as a ClusterConfigError, not retried."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkdl._internal.spark.failures import barrier_stage_failure
from sparkdl._internal.spark.task import load_spec
from sparkdl.errors import ClusterConfigError
from tests.unit.conftest import refused_under_headroom

_SPEC_SETUP = """
import pickle
import numpy as np
from sparkdl.config import TrainConfig
from sparkdl.models import mlp
from sparkdl._internal.spark.task import JobSpec, load_spec

data = pickle.dumps(JobSpec(TrainConfig(), mlp, np.zeros(50_000_000, np.float32)))   # 200 MB of initial weights
assert load_spec(data).initial_weights.size == 50_000_000   # loads without a limit
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_a_spec_the_worker_cannot_hold_is_refused_before_it_is_unpickled():
    """Under 150 MB of address-space headroom (as spark.executor.pyspark.memory sets it) a spec holding 200 MB of
    initial weights is refused with the settings to change, not a bare MemoryError."""
    printed = refused_under_headroom(_SPEC_SETUP, "load_spec(data)", headroom_mb=150)
    assert "loading the job's spec (the model's initial weights) needs 191 MiB" in printed
    assert "pipeline_stages" in printed and "spark.executor.pyspark.memory" in printed


class BroadcastPastTheLimit:
    """A broadcast whose value cannot be read within the worker's limit."""

    @property
    def value(self) -> bytes:
        raise MemoryError


def test_running_out_of_memory_while_reading_the_spec_is_refused_with_what_to_do():
    with pytest.raises(ClusterConfigError, match=r"ran out of .*pipeline_stages"):
        load_spec(BroadcastPastTheLimit())


def test_a_task_refused_before_it_reached_the_ps_is_a_cluster_config_error():
    """Spark's exception carries the task's Python traceback: its ClusterConfigError is kept (and so not retried)."""
    spark_error = RuntimeError(
        "An error occurred while calling o123.collect.\n: org.apache.spark.SparkException: Job aborted: "
        "Traceback (most recent call last):\n  File \"task.py\", line 9, in load_spec\n"
        "sparkdl.errors.ClusterConfigError: loading the job's spec (the model's initial weights) needs 256 MiB, "
        "but this task's Python worker has only 178 MiB left\n\tat org.apache.spark.api.python.BasePythonRunner")
    error = barrier_stage_failure(spark_error)
    assert isinstance(error, ClusterConfigError) and "needs 256 MiB" in str(error)
