"""Driver side of a training run: checks, the parameter server, the stage runner, the result."""
from __future__ import annotations

import base64
import contextlib
import functools
import secrets
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
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
from sparkdl._internal.modes.allreduce import allreduce_worker
from sparkdl._internal.modes.pipeline_launch import pipeline_summary, place_dataframe, place_rdd
from sparkdl._internal.modes.pipeline_worker import pipeline_worker
from sparkdl._internal.modes.progress import TrainingProgress
from sparkdl._internal.modes.ps_worker import ps_worker
from sparkdl._internal.modes.result import (
    TrainResult,
    epoch_metrics_summary,
    history_frames,
    validation_frame,
    with_epoch_metrics,
    with_validation,
)
from sparkdl._internal.modes.summary import run_summary, validation_summary
from sparkdl._internal.modes.work_units import unit_dataframe, unit_rdd
from sparkdl._internal.ps.server.checkpoint import CheckpointFiles, load_latest_checkpoint
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.limits import check_ps_memory
from sparkdl._internal.ps.server.parts import PartSpan
from sparkdl._internal.ps.server.runlog import EpochRow, RunLog, ServerStats, UpdateRow, ValidationRow
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.shards.coordinator import ShardCoordinator
from sparkdl._internal.ps.shards.ranges import interleaved_rows, merge_snapshots, shard_count, shard_spans
from sparkdl._internal.ps.tables import TableSpec, row_optimizer, with_state_of
from sparkdl._internal.ps.wire.tls import server_context
from sparkdl._internal.ps.worker.remote_embedding import attach_tables, detach_tables, table_specs, tables_without_rows
from sparkdl._internal.spark.backend import (
    CONNECT_RDD_MESSAGE,
    SparkBackend,
    active_connect_session,
    backend_for,
    is_connect_dataframe,
)
from sparkdl._internal.spark.barrier import BarrierStageFn, BarrierStageRunner, dataframe_barrier_stage, rdd_barrier_stage
from sparkdl._internal.spark.hadoop_files import checkpoint_files
from sparkdl._internal.spark.preflight import (
    bind_address,
    check_cluster,
    check_elastic_cluster,
    check_results_fit_driver,
    check_task_memory,
    ps_host,
    task_memory_limit,
)
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import (
    flatten_buffers,
    flatten_parameters,
    load_flat_buffers,
    load_flat_parameters,
    pool_buffers,
)
from sparkdl._internal.training.optim import tensor_layout
from sparkdl._internal.training.pipeline_cuts import PipelineSpec, StagePlan, build_whole, parse_cuts, plan_stages
from sparkdl.config import TrainConfig
from sparkdl.errors import SparkDLError
from sparkdl.transforms import resolve_transform


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
    if config.pipeline_stages > 1:
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
    if config.pipeline_stages > 1:
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
        template, from_factories = build_whole(model_fn)
    tables = table_specs(template, config)
    plan = None
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
        plan = plan_stages(template, stages, parse_cuts(config.pipeline_cuts), from_factories) if stages > 1 else None
        check_task_memory([plan.parameter_count(s) for s in range(stages)] if plan
                          else [flatten_parameters(template).numel()], task_memory_limit(backend), stages)
    if config.policy == "allreduce":
        return _drive_allreduce(backend, model_fn, config, run_barrier_stage, read_chunks, template, started,
                                input_args)
    if config.ps_hosts == "executors":
        return _drive_executor_shards(backend, model_fn, config, run_barrier_stage, read_chunks, template, started, plan,
                                      input_args, tables)
    return _drive_parameter_server(backend, model_fn, config, run_barrier_stage, read_chunks, template, started, plan,
                                   input_args, tables)


def shipped(config: TrainConfig) -> TrainConfig:
    """The settings the tasks receive: the callbacks stay on the driver, where they are called."""
    return config.replace(callbacks=()) if config.callbacks else config


def epoch_listener(config: TrainConfig, server: Callable[[], ParameterServer]) -> Callable[[EpochRow], bool]:
    """Calls every callback's ``on_epoch_end(epoch, metrics)`` for a completed epoch; True: stop training.

    ``metrics`` holds the epoch's mean training loss, the trainStep's metrics and, when the epoch
    was validated, ``val_loss`` and ``val_metric``.  A callback that raises fails the run with its
    traceback (the model and checkpoints are kept as they are).
    """
    callbacks = [_callback(c) for c in config.callbacks]

    def on_epoch(row: EpochRow) -> bool:
        ps = server()
        validated = ps.read(lambda core: next((v for v in core.log.validation if v.epoch == row.epoch), None))
        metrics = {**row.metrics, **({"val_loss": validated.val_loss, "val_metric": validated.val_metric}
                                     if validated is not None else {})}
        stop = False
        for callback in callbacks:
            try:
                stop = bool(callback.on_epoch_end(row.epoch, dict(metrics))) or stop
            except Exception:
                ps.fail(SparkDLError(f"callback {type(callback).__name__}.on_epoch_end failed after epoch "
                                     f"{row.epoch}:\n{traceback.format_exc()}"))
                return False
        return stop
    return on_epoch


def _callback(value: Any) -> Any:
    """A callback object: as given, or the object (or a new instance of the class) a 'module:qualname' names."""
    if not isinstance(value, str):
        return value
    target = resolve_transform(value, "callbacks")
    return target() if isinstance(target, type) else target


def _resume_checkpoint(config: TrainConfig, files: CheckpointFiles) -> dict:
    assert config.resume_from is not None   # called only when resume_from is set
    checkpoint = load_latest_checkpoint(config.resume_from, files)
    if checkpoint is None:
        raise SparkDLError(f"resume_from={config.resume_from!r} holds no complete checkpoint (ckpt-*.pt)")
    # the tables' state of this run's row optimizer only (what a shard's messages have room for)
    checkpoint["tables"] = [with_state_of(table, row_optimizer(config)) for table in checkpoint.get("tables", [])]
    return checkpoint


def tls_pems(config: TrainConfig) -> tuple[str | None, str | None]:
    """The run's certificate and key as PEM text (None, None: the run is not TLS)."""
    if not config.tls_cert:
        return None, None
    assert config.tls_key is not None   # TrainConfig requires tls_cert and tls_key together
    return Path(config.tls_cert).read_text(), Path(config.tls_key).read_text()


def _drive_parameter_server(backend: SparkBackend, model_fn: Callable[[], nn.Module], config: TrainConfig,
                            run_barrier_stage: BarrierStageFn, read_chunks: ChunksFn, template: nn.Module,
                            started: float, plan: StagePlan | None = None, input_args: tuple[str, ...] = (),
                            tables: tuple[TableSpec, ...] = ()) -> TrainResult:
    """PS policies: start the PS, run the stage (retries resume from the PS), read the result off the PS.

    With a stage ``plan`` (pipelines) each replica is P tasks, each pushing its stage's key range.
    The model's embedding ``tables`` are held by the PS as rows, outside the flat parameter vector.
    """
    table_modules = detach_tables(template)   # the template's parameters are then the flat vector's
    initial = flatten_parameters(template)
    float_buffers = flatten_buffers(template)
    float_buffer_count = float_buffers.numel()
    check_ps_memory(config, initial.numel(), float_buffer_count, tables)
    secret = secrets.token_bytes(32)
    advertised = ps_host(backend, config.ps_host)
    parts = None if plan is None else [PartSpan(p, b) for p, b in zip(plan.param_spans, plan.buffer_spans, strict=True)]
    cert_pem, key_pem = tls_pems(config)
    files = checkpoint_files(backend, config.checkpoint_dir, config.resume_from)
    ps = ParameterServer(config, initial, secret, host=bind_address(advertised), float_buffer_count=float_buffer_count,
                         tls=server_context(cert_pem, key_pem),
                         tensor_sizes=[p.numel() for p in template.parameters()], parts=parts,
                         tensor_layout=tensor_layout(template.parameters()),
                         epoch_listener=epoch_listener(config, lambda: ps) if config.callbacks else None,
                         checkpoint_files=files,
                         # the model's own initial rows (its init, under the run's seed), shared, not copied
                         tables=[EmbeddingTable(spec, learning_rate=config.learning_rate,
                                                rows=table_modules[spec.name].weight.detach()) for spec in tables])
    # a stage task gets its weights from the PS, so the spec does not carry the whole model to every task
    broadcast = initial.numpy() if plan is None else np.zeros(0, dtype=np.float32)
    pipeline = None if plan is None else PipelineSpec(plan, float_buffers.numpy())
    num_tasks = config.num_workers * config.pipeline_stages
    if config.resume_from:
        ps.restore(_resume_checkpoint(config, files))
    _, port = ps.start()
    description = f"policy={config.policy}, workers={config.num_workers}" + (
        f", pipeline stages={config.pipeline_stages}" if plan is not None else "")
    runner = BarrierStageRunner(backend, run_barrier_stage, read_chunks, ps_worker if plan is None else pipeline_worker,
                                description, config.max_attempts, config.timeout_s, ps, num_tasks=num_tasks)
    barrier_started = time.perf_counter()
    progress = (TrainingProgress(ps, f"sparkdl {config.policy} x{config.num_workers}") if config.verbose
                else contextlib.nullcontext())
    try:
        with progress:
            workers = runner.run(lambda barrier_attempt: JobSpec(
                shipped(config), model_fn, broadcast, advertised, port, secret, barrier_attempt, cert_pem, pipeline,
                input_args=input_args, report_epochs=bool(config.callbacks) or config.train_step is not None,
                tables=tables))
    finally:
        ps.stop()
    if ps.failure is not None:
        raise ps.failure
    ps.write_checkpoint(final=True)   # the final state, when checkpoints are on
    stats = ps.stats
    return _ps_result(config, template, workers, runner, started, barrier_started, ps.final_weights(),
                      ps.core.reported_float_buffers(), ps.core.log, ps.core, ps.events,
                      version=ps.version, samples_consumed=ps.core.samples_consumed,
                      peak_workers=ps.core.peak_workers,
                      sample_budget=ps.core.sample_budget, checkpoints_written=ps.checkpoints_written,
                      refused_connections=stats.auth_failures,
                      checkpoint_failures=stats.checkpoint_failures, ps_hosts="driver", ps_shards=1,
                      resumed_from_version=next((e["version"] for e in ps.events if e["event"] == "resumed"), None),
                      tables=(table_modules, ps.read(lambda core: core.final_tables())),
                      # every pushed and pulled byte crossed the driver
                      driver_bytes=sum(w["bytes_pushed"] + w["bytes_pulled"] for w in workers))


def _drive_executor_shards(backend: SparkBackend, model_fn: Callable[[], nn.Module], config: TrainConfig,
                           run_barrier_stage: BarrierStageFn, read_chunks: ChunksFn, template: nn.Module,
                           started: float, plan: StagePlan | None = None, input_args: tuple[str, ...] = (),
                           tables: tuple[TableSpec, ...] = ()) -> TrainResult:
    """``ps_hosts="executors"``: barrier task i hosts PS shard i; the driver coordinates and keeps snapshots.

    A retried stage resumes every shard from the newest consistent cut of snapshots.  With a
    stage ``plan`` (pipelines) shard p holds stage p's key range, hosted by task p (stage p of
    replica 0); the driver sends each shard its initial range, since no task gets the whole model.
    The embedding ``tables`` are split by rows: shard i holds every S-th row from row i on.
    """
    table_modules = detach_tables(template)
    initial = flatten_parameters(template)
    float_buffers = flatten_buffers(template)
    float_buffer_count = float_buffers.numel()
    check_ps_memory(config, initial.numel(), float_buffer_count, tables)   # the snapshots the driver keeps
    # the tables count towards the shards a model is worth, but every shard needs a dense range too
    shards = min(shard_count(initial.numel() + sum(t.rows * t.dim for t in tables), config.ps_shards),
                 initial.numel())
    spans = list(plan.param_spans) if plan is not None else shard_spans(initial.numel(), shards)
    secret = secrets.token_bytes(32)
    advertised = ps_host(backend, config.ps_host)
    cert_pem, key_pem = tls_pems(config)
    files = checkpoint_files(backend, config.checkpoint_dir, config.resume_from)
    coordinator = ShardCoordinator(config, secret, spans, bind_address(advertised), tls=server_context(cert_pem, key_pem),
                                   resume=_resume_checkpoint(config, files) if config.resume_from else None,
                                   initial=initial if plan is not None else None,
                                   log_shard=len(spans) - 1 if plan is not None else 0, checkpoint_files=files,
                                   tables=[table_modules[t.name].weight.detach() for t in tables], table_specs=tables)
    _, port = coordinator.start()
    tensor_sizes = tuple(p.numel() for p in template.parameters())
    tensor_decays = tuple(decays for _, decays in tensor_layout(template.parameters()))
    broadcast = initial.numpy() if plan is None else np.zeros(0, dtype=np.float32)
    pipeline = None if plan is None else PipelineSpec(plan, float_buffers.numpy())
    runner = BarrierStageRunner(backend, run_barrier_stage, read_chunks, ps_worker if plan is None else pipeline_worker,
                                f"policy={config.policy}, workers={config.num_workers}, PS shards={len(spans)} on executors"
                                + (f", pipeline stages={config.pipeline_stages}" if plan is not None else ""),
                                config.max_attempts, config.timeout_s, coordinator,
                                num_tasks=config.num_workers * config.pipeline_stages)

    def spec_for(barrier_attempt: int) -> JobSpec:
        coordinator.begin_attempt(barrier_attempt)
        return JobSpec(shipped(config), model_fn, broadcast, advertised, port, secret, barrier_attempt, cert_pem, pipeline,
                       ps_shards=tuple(spans), tls_key_pem=key_pem, tensor_sizes=tensor_sizes,
                       tensor_decays=tensor_decays,
                       float_buffer_count=float_buffer_count, log_shard=coordinator.log_shard, input_args=input_args,
                       tables=tables)

    barrier_started = time.perf_counter()
    progress = (TrainingProgress(coordinator, f"sparkdl {config.policy} x{config.num_workers}, {len(spans)} shards")
                if config.verbose else contextlib.nullcontext())
    try:
        with progress:
            workers = runner.run(spec_for)
    finally:
        coordinator.stop()
    if coordinator.failure is not None:
        raise coordinator.failure
    finals = coordinator.final_states()
    if config.checkpoint_dir:
        coordinator.write_checkpoint(merge_snapshots([f["snapshot"] for f in finals], same_version=False), final=True)
    lead = finals[coordinator.log_shard]   # its run log records every push with its loss, like a single PS's
    run_log = RunLog()
    run_log.load(lead["log"])
    run_log.stats = ServerStats(**lead["stats"])
    for name, value in coordinator.prior_stats.items():   # stage attempts that were given up count too
        setattr(run_log.stats, name, getattr(run_log.stats, name) + value)
    # the optimizer and aggregation work is spread over the shards: the summary reports their sum
    run_log.stats.optimizer_seconds = sum(f["stats"]["optimizer_seconds"] for f in finals)
    run_log.stats.aggregate_seconds = sum(f["stats"]["aggregate_seconds"] for f in finals)
    run_log.stats.handler_cpu_seconds = sum(f["stats"]["handler_cpu_seconds"] for f in finals)
    best = lead["best_validation"]
    validation_view = SimpleNamespace(log=run_log, best_validation=ValidationRow(*best) if best else None,
                                      stopped_early=lead["stopped_early"])
    versions = [int(f["snapshot"]["version"]) for f in finals]
    # the best epoch's rows where a shard kept them, else its final snapshot's
    final_tables = {table.name: interleaved_rows([f["snapshot"]["tables"][i]["weight"] if f["final_tables"] is None
                                                  else f["final_tables"][i] for f in finals])
                    for i, table in enumerate(tables)}
    return _ps_result(config, template, workers, runner, started, barrier_started,
                      torch.cat([f["snapshot"]["weights"] if f["final_weights"] is None else f["final_weights"]
                                 for f in finals]), _pooled_reports(finals), run_log,
                      validation_view, run_log.events + coordinator.events,
                      version=versions[0], shard_versions=versions, samples_consumed=lead["samples_consumed"],
                      sample_budget=lead["sample_budget"], checkpoints_written=coordinator.checkpoints_written,
                      checkpoint_failures=coordinator.checkpoint_failures,
                      refused_connections=coordinator.refused_connections, ps_hosts="executors",
                      ps_shards=len(spans), shard_sizes=[hi - lo for lo, hi in spans],
                      shard_snapshots=coordinator.snapshots_received, driver_bytes=coordinator.driver_bytes,
                      shard_rows_sent=coordinator.rows_sent,
                      resumed_from_version=coordinator.resumed_from,
                      restarted_from_versions=[e["version"] for e in coordinator.events
                                               if e["event"] == "resumed_from_cut"],
                      tables=(table_modules, final_tables))


def _pooled_reports(finals: list[dict]) -> list[tuple[torch.Tensor, int]]:
    """Each worker's float buffers, from the shards that pooled them (shard 0, or every pipeline stage's
    shard its stage's range, in range order)."""
    reports = [f["float_buffers"] for f in finals if f["float_buffers"]]
    return [(torch.cat([r[i][0] for r in reports]), reports[0][i][1]) for i in range(len(reports[0]))] if reports else []


def _ps_result(config: TrainConfig, template: nn.Module, workers: list[dict[str, Any]], runner: BarrierStageRunner,
               started: float, barrier_started: float, weights: torch.Tensor,
               reported_buffers: list[tuple[torch.Tensor, int]], run_log: RunLog, validation_view: Any,
               events: list[dict[str, Any]],
               tables: tuple[dict[str, nn.Embedding | nn.EmbeddingBag], dict[str, torch.Tensor]] | None = None,
               **counts: Any) -> TrainResult:
    """The result of a parameter-server run (one driver PS, or executor-hosted shards).

    ``run_log`` holds every update and gradient (each shard's run log records every push);
    ``validation_view`` has the ``log``, ``best_validation`` and ``stopped_early`` of the run;
    ``tables``: the tables taken out of ``template`` and their final rows, put back into it.
    """
    stage_seconds = time.perf_counter() - barrier_started
    load_flat_parameters(template, weights)
    if tables is not None:
        attach_tables(template, *tables)
    if reported_buffers:
        load_flat_buffers(template, pool_buffers(template, reported_buffers))
    history, epochs, gradients = history_frames(run_log.updates, run_log.gradients)
    validation = validation_frame(run_log.validation)
    epochs = with_epoch_metrics(with_validation(epochs, validation), run_log.epochs)
    workers = sorted(workers, key=lambda w: (w["worker"], w.get("pipeline_stage", 0)))
    _warn_of_tcp_fallback(workers)
    stats = run_log.stats
    summary = run_summary(
        config, workers, history, gradients, runner.attempts, started, stage_seconds,
        updates=stats.updates, pushes=stats.pushes, applied_gradients=stats.applied_gradients,
        dropped_stale=stats.dropped_stale, dropped_late=stats.dropped_late,
        rejected_nonfinite=stats.rejected_nonfinite, pushes_past_end=stats.past_end,
        refused_gradients=stats.refused_gradients, discarded_on_loss=stats.discarded_on_loss,
        protocol_errors=stats.protocol_errors, ps_aggregate_seconds=stats.aggregate_seconds,
        ps_optimizer_seconds=stats.optimizer_seconds, ps_handler_cpu_seconds=stats.handler_cpu_seconds,
        workers_lost=stats.workers_lost, rejoins=stats.rejoins, late_joins=stats.late_joins, **counts,
        **validation_summary(config, validation_view), **pipeline_summary(config, workers),
        **epoch_metrics_summary(run_log.epochs))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, events=events,
                       attempts=runner.attempts, validation=validation)


def _warn_of_tcp_fallback(workers: list[dict[str, Any]]) -> None:
    """Say once, on the driver, that workers were offered shared memory and went over TCP (each says why)."""
    notes = [w["transport_note"] for w in workers if w.get("transport_note")]
    if notes:
        warnings.warn(f"{len(notes)} of {len(workers)} workers exchanged over TCP although the parameter server "
                      f"offered shared memory: {notes[0]} (every worker's reason: TrainResult.workers "
                      "'transport_note'; ps_transport='tcp' takes TCP on purpose and says nothing)", stacklevel=4)


def _drive_allreduce(backend: SparkBackend, model_fn: Callable[[], nn.Module], config: TrainConfig,
                     run_barrier_stage: BarrierStageFn, read_chunks: ChunksFn, template: nn.Module,
                     started: float, input_args: tuple[str, ...] = ()) -> TrainResult:
    """``policy="allreduce"``: no parameter server; workers average gradients with torch.distributed.

    A failed attempt restarts from the initial weights (there is no PS state to resume from).
    """
    initial = flatten_parameters(template)
    check_results_fit_driver(4 * -(-4 * initial.numel() // 3), backend.driver_heap_bytes(),
                             "allreduce's final weights (base64 text, each rank 1/N of them)",
                             "train with the parameter server (policy='sync', where the weights stay on the "
                             "PS; ps_hosts='executors' for large models)")
    runner = BarrierStageRunner(backend, run_barrier_stage, read_chunks, allreduce_worker,
                                f"policy=allreduce, workers={config.num_workers}", config.max_attempts, config.timeout_s,
                                num_tasks=config.num_workers)
    barrier_started = time.perf_counter()
    workers = runner.run(lambda barrier_attempt: JobSpec(shipped(config), model_fn, initial.numpy(),
                                                         barrier_attempt=barrier_attempt, input_args=input_args))
    stage_seconds = time.perf_counter() - barrier_started
    workers = sorted(workers, key=lambda w: w["worker"])
    lead = workers[0]
    # each rank brought back its 1/N of the (identical) final weights, in rank order
    weights = np.concatenate([np.frombuffer(base64.b64decode(w.pop("weights")), dtype=np.float32)
                              for w in workers])
    load_flat_parameters(template, torch.from_numpy(weights))
    float_buffers = np.frombuffer(base64.b64decode(lead.pop("buffers")), dtype=np.float32)
    if float_buffers.size:
        load_flat_buffers(template, torch.from_numpy(float_buffers.copy()))
    rows = [UpdateRow(*row) for row in lead.pop("history_rows")]
    epoch_rows = [EpochRow(*row) for row in lead.pop("epoch_rows")]
    history, epochs, gradients = history_frames(rows, [])
    epochs = with_epoch_metrics(epochs, epoch_rows)
    summary = run_summary(config, workers, history, gradients, runner.attempts, started, stage_seconds,
                           updates=len(rows), version=len(rows), pushes=sum(w["pushes"] for w in workers),
                           applied_gradients=len(rows) * config.num_workers, dropped_stale=0,
                           rejected_nonfinite=0, checkpoints_written=0, workers_lost=0, rejoins=0,
                           resumed_from_version=None, **epoch_metrics_summary(epoch_rows))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, attempts=runner.attempts)
