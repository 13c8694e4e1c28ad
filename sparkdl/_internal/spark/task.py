"""The one barrier-task wrapper every training mode runs, and the job spec it receives."""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from sparkdl._internal.data.cache import CachedPartition, ChunksFn, cached_partition
from sparkdl._internal.data.partitions import Padding, PartitionBatches
from sparkdl._internal.memory import (
    REPLICA_BUILD_BYTES_PER_PARAMETER,
    peak_rss_bytes,
    require_address_space,
    reset_peak_rss,
    rss_bytes,
)
from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.worker.remote_embedding import RowSource, prefetch_tables, swap_tables, tables_without_rows
from sparkdl._internal.training.flat import FlatReplica
from sparkdl._internal.training.inputs import ModelCall
from sparkdl._internal.training.pipeline_cuts import PipelineSpec
from sparkdl.config import TrainConfig
from sparkdl.transforms import resolve_transform


@dataclass(frozen=True)
class JobSpec:
    """What every task of one run receives (a broadcast, or inside the task function under Spark Connect)."""

    config: TrainConfig
    model_fn: Callable[[], nn.Module]
    initial_weights: np.ndarray      # flat float32, parameters in model.parameters() order
    ps_host: str = ""                # empty without a parameter server (allreduce)
    ps_port: int = 0
    secret: bytes = b""
    barrier_attempt: int = 0           # the launcher's barrier-stage attempt (retries continue the run)
    tls_cert_pem: str | None = None  # the PS certificate, pinned by the workers
    pipeline: PipelineSpec | None = None   # model parallelism: the stages (initial_weights is then empty)
    #: executor-hosted PS partitions: their key ranges (task i hosts partition i; ps_host/ps_port: the coordinator)
    ps_shards: tuple[tuple[int, int], ...] = ()
    tls_key_pem: str | None = None   # executor-hosted partitions serve TLS with the run's certificate and key
    tensor_sizes: tuple[int, ...] = ()   # executor-hosted partitions: the model's parameter sizes (int8 scales)
    tensor_decays: tuple[bool, ...] = ()  # executor-hosted partitions: which of those AdamW decays (not 1-D ones)
    float_buffer_count: int = 0          # executor-hosted partitions: BatchNorm statistics ... pooled by partition 0
    log_shard: int = 0                   # executor-hosted partitions: the one whose run log is the run's
    input_args: tuple[str, ...] = ()     # forward's keyword arguments, one per input (empty: positional)
    #: each epoch's loss and trainStep metrics go to the driver's PS (a trainStep or callbacks asked for them)
    report_epochs: bool = False
    #: the model's embedding tables, held by the PS as rows (their order is their index on the wire)
    tables: tuple[TableSpec, ...] = ()
    #: fsdp: the sharded checkpoint every worker loads before training (None: start from the initial weights)
    resume_checkpoint: str | None = None


class BarrierStageSpec(Protocol):
    """What the stage runner reads of any mode's spec: the attempt, and where its tasks report."""

    @property
    def barrier_attempt(self) -> int: ...

    @property
    def ps_host(self) -> str: ...

    @property
    def ps_port(self) -> int: ...


@dataclass(frozen=True)
class TaskEnv:
    """One barrier task's place in the run."""

    spec: JobSpec
    rank: int            # the partition index = the worker id
    task_attempt: int    # Spark's task attempt id: grows with every retry of the task
    context: Any         # the BarrierTaskContext (a TaskContext in an elastic run's plain stage)


#: body(env, partition input, input -> its (features, labels) chunks) -> the task's summary
TaskBody = Callable[[TaskEnv, Iterator[Any], ChunksFn], dict]


def make_barrier_task(body: TaskBody, spec: Any, read_chunks: ChunksFn
                      ) -> Callable[[Iterator[Any]], Iterator[dict[str, Any]]]:
    """The function each task of the barrier stage runs (module-level parts: pickled by reference).

    ``spec`` is the pickled :class:`JobSpec` as ``SparkBackend.share`` made it: a broadcast
    variable in classic PySpark, the bytes themselves (inside this function) under Spark Connect.
    """
    return functools.partial(_run_barrier_task, body, spec, read_chunks)


def _run_barrier_task(body: TaskBody, shared_spec: Any, read_chunks: ChunksFn,
                      rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    from pyspark import TaskContext

    reset_peak_rss()     # the task's own peak, not an earlier task's of this reused Python worker
    start_rss = rss_bytes()
    context = TaskContext.get()   # a BarrierTaskContext in a barrier stage
    assert context is not None, "a Spark task always has its context"
    spec = load_spec(shared_spec)
    # Torch threads follow the cores Spark gave this task, so replicas don't oversubscribe.
    torch.set_num_threads(max(1, context.cpus()))
    summary = body(TaskEnv(spec, context.partitionId(), context.taskAttemptId(), context), rows, read_chunks)
    read_to_the_end(rows)   # a body may need none of it (a function run without data)
    summary["peak_rss_bytes"] = peak_rss_bytes()
    summary["start_rss_bytes"] = start_rss      # the worker's size when this task began (reused workers differ)
    summary["barrier_stage"] = hasattr(context, "allGather")   # False in an elastic run's plain stage
    yield summary


#: what a task that cannot hold the model can do
MEMORY_ADVICE = ("Cut the model into (more) pipeline stages (pipeline_stages, Param pipelineStages), so that each "
                 "task holds one stage, or give the Python workers more memory")


def load_spec(shared_spec: Any) -> JobSpec:
    """The run's :class:`JobSpec`, unpickled here rather than by Spark: a model factory that cannot load
    fails with this task's traceback, and a spec (the model's initial weights) that this worker's
    memory limit cannot hold fails with what to do, not a bare ``MemoryError``."""
    from sparkdl._internal.spark.backend import load_shared

    spec: JobSpec = load_shared(shared_spec, "loading the job's spec (the model's initial weights)", MEMORY_ADVICE)
    return spec


def read_to_the_end(rows: Iterator[Any]) -> None:
    """Read what is left of a task's input.  PySpark reuses a Python worker for a later task only when its
    task read the input to the end; otherwise the next stage forks fresh workers, which import torch again."""
    for _ in rows:
        pass


def arrow_output(task: Callable[[Iterator[Any]], Iterator[dict[str, Any]]]) -> Callable:
    """Adapt a barrier task to ``mapInArrow``: its summary leaves as one JSON string column."""
    import json

    import pyarrow as pa

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for summary in task(batches):
            yield pa.RecordBatch.from_pydict({"summary": [json.dumps(summary)]})

    return run


def build_replica(spec: JobSpec, rank: int, device: torch.device, rows: RowSource | None = None) -> FlatReplica:
    """This worker's model copy on ``device``, holding the initial weights of the spec; its embedding tables
    (``spec.tables``) pull their rows from ``rows``."""
    require_address_space(REPLICA_BUILD_BYTES_PER_PARAMETER * spec.initial_weights.size, "the model replica",
                          MEMORY_ADVICE)
    torch.manual_seed(spec.config.seed + rank)   # dropout and other randomness differ per replica
    if spec.tables:
        if rows is None:
            raise ValueError("a model with embedding tables needs the parameter server's rows")
        with tables_without_rows():    # the rows stay on the PS: the replica never allocates a table
            model = spec.model_fn()
        prefetch_tables(model, swap_tables(model, rows), rows)
    else:
        model = spec.model_fn()
    replica = FlatReplica(model, device)
    replica.weights.copy_(torch.from_numpy(spec.initial_weights))
    return replica


@contextlib.contextmanager
def open_partition(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn, device: torch.device
               ) -> Iterator[tuple[PartitionBatches, CachedPartition]]:
    """This task's partition, kept as ``config.data_cache`` says, and its mini-batches; spill files go at the end."""
    config = env.spec.config
    tasks_on_host = _tasks_on_this_host(env)
    with cached_partition(read_chunks(rows), config.data_cache, config.loss, device, tasks_on_host) as cached:
        yield PartitionBatches(cached.partition, device, resolve_transform(config.batch_transform), config.seed,
                               env.rank, padding(config)), cached


def _tasks_on_this_host(env: TaskEnv) -> int:
    """How many of the run's tasks share this host's memory: counted in a barrier stage; in a plain
    stage (elastic), which tells a task nothing of the others, as many as this process's CPUs hold
    at once (at most num_workers): an upper bound, so data_cache='auto' may spill sooner than needed."""
    if hasattr(env.context, "getTaskInfos"):
        infos = env.context.getTaskInfos()
        host = infos[env.rank].address.rsplit(":", 1)[0]
        return sum(info.address.rsplit(":", 1)[0] == host for info in infos)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(env.spec.config.num_workers, cpus // max(1, env.context.cpus())))


def padding(config: TrainConfig) -> Padding:
    """How this run pads ragged inputs (``pad_value``, and ``sequence_length`` when set)."""
    return Padding(config.pad_value, config.sequence_length)


def model_call(spec: JobSpec, module: nn.Module) -> ModelCall:
    """How this run's batches reach ``module``'s forward (positional, or ``input_args`` with their masks)."""
    return ModelCall.for_module(module, spec.input_args)


def partition_summary(cached: CachedPartition) -> dict[str, Any]:
    """Where a task kept its partition, for its summary."""
    return {"data_cache": cached.cache, "partition_bytes": cached.nbytes}
