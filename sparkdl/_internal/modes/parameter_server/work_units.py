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

from pyspark import RDD
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

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
