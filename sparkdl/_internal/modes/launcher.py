"""Where every training run starts on the driver: the checks, the model's template, then its mode's driver.

``train`` (an RDD) and ``train_dataframe`` (a DataFrame) place the data; ``_train`` checks the
settings and the cluster, builds the model once (its embedding tables and pipeline cut), and
hands a :class:`~sparkdl._internal.modes.launch.Launch` to the driver :data:`DRIVERS` names for the
run's :class:`~sparkdl._internal.mode.Mode`.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pyspark import RDD
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from torch import nn

from sparkdl._internal.combinations import check_combinations, table_refusal
from sparkdl._internal.data.arrow import arrow_chunks
from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.mode import Mode
from sparkdl._internal.modes.allreduce.driver import drive_allreduce
from sparkdl._internal.modes.executor_shards.driver import drive_executor_shards
from sparkdl._internal.modes.fully_sharded.driver import drive_fully_sharded
from sparkdl._internal.modes.launch import Launch
from sparkdl._internal.modes.parameter_server.driver import drive_parameter_server
from sparkdl._internal.modes.parameter_server.work_units import unit_dataframe, unit_rdd
from sparkdl._internal.modes.pipeline.launch import place_dataframe, place_rdd
from sparkdl._internal.modes.result import TrainResult
from sparkdl._internal.ps.server.limits import check_ps_memory
from sparkdl._internal.ps.worker.remote_embedding import table_specs, tables_without_rows
from sparkdl._internal.spark.backend import (
    CONNECT_RDD_MESSAGE,
    SparkBackend,
    active_connect_session,
    backend_for,
    is_connect_dataframe,
)
from sparkdl._internal.spark.barrier import BarrierStageFn, dataframe_barrier_stage, rdd_barrier_stage
from sparkdl._internal.spark.preflight import (
    check_cluster,
    check_elastic_cluster,
    check_fsdp_task_memory,
    check_task_memory,
    task_memory_limit,
)
from sparkdl._internal.training.flat import (
    flatten_buffers,
)
from sparkdl._internal.training.fully_sharded import scalar_parameters, shard_blocks
from sparkdl._internal.training.pipeline_cuts import build_whole, lay_out_stages, parse_cuts
from sparkdl.config import TrainConfig


def train(data: RDD, model_fn: Callable[[], nn.Module], config: TrainConfig | None = None, *,
          input_args: Sequence[str] = (), **overrides: Any) -> TrainResult:
    """Train ``model_fn()`` on an RDD of ``(features, label)`` or ``(features, label, weight)`` rows.

    ``features`` is one input, or a tuple of inputs in their own dtypes (ids as int64, ragged
    sequences padded per mini-batch; see :mod:`sparkdl._internal.data.rows`), given to ``forward``
    positionally or, with ``input_args``, as those keyword arguments.  The RDD is split into
    ``num_workers`` partitions (kept as is when it already has that many); each partition is
    one worker's data in a barrier stage.  Other keyword arguments override fields of
    ``config``.  Spark Connect has no RDDs: there, use ``TorchEstimator``.
    """
    _require_rdd(data)
    config = config or TrainConfig()
    config = config.replace(**overrides) if overrides else config
    if config.work_units:
        partitions = unit_rdd(data, config)
    elif data.getNumPartitions() == config.num_workers:
        partitions = data
    else:
        partitions = data.repartition(config.num_workers)
    if config.mode.pipelined:
        partitions = place_rdd(partitions, config.pipeline_stages)
    read_rows = functools.partial(row_chunks, rules=DataRules(max_length=config.sequence_length))
    return _train(backend_for(data.context), model_fn, config, rdd_barrier_stage(partitions, not config.elastic),
                  read_rows,
                  tuple(input_args))


def _require_rdd(data: Any) -> None:
    """Refuse what the RDD API cannot take, pointing Spark Connect and DataFrame users to the DataFrame API."""
    if isinstance(data, RDD):
        return
    if is_connect_dataframe(data) or active_connect_session() is not None:
        raise TypeError(CONNECT_RDD_MESSAGE)
    if isinstance(data, DataFrame):
        raise TypeError("sparkdl.train(rdd, ...) takes an RDD of (features, label) pairs; for a DataFrame use "
                        "TorchEstimator(model=model_fn, ...).fit(df)")
    raise TypeError(f"sparkdl.train(rdd, ...) takes an RDD of (features, label) pairs, got {type(data).__name__}")


def train_dataframe(df: DataFrame, model_fn: Callable[[], nn.Module], config: TrainConfig,
                    columns: ColumnSpec, rules: DataRules | None = None) -> TrainResult:
    """Train on a DataFrame: Arrow batches feed the workers through ``mapInArrow(barrier=True)``.

    Only the feature and label columns are shuffled into ``num_workers`` partitions.  Check the
    schema first (``columns.validate_columns``); with ``rules`` every task checks its rows as it
    loads them and fails the run with a :class:`~sparkdl.errors.DataError` before any update.
    """
    selected = df.select(*[F.col(f"`{c}`") for c in columns.columns])
    if config.mode.pipelined:
        partitions = place_dataframe(selected, config.num_workers, config.pipeline_stages)
    elif config.work_units:
        partitions = unit_dataframe(selected, config)
    else:
        partitions = selected.repartition(config.num_workers)
    return _train(backend_for(df.sparkSession), model_fn, config, dataframe_barrier_stage(partitions, not config.elastic),
                  functools.partial(arrow_chunks, spec=columns, rules=rules), columns.input_args)


def _train(backend: SparkBackend, model_fn: Callable[[], nn.Module], config: TrainConfig, run_barrier_stage: BarrierStageFn,
           read_chunks: ChunksFn, input_args: tuple[str, ...] = ()) -> TrainResult:
    """Preflight, the model template, then the mode's driver (``input_args``: forward's keyword arguments)."""
    if not callable(model_fn):
        raise ValueError("model_fn must be a zero-argument callable returning a torch.nn.Module")
    started = time.perf_counter()
    check_combinations(config, at="launch")
    stages = config.pipeline_stages
    check_cluster(backend, (config.min_workers or config.num_workers) * stages, wait_s=min(config.timeout_s, 60.0),
                  elastic=config.elastic, starters=config.min_workers is not None)
    if config.elastic:
        check_elastic_cluster(backend)
    torch.manual_seed(config.seed)
    with tables_without_rows():    # a table's rows are allocated once the PS is known to have room for them
        template, from_factories = _build_template(model_fn, config)
    tables = table_specs(template, config)
    if not tables and not any(p.numel() for p in template.parameters()):
        raise ValueError("the model has no parameters to train (no parameter tensor and no sparse=True embedding "
                         "table); check that model_fn builds its layers")
    layout = None
    if tables:
        if (refusal := table_refusal(config)) is not None:
            raise ValueError(f"the model's embedding tables {[t.name for t in tables]} (sparse=True, held by the "
                             f"parameter server as rows) cannot train here: {refusal}")
        if config.momentum or config.weight_decay:
            warnings.warn(f"momentum and weight_decay apply to the dense parameters only: the embedding tables "
                          f"{[t.name for t in tables]} step with {tables[0].optimizer!r} row by row, without them",
                          stacklevel=3)
        dense = sum(p.numel() for p in template.parameters() if not p.is_meta)   # a replica holds no table
        check_task_memory([dense], task_memory_limit(backend), stages)
        check_ps_memory(config, dense, flatten_buffers(template).numel(), tables)
        torch.manual_seed(config.seed)
        template, from_factories = build_whole(model_fn)    # with the rows: the tables' initial values
    else:
        layout = (lay_out_stages(template, stages, parse_cuts(config.pipeline_cuts), from_factories)
                  if config.mode.pipelined else None)
        if config.mode is Mode.FULLY_SHARDED:
            _check_sharded_memory(template, config, task_memory_limit(backend))
        else:
            check_task_memory([layout.parameter_count(s) for s in range(stages)] if layout
                              else [sum(p.numel() for p in template.parameters())], task_memory_limit(backend),
                              stages)
    launch = Launch(backend, model_fn, config, run_barrier_stage, read_chunks, template, started, layout, input_args,
                    tables)
    return DRIVERS[config.mode](launch)
def _check_sharded_memory(template: nn.Module, config: TrainConfig, limit_bytes: int | None) -> None:
    """Refuse an fsdp run whose workers cannot hold their shards and the largest block (its classes checked too),
    or whose model fully_shard cannot split."""
    if scalars := scalar_parameters(template):
        raise ValueError(f"fsdp splits every parameter along its first dimension, and {scalars} are 0-dim: make them "
                         "1-element tensors (shape [1])")
    parameters = sum(p.numel() for p in template.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in shard_blocks(template, config.shard_blocks)]
    largest = max([*blocks, parameters - sum(blocks)])   # the root gathers what no block holds
    optimizer_state = {"sgd": 4 if config.momentum else 0, "adam": 8, "adamw": 8}[config.optimizer]
    check_fsdp_task_memory(parameters, largest, config.num_workers, optimizer_state, limit_bytes)


def _build_template(model_fn: Callable[[], nn.Module], config: TrainConfig) -> tuple[nn.Module, bool]:
    """The model as the driver keeps it: built for real, or (fsdp, which never holds the whole model on the
    driver) on the meta device, when the factory can run there."""
    if config.mode is Mode.FULLY_SHARDED:
        try:
            with torch.device("meta"):
                return build_whole(model_fn)
        except Exception:   # noqa: S110 - e.g. a factory that loads weights: built for real, as in every mode
            pass
    return build_whole(model_fn)


#: each mode's driver: it starts what the mode needs, runs the barrier stage, and reads the result
DRIVERS: dict[Mode, Callable[[Launch], TrainResult]] = {
    Mode.PARAMETER_SERVER: drive_parameter_server,
    Mode.PIPELINE: drive_parameter_server,
    Mode.EXECUTOR_SHARDS: drive_executor_shards,
    Mode.PIPELINE_EXECUTOR_SHARDS: drive_executor_shards,
    Mode.ALLREDUCE: drive_allreduce,
    Mode.FULLY_SHARDED: drive_fully_sharded,
}
