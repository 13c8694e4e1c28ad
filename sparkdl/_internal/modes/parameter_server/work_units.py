"""Work units: how an elastic run with ``max_workers`` cuts its input so that workers may come and go.

Without them each task trains its own partition for the whole run, so a worker can only be one
of the ``num_workers`` tasks, and a partition whose task finds no slot is trained after the
others, alone.  With them the input is shuffled into ``config.work_units`` units and the stage
runs over ``epochs`` copies of the units: task ``e x units + u`` trains one pass (epoch ``e``)
of unit ``u`` and ends.  Spark hands the tasks to free task slots in that order, so every
epoch is over all the data, an executor that arrives mid-run takes the next unread units, and
one that leaves loses only its units' passes in progress, which Spark re-runs and which resume
at their data positions (the PS keeps a slot per task).  The shuffle runs once; each epoch's
tasks read its output again, in one row order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pyspark import RDD
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparkdl._internal.training.flat import load_flat_buffers
from sparkdl._internal.training.loop import holdout_split
from sparkdl.config import TrainConfig

#: the column that numbers a frame's rows before the shuffle, so that each unit reads them in one order
_ROW_ID = "__sparkdl_unit_row"


def unit_rdd(data: RDD, config: TrainConfig) -> RDD:
    """``epochs`` copies of ``data`` in ``work_units`` partitions (kept as they are when it has that many)."""
    units = config.work_units
    if data.getNumPartitions() != units:
        # a shuffle's output arrives in another order at each read (remote blocks as they come): numbered
        # first and sorted after it, a unit's rows keep one order, so a re-run resumes on the rows it left
        # and the rows held out for validation are the same in every epoch
        # the ids are i x partitions + partition: hashed with the seed, not taken modulo the units (which would
        # make each unit some whole input partitions); a tuple of ints hashes alike in every process
        seed = config.seed
        data = (data.zipWithUniqueId().map(lambda row_id: (row_id[1], row_id[0]))
                .repartitionAndSortWithinPartitions(units, lambda row_id: hash((seed, row_id))).values())
    return data.context.union([data] * config.epochs)


def unit_dataframe(data: DataFrame, config: TrainConfig) -> DataFrame:
    """``epochs`` copies of ``data`` shuffled into ``work_units`` partitions, each read in one row order (Spark
    runs the shuffle once and each copy reads its output)."""
    units = (data.withColumn(_ROW_ID, F.monotonically_increasing_id()).repartition(config.work_units)
             .sortWithinPartitions(_ROW_ID).drop(_ROW_ID))
    # the bound method, not DataFrame.union: a Spark Connect frame is of another class
    return functools.reduce(lambda first, then: first.union(then), [units] * config.epochs)


@dataclass(frozen=True)
class WorkUnit:
    """One task's share of a run with work units: epoch ``epoch``'s pass over unit ``unit``, in PS slot
    ``epoch x units + unit`` (the parameter server's membership counts slots the same way)."""

    slot: int
    units: int

    @classmethod
    def of(cls, config: TrainConfig, slot: int) -> WorkUnit | None:
        """The unit the task of ``slot`` trains (None: a run without work units, each task its own partition)."""
        return cls(slot, config.work_units) if config.work_units else None

    @property
    def epoch(self) -> int:
        return self.slot // self.units

    @property
    def unit(self) -> int:
        """The unit: its rows, and so the rows held out of it, are the same in every epoch."""
        return self.slot % self.units

    def held_out(self, rows: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(training rows, validation rows) of the unit's rows: the unit's, so the same in every epoch."""
        return holdout_split(rows, fraction, seed, self.unit)

    def first_batch(self, steps_per_epoch: int) -> int:
        """The loop's first mini-batch: this epoch's pass starts after the earlier epochs' passes."""
        return self.epoch * steps_per_epoch

    def summary(self, resumed_at_batch: int, carried: bool) -> dict[str, int | bool]:
        """What the task's summary says of its unit."""
        return {"unit": self.unit, "unit_epoch": self.epoch, "resumed_at_batch": resumed_at_batch,
                "buffers_carried": carried}


class CarriedStatistics:
    """The float buffers (BatchNorm statistics ...) one Python worker's last unit ended with, for its next unit of
    the same run: begun from the initial ones, a pass of a few mini-batches would leave them near those.

    One store per Python process (:data:`CARRIED`): PySpark reuses a Python worker for the next task of the
    executor (``spark.python.worker.reuse``, on by default), and only a reused worker finds the statistics
    here; a new one starts its unit from the broadcast ones.  It holds one run's at a time, keyed by the
    run's secret, so a later run never starts from an earlier run's statistics.
    """

    def __init__(self) -> None:
        self._by_run: dict[bytes, torch.Tensor] = {}

    def load_into(self, run: bytes, model: torch.nn.Module) -> bool:
        """Load the statistics this process keeps for ``run`` into ``model``; whether there were any."""
        buffers = self._by_run.get(run)
        if buffers is None:
            return False
        load_flat_buffers(model, buffers)
        return True

    def keep(self, run: bytes, buffers: torch.Tensor) -> None:
        """Keep what ``run``'s unit ended with for this process's next unit (forgetting any other run's)."""
        if buffers.numel():
            self._by_run = {run: buffers}


#: this Python process's store (see :class:`CarriedStatistics`)
CARRIED = CarriedStatistics()
