"""Driver side of executor-hosted PS shards (``Mode.EXECUTOR_SHARDS``, ``Mode.PIPELINE_EXECUTOR_SHARDS``): the
driver coordinates the shards the barrier tasks host and keeps their snapshots."""
from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

import numpy as np
import torch

from sparkdl._internal.modes.launch import Launch, resume_checkpoint, shipped, tls_pems
from sparkdl._internal.modes.parameter_server.result import pooled_reports, ps_result
from sparkdl._internal.modes.parameter_server.worker import ps_worker
from sparkdl._internal.modes.pipeline.worker import pipeline_worker
from sparkdl._internal.modes.progress import TrainingProgress
from sparkdl._internal.modes.result import (
    TrainResult,
)
from sparkdl._internal.ps.server.limits import check_ps_memory
from sparkdl._internal.ps.server.runlog import RunLog, ServerStats, ValidationRow
from sparkdl._internal.ps.shards.coordinator import ShardCoordinator
from sparkdl._internal.ps.shards.ranges import interleaved_rows, merge_snapshots, shard_count, shard_spans
from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire.tls import server_context
from sparkdl._internal.ps.worker.remote_embedding import detach_tables
from sparkdl._internal.spark.barrier import BarrierStageRunner
from sparkdl._internal.spark.hadoop_files import checkpoint_files
from sparkdl._internal.spark.preflight import (
    bind_address,
    ps_host,
)
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import (
    flatten_buffers,
    flatten_parameters,
)
from sparkdl._internal.training.optim import tensor_layout
from sparkdl._internal.training.pipeline_cuts import PipelineSpec


def drive_executor_shards(launch: Launch) -> TrainResult:
    """``ps_hosts="executors"``: barrier task i hosts PS shard i; the driver coordinates and keeps snapshots.

    A retried stage resumes every shard from the newest consistent cut of snapshots.  With a
    stage ``layout`` (pipelines) shard p holds stage p's key range, hosted by task p (stage p of
    replica 0); the driver sends each shard its initial range, since no task gets the whole model.
    The embedding ``tables`` are split by rows: shard i holds every S-th row from row i on.
    """
    backend, model_fn, config, template = launch.backend, launch.model_fn, launch.config, launch.template
    layout, input_args, tables = launch.layout, launch.input_args, launch.tables
    table_modules = detach_tables(template)
    initial = flatten_parameters(template)
    float_buffers = flatten_buffers(template)
    float_buffer_count = float_buffers.numel()
    check_ps_memory(config, initial.numel(), float_buffer_count, tables)   # the snapshots the driver keeps
    # the tables count towards the shards a model is worth; a dense range is cut into no more shards than it has
    # values, but a model made only of tables has none, and each shard then holds an empty one
    shards = shard_count(initial.numel() + sum(t.rows * t.dim for t in tables), config.ps_shards)
    shards = min(shards, initial.numel()) if initial.numel() else shards
    spans = list(layout.param_spans) if layout is not None else shard_spans(initial.numel(), shards)
    secret = secrets.token_bytes(32)
    advertised = ps_host(backend, config.ps_host)
    cert_pem, key_pem = tls_pems(config)
    files = checkpoint_files(backend, config.checkpoint_dir, config.resume_from)
    coordinator = ShardCoordinator(config, secret, spans, bind_address(advertised), tls=server_context(cert_pem, key_pem),
                                   resume=resume_checkpoint(config, files) if config.resume_from else None,
                                   initial=initial if layout is not None else None,
                                   log_shard=len(spans) - 1 if layout is not None else 0, checkpoint_files=files,
                                   tables=[table_modules[t.name].weight.detach() for t in tables], table_specs=tables)
    _, port = coordinator.start()
    tensor_sizes = tuple(p.numel() for p in template.parameters())
    tensor_decays = tuple(decays for _, decays in tensor_layout(template.parameters()))
    broadcast = initial.numpy() if layout is None else np.zeros(0, dtype=np.float32)
    pipeline = None if layout is None else PipelineSpec(layout, float_buffers.numpy())
    task = pipeline_worker if launch.mode.pipelined else ps_worker
    runner = BarrierStageRunner(backend, launch.run_barrier_stage, launch.read_chunks, task,
                                f"policy={config.policy}, workers={config.num_workers}, PS shards={len(spans)} on executors"
                                + (f", pipeline stages={config.pipeline_stages}" if layout is not None else ""),
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
    run_log = _run_log(lead, finals, coordinator.prior_stats)
    best = lead["best_validation"]
    versions = [int(f["snapshot"]["version"]) for f in finals]
    final_weights, final_tables = _final_state(finals, tables)
    return ps_result(config, template, workers, runner, launch.started, barrier_started,
                      final_weights, pooled_reports(finals), run_log,
                      ValidationRow(*best) if best else None, lead["stopped_early"], run_log.events + coordinator.events,
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


def _run_log(lead: dict[str, Any], finals: list[dict[str, Any]], prior_stats: dict[str, Any]) -> RunLog:
    """The run's log as the lead shard kept it, with every shard's share of the PS work and the counts of the
    stage attempts that were given up."""
    run_log = RunLog()
    run_log.load(lead["log"])
    run_log.stats = ServerStats(**lead["stats"])
    for name, value in prior_stats.items():   # stage attempts that were given up count too
        setattr(run_log.stats, name, getattr(run_log.stats, name) + value)
    # the optimizer and aggregation work is spread over the shards: the summary reports their sum
    for name in ("optimizer_seconds", "aggregate_seconds", "handler_cpu_seconds"):
        setattr(run_log.stats, name, sum(f["stats"][name] for f in finals))
    return run_log


def _final_state(finals: list[dict[str, Any]],
                 tables: tuple[TableSpec, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The run's weights and tables from the shards' final states: the best epoch's where a shard kept them
    (``restore_best_weights``), else its final snapshot's."""
    weights = torch.cat([f["snapshot"]["weights"] if f["final_weights"] is None else f["final_weights"] for f in finals])
    rows = {table.name: interleaved_rows([f["snapshot"]["tables"][i]["weight"] if f["final_tables"] is None
                                          else f["final_tables"][i] for f in finals])
            for i, table in enumerate(tables)}
    return weights, rows
