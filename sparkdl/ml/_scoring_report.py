"""Where a scoring task's time went, and the session's summary of it.

Each scoring task (``TorchModel.transform``, ``TorchModel.udf()``) logs one record when it ends: its rows and
its seconds reading Arrow batches from Spark, converting them (checks, tensors, ``batchTransform``), in the
model, and writing the results back.  Spark collects the records of its Python workers when
``spark.sql.pyspark.worker.logging.enabled`` is true (pyspark 4.1 or newer), from classic and Spark Connect
sessions alike; :func:`scoring_report` sums them on the driver.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

#: the scoring tasks' logger; its records are INFO, so they reach Spark's worker log table and a handler the
#: user sets up at INFO, not the default last-resort handler (WARNING and above)
LOGGER = logging.getLogger("sparkdl.scoring_report")
LOGGER.setLevel(logging.INFO)

#: the Spark setting that collects the Python workers' log records (``spark.tvf.python_worker_logs()``)
WORKER_LOGGING = "spark.sql.pyspark.worker.logging.enabled"

#: the parts of a task's time, in the order a batch goes through them
STAGES = ("read", "convert", "model", "write")


@dataclass
class TaskTimes:
    """One scoring task's rows and seconds per stage.  ``read`` and ``convert`` run on the background thread
    that prepares the next batches, so they overlap ``model``: their sum may exceed the task's ``seconds``."""

    rows: int = 0
    read: float = 0.0
    convert: float = 0.0
    model: float = 0.0
    write: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """The time the block takes, added to ``stage``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, stage, getattr(self, stage) + time.perf_counter() - began)

    def timed(self, items: Iterator[T], stage: str) -> Iterator[T]:
        """``items``, the time each takes to come added to ``stage``."""
        items = iter(items)
        while True:
            with self.timing(stage):
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item

    def log(self, model_key: str) -> None:
        """Log the task's record (its context carries every figure, for :func:`scoring_report`)."""
        from pyspark import TaskContext

        seconds = time.perf_counter() - self.started
        context = TaskContext.get()
        figures = {"sparkdl_model": model_key[:16], "rows": str(self.rows), "seconds": f"{seconds:.6f}",
                   "partition": str(context.partitionId()) if context else "",
                   **{f"{stage}_seconds": f"{getattr(self, stage):.6f}" for stage in STAGES}}
        LOGGER.info("scored %d rows in %.3f s (%.0f rows/s): read %.3f s, convert %.3f s, model %.3f s, "
                    "write %.3f s", self.rows, seconds, self.rows / seconds if seconds else 0.0, self.read,
                    self.convert, self.model, self.write, extra={"context": figures})


@dataclass(frozen=True)
class ScoringReport:
    """The scoring tasks' records of a session, summed: tasks, rows, the tasks' seconds and each stage's."""

    tasks: int
    rows: int
    seconds: float         # the tasks' own time, summed over tasks (not the job's wall time)
    read_seconds: float
    convert_seconds: float
    model_seconds: float
    write_seconds: float

    @property
    def rows_per_task_second(self) -> float:
        """Rows scored per second of one task: the job's rate is this times the tasks running at once."""
        return self.rows / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        return (f"{self.rows:,} rows in {self.tasks} tasks, {self.seconds:.2f} task-seconds "
                f"({self.rows_per_task_second:,.0f} rows per task-second): read {self.read_seconds:.2f} s, "
                f"convert {self.convert_seconds:.2f} s, model {self.model_seconds:.2f} s, "
                f"write {self.write_seconds:.2f} s")


def scoring_report(spark: Any = None) -> ScoringReport:
    """The summed records of every scoring task of this session so far (``transform``, ``udf()``) whose Python
    worker logged with ``spark.sql.pyspark.worker.logging.enabled`` set; classic or Spark Connect sessions.

    Raises ``ClusterConfigError`` where the session cannot collect them (pyspark older than 4.1, or the
    setting off), saying what to set.
    """
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from sparkdl.errors import ClusterConfigError

    spark = spark or SparkSession.active()
    if not hasattr(spark, "tvf") or not hasattr(spark.tvf, "python_worker_logs"):
        raise ClusterConfigError("the scoring report reads Spark's Python worker logs, which need pyspark 4.1 or "
                                 "newer")
    if str(spark.conf.get(WORKER_LOGGING, "false")).lower() != "true":
        raise ClusterConfigError(f"the scoring tasks' records are collected only with {WORKER_LOGGING} set: "
                                 f"spark.conf.set({WORKER_LOGGING!r}, 'true') before scoring")
    records = spark.tvf.python_worker_logs().where(F.col("logger") == LOGGER.name)
    sums = [F.sum(F.col("context")[name].cast("double")).alias(name)
            for name in ("rows", "seconds", *(f"{stage}_seconds" for stage in STAGES))]
    row = records.agg(F.count(F.lit(1)).alias("tasks"), *sums).collect()[0]
    figures = {item.name: row[item.name] or 0 for item in fields(ScoringReport)}
    return ScoringReport(**{**figures, "tasks": int(figures["tasks"]), "rows": int(figures["rows"])})
