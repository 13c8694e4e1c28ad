"""Driver side of pipeline training: where its data goes, and its figures.

A pipelined run has ``num_workers x P`` barrier tasks; task ``t`` is stage ``t % P`` of
replica ``t // P``, and only the first stage of each replica reads data, so replica ``d``'s
partition is placed in partition ``d * P`` and the other partitions stay empty.
"""
from __future__ import annotations

import functools
from typing import Any

from pyspark import RDD
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError


def place_rdd(partitions: RDD, stages: int) -> RDD:
    """``partitions`` (one per replica) spread over ``P`` partitions per replica, rows in the first."""
    keyed = partitions.mapPartitionsWithIndex(functools.partial(_key_rows, stages))
    return keyed.partitionBy(partitions.getNumPartitions() * stages, _identity).values()


def _key_rows(stages: int, index: int, rows: Any) -> Any:
    return ((index * stages, row) for row in rows)


def _identity(key: int) -> int:
    return key


#: the column that routes a row to its replica's first stage (dropped by the column reader)
ROUTE_COLUMN = "__sparkdl_replica_route"


def place_dataframe(df: DataFrame, replicas: int, stages: int) -> DataFrame:
    """Rows dealt round-robin to the replicas, each replica's in partition ``d * P`` of ``replicas x P``.

    ``repartition(n, column)`` sends a row to ``pmod(hash(column), n)``; the route column holds,
    per replica, a key whose Spark hash lands in that partition (found with one small job).
    """
    tasks = replicas * stages
    wanted = {replica * stages for replica in range(replicas)}
    found: dict[int, int] = {}
    probe = df.sparkSession.range(0, 64 * tasks).select("id", F.pmod(F.hash("id"), F.lit(tasks)).alias("to"))
    for row in probe.collect():
        if row.to in wanted and row.to not in found:
            found[row.to] = row.id
    if len(found) != len(wanted):   # 64 keys per partition: practically impossible
        raise ClusterConfigError(f"found no routing key for partitions {sorted(wanted - set(found))}")
    # long, as the probed ids: Spark hashes an int and a long of the same value differently
    keys = F.array(*[F.lit(found[replica * stages]).cast("long") for replica in range(replicas)])
    replica = F.pmod(F.monotonically_increasing_id(), F.lit(replicas)).cast("int")
    return df.withColumn(ROUTE_COLUMN, F.element_at(keys, replica + 1)).repartition(tasks, ROUTE_COLUMN)


def pipeline_summary(config: TrainConfig, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The run-level pipeline figures: measured and ideal bubble, task memory, bytes between stages."""
    if not config.mode.pipelined:
        return {}
    bubbles = [w["bubble"] for w in workers if w["bubble"] is not None]   # tasks that took steps
    per_replica: dict[int, int] = {}
    for w in workers:
        per_replica[w["worker"]] = per_replica.get(w["worker"], 0) + w["forward_bytes_per_step"]
    return {"pipeline_stages": config.pipeline_stages, "micro_batches": config.micro_batches,
            "pipeline_schedule": config.pipeline_schedule,
            "bubble": sum(bubbles) / len(bubbles) if bubbles else None,
            "ideal_bubble": workers[0]["ideal_bubble"] if workers else None,
            "max_task_parameter_bytes": max((w["parameter_bytes"] for w in workers), default=0),
            # activations forward, and their gradients of the same size backward, per replica and step
            "activation_bytes_per_step": 2 * max(per_replica.values(), default=0)}
