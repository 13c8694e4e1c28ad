"""The barrier-stage runner without Spark: a stage that fails is retried up to max_attempts with the attempt in its
job group, a failure that another attempt would repeat (the data, a setting) is not retried, and every attempt's
shared spec is released."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from sparkdl._internal.spark.barrier import BarrierStageRunner
from sparkdl.errors import DataError, WorkerError
from tests.unit.modes.local_stage import LocalBackend

TRACEBACK = "Traceback (most recent call last):\n  File \"task.py\", line 1, in body\n{line}\n"


@dataclass(frozen=True)
class Spec:
    barrier_attempt: int
    ps_host: str = "127.0.0.1"
    ps_port: int = 0


def scripted_stage(outcomes: list[Any]) -> Callable[[Any], list[dict]]:
    """A stage whose n-th run raises ``outcomes[n]`` (an exception) or returns it (the tasks' summaries)."""
    runs = iter(outcomes)

    def run(task: Any) -> list[dict]:
        outcome = next(runs)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return run


def runner(stage: Callable, backend: LocalBackend, max_attempts: int) -> BarrierStageRunner:
    return BarrierStageRunner(backend, stage, lambda rows: rows, lambda env, rows, chunks: {}, "policy=async",
                              max_attempts, timeout_s=5.0, num_tasks=2)


def test_a_failed_attempt_is_retried_and_each_attempt_is_recorded():
    backend = LocalBackend()
    failure = RuntimeError(TRACEBACK.format(line="RuntimeError: the executor was lost"))
    stage = runner(scripted_stage([failure, [{"worker": 0}, {"worker": 1}]]), backend, max_attempts=2)
    assert stage.run(Spec) == [{"worker": 0}, {"worker": 1}]
    assert [a["attempt"] for a in stage.attempts] == [0, 1]
    assert stage.attempts[0]["error"].startswith("the training stage failed: RuntimeError: the executor was lost")
    assert stage.attempts[1]["error"] is None
    assert backend.groups == ["sparkdl train: policy=async", "sparkdl train: policy=async (attempt 2)"]
    assert backend.shared == backend.released == 2


def test_the_last_attempts_error_carries_the_workers_traceback():
    failure = RuntimeError(TRACEBACK.format(line="ValueError: bad weights"))
    stage = runner(scripted_stage([failure, failure]), LocalBackend(), max_attempts=2)
    with pytest.raises(WorkerError, match=r"ValueError: bad weights \(failed in all 2 stage attempts\)") as caught:
        stage.run(Spec)
    assert "task.py" in caught.value.worker_traceback


def test_bad_data_is_not_retried():
    failure = RuntimeError(TRACEBACK.format(line="sparkdl.errors.DataError: row 3 holds NaN"))
    stage = runner(scripted_stage([failure, [{"worker": 0}]]), LocalBackend(), max_attempts=3)
    with pytest.raises(DataError, match="row 3 holds NaN"):
        stage.run(Spec)
    assert len(stage.attempts) == 1
