"""The one stage runner: a barrier stage per attempt, a watchdog, retries, errors that say what failed.

Every training mode (parameter-server workers, allreduce, ...) runs through
:class:`BarrierStageRunner`; a mode contributes only its task body and, when it has one, the
parameter server whose state a retried stage resumes from.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from pyspark import RDD, cloudpickle
from pyspark.sql import DataFrame

from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.ps.server.function_server import FunctionServer
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.shards.coordinator import ShardCoordinator
from sparkdl._internal.spark.backend import ClassicBackend, SparkBackend
from sparkdl._internal.spark.failures import after_attempts, barrier_stage_failure
from sparkdl._internal.spark.preflight import task_slots, too_few_slots_error, wait_for_slots
from sparkdl._internal.spark.task import BarrierStageSpec, TaskBody, arrow_output, make_barrier_task
from sparkdl.errors import ClusterConfigError, DataError, ParameterServerError, SparkDLError

log = logging.getLogger(__name__)

Task = Callable[[Iterator[Any]], Iterator[dict[str, Any]]]
#: runs ``task`` as a barrier stage over the partitions and returns every task's summary
BarrierStageFn = Callable[[Task], list[dict[str, Any]]]


def _order_preserving_shuffle(data: RDD) -> RDD:
    """The same partitions (rows and order) behind a shuffle boundary.

    Barrier stages refuse lineages such as ``union`` or ``coalesce`` whose ancestors have other
    partition counts; a shuffle that sends partition i to partition i cuts the lineage without
    moving a row to another worker.
    """
    count = data.getNumPartitions()
    keyed = data.mapPartitionsWithIndex(lambda index, rows: ((index, row) for row in rows))
    return keyed.partitionBy(count, lambda index: index).values()


def rdd_barrier_stage(partitions: RDD, barrier: bool = True) -> BarrierStageFn:
    """A barrier stage over RDD partitions (``rdd.barrier().mapPartitions``); with ``barrier=False``
    a plain stage, whose tasks Spark re-runs one by one (elastic runs)."""
    def run(task: Task) -> list[dict[str, Any]]:
        if not barrier:
            return partitions.mapPartitions(task).collect()  # type: ignore[arg-type]  # the stubs say Iterable; tasks get an iterator
        try:
            return (partitions.barrier()
                    .mapPartitions(task)  # type: ignore[arg-type]  # pyspark's stubs say Iterable; tasks get an iterator
                    .collect())
        except Exception as exc:
            if "BarrierJobUnsupportedRDDChainException" not in str(exc):
                raise
        log.info("sparkdl: the input lineage cannot run in a barrier stage as is; adding a shuffle boundary")
        return (_order_preserving_shuffle(partitions).barrier()
                .mapPartitions(task)  # type: ignore[arg-type]  # pyspark's stubs say Iterable; tasks get an iterator
                .collect())
    return run


def dataframe_barrier_stage(partitions: DataFrame, barrier: bool = True) -> BarrierStageFn:
    """A barrier stage over DataFrame partitions (``mapInArrow(..., barrier=True)``); with
    ``barrier=False`` a plain stage, whose tasks Spark re-runs one by one (elastic runs)."""
    def run(task: Task) -> list[dict[str, Any]]:
        out = partitions.mapInArrow(arrow_output(task), "summary string", barrier=barrier)
        return [json.loads(row.summary) for row in out.collect()]
    return run


class BarrierStageRunner:
    """Runs a mode's barrier stage until an attempt succeeds or ``max_attempts`` are used.

    With a parameter server, a retried attempt continues from the PS's state (weights,
    version, data positions); a PS failure ends the run at once, and a watchdog cancels the
    stage when the PS fails or no task reaches it, so the driver never waits forever.  The
    stage's jobs carry a job group (classic) or an operation tag (Spark Connect) for that.
    """

    def __init__(self, backend: SparkBackend, run_barrier_stage: BarrierStageFn, read_chunks: ChunksFn, body: TaskBody,
                 description: str, max_attempts: int, timeout_s: float,
                 ps: ParameterServer | ShardCoordinator | FunctionServer | None = None,
                 num_tasks: int = 0) -> None:
        self.backend = backend
        self.run_barrier_stage = run_barrier_stage
        self.read_chunks = read_chunks
        self.body = body
        self.description = description
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.ps = ps
        self.num_tasks = num_tasks
        self.group = f"sparkdl-train-{uuid.uuid4().hex[:8]}"
        #: one record per stage attempt (``TrainResult.attempts``)
        self.attempts: list[dict[str, Any]] = []

    def run(self, spec_for_attempt: Callable[[int], BarrierStageSpec]) -> list[dict[str, Any]]:
        """Every task's summary of the first successful attempt; raises the last attempt's error."""
        for barrier_attempt in range(self.max_attempts):
            if barrier_attempt:
                self._await_slots_for_retry()
            spec = spec_for_attempt(barrier_attempt)
            outcome = self._attempt(spec)
            record: dict[str, Any] = {"attempt": barrier_attempt,
                                      "error": None if isinstance(outcome, list) else str(outcome).splitlines()[0]}
            if self.ps is not None:
                record["version_at_end"] = self.ps.version
            self.attempts.append(record)
            if isinstance(outcome, list):
                return outcome
            fatal = self.ps is not None and self.ps.failure is not None
            # a cluster setting or the data is at fault: another attempt would fail the same way
            settled = isinstance(outcome, (ClusterConfigError, DataError))
            if fatal or settled or barrier_attempt + 1 == self.max_attempts:
                raise after_attempts(outcome, barrier_attempt + 1)
            log.warning("sparkdl: training stage attempt %d failed (%s); retrying%s", barrier_attempt + 1,
                        str(outcome).splitlines()[0],
                        f" from PS version {self.ps.version}" if self.ps is not None else " from the start")
        raise AssertionError("unreachable: max_attempts >= 1")

    def _await_slots_for_retry(self) -> None:
        """A retry needs every task's slot again: wait up to ``timeout_s`` for the slots a lost executor
        held (its host may come back, or Spark may add an executor), else end the run saying why.

        Spark alone, short of slots for a barrier stage, retries its check for about ten minutes.
        Local masters cannot lose slots; Spark Connect shows none to the client (Spark's check applies).
        """
        backend = self.backend
        if (not isinstance(backend, ClassicBackend) or not self.num_tasks or backend.master.startswith("local[")
                or backend.sc._jsc.sc().isStopped()):
            return
        started = time.monotonic()
        slots = wait_for_slots(backend, self.num_tasks, self.timeout_s, count=task_slots)
        if slots >= self.num_tasks:
            return
        lost = {e["worker"]: e["reason"] for e in (self.ps.events if self.ps is not None else [])
                if e.get("event") == "lost"}                      # each worker's latest loss
        cause = "; ".join(f"worker {w} {reason}" for w, reason in sorted(lost.items()))
        error = too_few_slots_error(self.num_tasks, slots, backend.master, backend.conf("spark.task.cpus", "1") or "1")
        # every worker went silent (none disconnected or failed) and no executor is left: the common
        # cause is on the driver's side, not the workers' (whose executors would have been replaced)
        workers = getattr(getattr(self.ps, "config", None), "num_workers", self.num_tasks)   # replicas, not stages
        silent = {w for w, reason in lost.items() if reason.startswith("sent nothing")}
        isolated = (" Every worker went silent and the driver reaches no executor: the driver's own network "
                    "link (or the cluster's) is the likely cause; the parameter server's state is intact"
                    if slots == 0 and len(silent) == len(lost) >= workers else "")
        raise ClusterConfigError(
            f"the training stage cannot be retried after attempt {len(self.attempts)} failed "
            f"({self.attempts[-1]['error'] if self.attempts else 'unknown error'})"
            + (f", with {cause}" if cause else "")
            + f": {error} (waited {time.monotonic() - started:.0f} s for the lost executor's slots to come back)."
            + isolated)

    def _attempt(self, spec: BarrierStageSpec) -> list[dict[str, Any]] | SparkDLError:
        """One barrier stage; its task summaries, or the error that ended it."""
        if self.ps is not None:
            self.ps.worker_failures.clear()   # tracebacks of an earlier attempt stay in ps.events
        suffix = f" (attempt {spec.barrier_attempt + 1})" if spec.barrier_attempt else ""
        shared = self.backend.share(cloudpickle.dumps(spec))
        stop_watch = threading.Event()
        watcher = None
        if self.ps is not None:
            watcher = threading.Thread(target=self._watch, args=(stop_watch, spec), name="sparkdl-watchdog",
                                       daemon=True)
            watcher.start()
        try:
            with self.backend.job_group(self.group, f"sparkdl train: {self.description}{suffix}"):
                return self.run_barrier_stage(make_barrier_task(self.body, shared, self.read_chunks))
        except Exception as exc:
            if self.ps is None:
                return self._explain(barrier_stage_failure(exc), exc, spec)
            return self._explain(barrier_stage_failure(exc, self.ps.worker_failures, self.ps.failure), exc, spec)
        finally:
            stop_watch.set()
            if watcher is not None:
                watcher.join()
            self.backend.release(shared)

    def _explain(self, error: SparkDLError, exc: BaseException, spec: BarrierStageSpec) -> SparkDLError:
        """Errors whose cure is a setting, said in sparkdl's words (Spark's and the workers' are generic)."""
        text = f"{error}\n{exc}"
        if _SLOTS_PATTERN.search(text):
            return too_few_slots_error(self.num_tasks, None, self.backend.master,
                                       self.backend.conf("spark.task.cpus", "1") or "1")
        unreachable = _UNREACHABLE_PATTERN.search(text)
        if unreachable:
            return ParameterServerError(
                f"training workers cannot reach the parameter server at {spec.ps_host}:{spec.ps_port} "
                f"({unreachable.group('cause')}). {self._network_advice()}")
        return error

    def _network_advice(self) -> str:
        where = ("this Spark Connect client process (not in Spark's driver)" if self.backend.connect
                 else "the driver process")
        return (f"The parameter server runs in {where}, and every executor must be able to open a TCP "
                "connection to it: set ps_host (Param psHost) to an address of this machine that the "
                "executors can reach, and open its port (ps_port, Param psPort, fixes it) in firewalls")

    def _watch(self, stop: threading.Event, spec: BarrierStageSpec) -> None:
        """Cancel the stage when the PS fails or no worker shows up within ``timeout_s``."""
        assert self.ps is not None
        started = time.monotonic()
        while not stop.wait(0.2):
            if self.ps.failure is None and not self.ps.workers_seen and time.monotonic() - started > self.timeout_s:
                self.ps.fail(ParameterServerError(
                    f"no training task reached the parameter server at {spec.ps_host}:{spec.ps_port} within "
                    f"{self.timeout_s:.0f} s: either the barrier stage could not start (fewer than "
                    f"{self.num_tasks} free task slots?) or the executors cannot connect. "
                    + self._network_advice()))
            if self.ps.failure is not None:
                self.backend.cancel(self.group)
                return


#: Spark's refusal of a barrier stage larger than the cluster (after its own retries)
_SLOTS_PATTERN = re.compile(r"BarrierJobSlotsNumberCheckFailed|requires more slots than the total number of slots")
#: a worker's PSClient that could not connect (sparkdl._internal.ps.worker.client)
_UNREACHABLE_PATTERN = re.compile(r"cannot reach the parameter server at \S+ \((?P<cause>[^)]*)\)")

