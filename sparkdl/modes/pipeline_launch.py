"""Driver side of pipeline training: what a pipelined run refuses, where its data goes, its figures.

A pipelined run has ``num_workers x P`` barrier tasks; task ``t`` is stage ``t % P`` of
replica ``t // P``, and only the first stage of each replica reads data, so replica ``d``'s
partition is placed in partition ``d * P`` and the other partitions stay empty.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from pyspark import RDD
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..config import TrainConfig
from ..errors import ClusterConfigError

#: bytes per trained parameter in a stage task: its weights and its gradient (float32)
TASK_BYTES_PER_PARAMETER = 8


def pipeline_refusal(config: TrainConfig) -> str | None:
    """Why ``config`` cannot train a pipeline (None: it can)."""
    stages, micro = config.pipeline_stages, config.micro_batches
    if not _schedules_take_what_sparkdl_passes():
        return (f"torch {torch.__version__} lacks what pipelines use in torch.distributed.pipelining (shape "
                "inference at the first step, step(return_outputs=...), scale_grads): upgrade torch")
    if config.policy != "sync":
        return (f"policy={config.policy!r}: pipelines train with policy='sync' (every stage of every replica "
                "takes part in each update; asynchronous stages would each see other versions of their "
                "neighbours)")
    if config.compression != "none" or config.overlap_communication:
        return "pipelines push uncompressed gradients after the whole schedule: set compression='none' and " \
               "overlap_communication=False"
    if config.local_steps != 1 or config.local_update != "accumulate":
        return "pipelines push after every mini-batch: set local_steps=1 and local_update='accumulate' (the " \
               "micro-batches already accumulate)"
    if config.validation_fraction:
        return "validation_fraction is not available with pipelines yet: score a held-out DataFrame with " \
               "TorchModel.transform"
    if config.batch_size % micro:
        return f"batch_size={config.batch_size} must be a multiple of micro_batches={micro}"
    if config.pipeline_schedule == "1f1b" and micro < stages:
        return (f"pipeline_schedule='1f1b' needs micro_batches >= pipeline_stages ({micro} < {stages}); raise "
                "micro_batches or use pipeline_schedule='gpipe'")
    return None


def _schedules_take_what_sparkdl_passes() -> bool:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    step = inspect.signature(ScheduleGPipe.step).parameters
    stage = inspect.signature(PipelineStage.__init__).parameters
    return ("scale_grads" in inspect.signature(ScheduleGPipe.__init__).parameters and "return_outputs" in step
            and stage["input_args"].default is None)


def check_task_memory(stage_parameters: list[int], limit_bytes: int | None, stages: int) -> None:
    """Refuse a run whose largest stage cannot fit a task's Python memory limit (``spark.executor.pyspark.memory``).

    A stage task holds its weights and gradient (8 bytes per parameter) plus activations;
    the parameter server, not the task, holds the optimizer state.
    """
    if limit_bytes is None:
        return
    needed = TASK_BYTES_PER_PARAMETER * max(stage_parameters)
    if needed > limit_bytes:
        total = sum(stage_parameters)
        fits = -(-TASK_BYTES_PER_PARAMETER * total // limit_bytes)
        raise ClusterConfigError(
            f"the largest {'pipeline stage' if stages > 1 else 'model'} has {max(stage_parameters):,} parameters: "
            f"its weights and gradient alone take {needed / 2**20:.0f} MiB in a task, more than the "
            f"{limit_bytes / 2**20:.0f} MiB each task's Python worker may use (spark.executor.pyspark.memory "
            f"over the executor's task slots). Cut the model into more stages (pipeline_stages >= {fits + 1}, "
            "Param pipelineStages), or give the Python workers more memory")


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
    if config.pipeline_stages == 1:
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
