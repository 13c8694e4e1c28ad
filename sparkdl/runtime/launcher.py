"""Driver side of a training run: checks, the parameter server, the stage runner, the result."""
from __future__ import annotations

import base64
import contextlib
import functools
import secrets
import ssl
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pyspark import RDD, SparkContext
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from torch import nn

from ..config import TrainConfig
from ..errors import SparkDLError
from ..ps.checkpoint import load_latest_checkpoint
from ..ps.limits import check_ps_memory
from ..ps.runlog import UpdateRow
from ..ps.transport import ParameterServer
from ..training.flat import (flatten_buffers, flatten_parameters, load_flat_buffers, load_flat_parameters,
                             pool_buffers)
from .allreduce import allreduce_worker
from .columns import ColumnSpec, arrow_to_arrays
from .data import rows_to_arrays
from .preflight import check_cluster, ps_host
from .progress import TrainingProgress
from .result import TrainResult, history_frames
from .stage import StageFn, StageRunner, dataframe_stage, rdd_stage
from .task import ArraysFn, JobSpec
from .worker import ps_worker


def train(data: RDD, model_fn: Callable[[], nn.Module], config: TrainConfig | None = None,
          **overrides: Any) -> TrainResult:
    """Train ``model_fn()`` on an RDD of ``(features, label)`` pairs with a parameter server.

    The RDD is split into ``num_workers`` partitions (kept as is when it already has that
    many); each partition is one worker's shard in a barrier stage.  Keyword arguments
    override fields of ``config``.
    """
    config = config or TrainConfig()
    config = config.replace(**overrides) if overrides else config
    shards = data if data.getNumPartitions() == config.num_workers else data.repartition(config.num_workers)
    return _train(data.context, model_fn, config, rdd_stage(shards), rows_to_arrays)


def train_dataframe(df: DataFrame, model_fn: Callable[[], nn.Module], config: TrainConfig,
                    columns: ColumnSpec) -> TrainResult:
    """Train on a DataFrame: Arrow batches feed the workers through ``mapInArrow(barrier=True)``.

    Only the feature and label columns are shuffled into ``num_workers`` partitions.
    Validate the columns first (``columns.validate_dataframe``).
    """
    shards = df.select(*[F.col(f"`{c}`") for c in columns.columns]).repartition(config.num_workers)
    return _train(df.sparkSession.sparkContext, model_fn, config, dataframe_stage(shards),
                  functools.partial(arrow_to_arrays, spec=columns))


def _train(sc: SparkContext, model_fn: Callable[[], nn.Module], config: TrainConfig, run_stage: StageFn,
           to_arrays: ArraysFn) -> TrainResult:
    """Preflight, the model template, then the mode's driver."""
    if not callable(model_fn):
        raise ValueError("model_fn must be a zero-argument callable returning a torch.nn.Module")
    started = time.perf_counter()
    check_cluster(sc, config.num_workers, wait_s=min(config.timeout_s, 60.0))
    torch.manual_seed(config.seed)
    template = model_fn()
    if not isinstance(template, nn.Module):
        raise ValueError(f"model_fn must return a torch.nn.Module, got {type(template).__name__}")
    drive = _drive_allreduce if config.policy == "allreduce" else _drive_parameter_server
    return drive(sc, model_fn, config, run_stage, to_arrays, template, started)


def _server_tls(config: TrainConfig) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def _drive_parameter_server(sc: SparkContext, model_fn: Callable[[], nn.Module], config: TrainConfig,
                            run_stage: StageFn, to_arrays: ArraysFn, template: nn.Module,
                            started: float) -> TrainResult:
    """PS policies: start the PS, run the stage (retries resume from the PS), read the result off the PS."""
    initial = flatten_parameters(template)
    float_buffer_count = flatten_buffers(template).numel()
    check_ps_memory(config, initial.numel(), float_buffer_count)
    secret = secrets.token_bytes(32)
    ps = ParameterServer(config, initial, secret, host=ps_host(sc, config.ps_host), float_buffer_count=float_buffer_count,
                         tls=_server_tls(config), tensor_sizes=[p.numel() for p in template.parameters()])
    if config.resume_from:
        checkpoint = load_latest_checkpoint(config.resume_from)
        if checkpoint is None:
            raise SparkDLError(f"resume_from={config.resume_from!r} holds no complete checkpoint (ckpt-*.pt)")
        ps.restore(checkpoint)
    host, port = ps.start()
    tls_pem = Path(config.tls_cert).read_text() if config.tls_cert else None
    runner = StageRunner(sc, run_stage, to_arrays, ps_worker, f"policy={config.policy}, workers={config.num_workers}",
                         config.max_attempts, config.timeout_s, ps)
    stage_started = time.perf_counter()
    progress = (TrainingProgress(ps, f"sparkdl {config.policy} x{config.num_workers}") if config.verbose
                else contextlib.nullcontext())
    try:
        with progress:
            workers = runner.run(lambda stage_attempt: JobSpec(config, model_fn, initial.numpy(), host, port, secret,
                                                               stage_attempt, tls_pem))
    finally:
        ps.stop()
    if ps.failure is not None:
        raise ps.failure
    ps.write_checkpoint(final=True)   # the final state, when checkpoints are on
    stage_seconds = time.perf_counter() - stage_started
    load_flat_parameters(template, ps.weights())
    reported_buffers = ps.core.reported_float_buffers()
    if reported_buffers:
        load_flat_buffers(template, pool_buffers(template, reported_buffers))
    history, epochs, gradients = history_frames(ps.core.log.updates, ps.core.log.gradients)
    workers = sorted(workers, key=lambda w: w["worker"])
    stats = ps.stats
    summary = _run_summary(
        config, workers, history, gradients, runner.attempts, started, stage_seconds,
        updates=stats.updates, version=ps.version, pushes=stats.pushes, applied_gradients=stats.applied_gradients,
        dropped_stale=stats.dropped_stale, dropped_late=stats.dropped_late,
        rejected_nonfinite=stats.rejected_nonfinite, samples_consumed=ps.core.samples_consumed,
        sample_budget=ps.core.sample_budget, pushes_past_budget=stats.past_budget,
        refused_gradients=stats.refused_gradients, discarded_on_loss=stats.discarded_on_loss,
        protocol_errors=stats.protocol_errors, ps_aggregate_seconds=stats.aggregate_seconds, ps_optimizer_seconds=stats.optimizer_seconds,
        ps_handler_cpu_seconds=stats.handler_cpu_seconds, checkpoints_written=ps.checkpoints_written,
        workers_lost=stats.workers_lost, rejoins=stats.rejoins, refused_connections=stats.auth_failures,
        checkpoint_failures=stats.checkpoint_failures,
        resumed_from_version=next((e["version"] for e in ps.events if e["event"] == "resumed"), None))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, events=ps.events,
                       attempts=runner.attempts)


def _drive_allreduce(sc: SparkContext, model_fn: Callable[[], nn.Module], config: TrainConfig,
                     run_stage: StageFn, to_arrays: ArraysFn, template: nn.Module, started: float) -> TrainResult:
    """``policy="allreduce"``: no parameter server; workers average gradients with torch.distributed.

    A failed attempt restarts from the initial weights (there is no PS state to resume from).
    """
    initial = flatten_parameters(template)
    runner = StageRunner(sc, run_stage, to_arrays, allreduce_worker,
                         f"policy=allreduce, workers={config.num_workers}", config.max_attempts, config.timeout_s)
    stage_started = time.perf_counter()
    workers = runner.run(lambda stage_attempt: JobSpec(config, model_fn, initial.numpy(), stage_attempt=stage_attempt))
    stage_seconds = time.perf_counter() - stage_started
    workers = sorted(workers, key=lambda w: w["worker"])
    lead = workers[0]
    weights = np.frombuffer(base64.b64decode(lead.pop("weights")), dtype=np.float32)
    load_flat_parameters(template, torch.from_numpy(weights.copy()))
    float_buffers = np.frombuffer(base64.b64decode(lead.pop("buffers")), dtype=np.float32)
    if float_buffers.size:
        load_flat_buffers(template, torch.from_numpy(float_buffers.copy()))
    rows = [UpdateRow(*row) for row in lead.pop("history_rows")]
    history, epochs, gradients = history_frames(rows, [])
    summary = _run_summary(config, workers, history, gradients, runner.attempts, started, stage_seconds,
                           updates=len(rows), version=len(rows), pushes=sum(w["pushes"] for w in workers),
                           applied_gradients=len(rows) * config.num_workers, dropped_stale=0,
                           rejected_nonfinite=0, checkpoints_written=0, workers_lost=0, rejoins=0,
                           resumed_from_version=None)
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, attempts=runner.attempts)


def _run_summary(config: TrainConfig, workers: list[dict[str, Any]], history: Any, gradients: Any,
                 attempts: list[dict[str, Any]], started: float, stage_seconds: float,
                 **counts: Any) -> dict[str, Any]:
    """The headline figures of a run: those every mode has, plus its own ``counts``.

    ``loop_seconds`` is the slowest worker's training loop (compute plus exchanges, which
    include the optimizer step in every mode), so samples/s mean the same for every policy.
    """
    samples = sum(w["samples"] for w in workers)
    loop_seconds = max((w["compute_seconds"] + w["communication_seconds"] for w in workers), default=0.0)
    return {
        "policy": config.policy, "num_workers": config.num_workers, "epochs": config.epochs,
        "batch_size": config.batch_size, **counts,
        "samples": samples, "train_seconds": time.perf_counter() - started, "stage_seconds": stage_seconds,
        "loop_seconds": loop_seconds, "samples_per_second": samples / loop_seconds if loop_seconds else 0.0,
        "staleness_mean": float(gradients["staleness"].mean()) if len(gradients) else 0.0,
        "staleness_max": int(gradients["staleness"].max()) if len(gradients) else 0,
        "bytes_pushed": sum(w["bytes_pushed"] for w in workers),
        "bytes_pulled": sum(w["bytes_pulled"] for w in workers),
        "attempts": len(attempts),
        "final_loss": float(history["loss"].iloc[-1]) if len(history) else float("nan"),
    }
