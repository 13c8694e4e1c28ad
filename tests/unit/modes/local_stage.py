"""A stand-in for Spark in the unit tests of the modes' driver sides: a backend and a barrier stage without Spark.

``LocalBackend`` answers what a driver asks of a Spark backend (master, settings, job groups, shared bytes);
``local_barrier_stage(partitions)`` runs a barrier stage's task function in one fresh Python process per
partition (forked from a server process that imported torch and sparkdl once), each with a task context that answers
``partitionId``, ``taskAttemptId``, ``cpus``, ``resources``, ``getTaskInfos`` and ``allGather`` (through a
``multiprocessing`` manager).  The driver side, the parameter server, the task bodies and their sockets are
the real ones.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparkdl._internal.spark.backend import SparkBackend

#: how long one stage may run before the helper gives up on it (a hung task fails the test, never hangs it)
STAGE_TIMEOUT_S = 120.0
#: task processes fork from a server that imported the task bodies once (a fresh interpreter per task, as
#: spawn gives, would import torch and pyspark again for every task)
_PROCESSES = multiprocessing.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "pyspark", "tests.unit.modes.local_stage",
                                   "sparkdl._internal.modes.launcher", "sparkdl._internal.modes.functions.run"])


class LocalBackend(SparkBackend):
    """A backend with a local master, default settings, and every job group and share recorded."""

    connect = False

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.settings = settings or {}
        self.groups: list[str] = []
        self.cancelled: list[str] = []
        self.shared = 0
        self.released = 0

    @property
    def master(self) -> str:
        return "local[2]"

    def conf(self, key: str, default: str | None = None) -> str | None:
        return self.settings.get(key, default)

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        self.groups.append(description)
        yield

    def cancel(self, group: str) -> None:
        self.cancelled.append(group)

    def share(self, data: bytes) -> Any:
        self.shared += 1
        return data

    def release(self, shared: Any) -> None:
        self.released += 1

    def driver_heap_bytes(self) -> int | None:
        return None


@dataclass(frozen=True)
class _TaskInfo:
    address: str


class LocalTaskContext:
    """What a barrier task asks of its ``BarrierTaskContext``, in a local process."""

    def __init__(self, rank: int, tasks: int, attempt: int, gathered: Any, barrier: Any) -> None:
        self._rank, self._tasks, self._attempt = rank, tasks, attempt
        self._gathered, self._barrier = gathered, barrier

    def partitionId(self) -> int:  # noqa: N802 (PySpark's name)
        return self._rank

    def taskAttemptId(self) -> int:  # noqa: N802
        return self._attempt

    def cpus(self) -> int:
        return 1

    def resources(self) -> dict[str, Any]:
        return {}

    def getTaskInfos(self) -> list[_TaskInfo]:  # noqa: N802
        return [_TaskInfo(f"127.0.0.1:{40000 + i}") for i in range(self._tasks)]

    def allGather(self, message: str = "") -> list[str]:  # noqa: N802
        self._gathered[self._rank] = message
        self._barrier.wait(STAGE_TIMEOUT_S)
        messages = [self._gathered[i] for i in range(self._tasks)]
        self._barrier.wait(STAGE_TIMEOUT_S)
        return messages

    def barrier(self) -> None:
        self._barrier.wait(STAGE_TIMEOUT_S)


def _run_task(task: Callable[[Iterator[Any]], Iterator[dict]], rank: int, tasks: int, attempt: int,
              partition: list[Any], gathered: Any, barrier: Any, results: Any) -> None:
    from pyspark import TaskContext

    TaskContext._setTaskContext(LocalTaskContext(rank, tasks, attempt, gathered, barrier))  # type: ignore[arg-type]
    try:
        results.put((rank, list(task(iter(partition))), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


class LocalStageError(RuntimeError):
    """A task of the local stage failed; the message holds its traceback (as Spark's exception would)."""


def local_barrier_stage(partitions: list[list[Any]]) -> Callable[[Callable], list[dict[str, Any]]]:
    """A ``BarrierStageFn`` over ``partitions``: one forked process per partition, every task's summary back."""
    attempts = iter(range(1_000_000))

    def run(task: Callable[[Iterator[Any]], Iterator[dict]]) -> list[dict[str, Any]]:
        tasks = len(partitions)
        attempt = next(attempts)
        with _PROCESSES.Manager() as manager:
            gathered, barrier, results = manager.dict(), manager.Barrier(tasks), manager.Queue()
            processes = [_PROCESSES.Process(target=_run_task, args=(task, rank, tasks, attempt * tasks + rank, partition,
                                                                gathered, barrier, results), daemon=True)
                         for rank, partition in enumerate(partitions)]
            for process in processes:
                process.start()
            outcomes = []
            try:
                for _ in processes:
                    outcomes.append(results.get(timeout=STAGE_TIMEOUT_S))
                    if outcomes[-1][2] is not None:    # a failed task fails the stage, as Spark's barrier does
                        raise LocalStageError("a task of the local barrier stage failed:\n" + outcomes[-1][2])
            finally:
                for process in processes:
                    process.join(5)
                    if process.is_alive():
                        process.kill()
        return [summary for _, summaries, _ in sorted(outcomes, key=lambda o: o[0]) for summary in summaries]

    return run
