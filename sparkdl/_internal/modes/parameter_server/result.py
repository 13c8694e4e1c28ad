"""The result of a parameter-server run (one PS in the driver, or shards on the executors): the final weights
and tables put back into the model, the run log's tables and the summary."""
from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

from sparkdl._internal.modes.pipeline.launch import pipeline_summary
from sparkdl._internal.modes.result import (
    TrainResult,
    epoch_metrics_summary,
    history_frames,
    validation_frame,
    with_epoch_metrics,
    with_validation,
)
from sparkdl._internal.modes.summary import run_summary, validation_summary
from sparkdl._internal.ps.server.runlog import RunLog, ValidationRow
from sparkdl._internal.ps.worker.remote_embedding import attach_tables
from sparkdl._internal.spark.barrier import BarrierStageRunner
from sparkdl._internal.training.flat import load_flat_buffers, load_flat_parameters, pool_buffers
from sparkdl.config import TrainConfig


def pooled_reports(finals: list[dict]) -> list[tuple[torch.Tensor, int]]:
    """Each worker's float buffers, from the shards that pooled them (shard 0, or every pipeline stage's
    shard its stage's range, in range order)."""
    reports = [f["float_buffers"] for f in finals if f["float_buffers"]]
    return [(torch.cat([r[i][0] for r in reports]), reports[0][i][1]) for i in range(len(reports[0]))] if reports else []


def ps_result(config: TrainConfig, template: nn.Module, workers: list[dict[str, Any]], runner: BarrierStageRunner,
               started: float, barrier_started: float, weights: torch.Tensor,
               reported_buffers: list[tuple[torch.Tensor, int]], run_log: RunLog,
              best_validation: ValidationRow | None, stopped_early: bool,
               events: list[dict[str, Any]],
               tables: tuple[dict[str, nn.Embedding | nn.EmbeddingBag], dict[str, torch.Tensor]] | None = None,
               **counts: Any) -> TrainResult:
    """The result of a parameter-server run (one driver PS, or executor-hosted shards).

    ``run_log`` holds every update and gradient (each shard's run log records every push);
    ``best_validation`` and ``stopped_early``: what validation decided;
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
        workers_lost=stats.workers_lost, rejoins=stats.rejoins, late_joins=stats.late_joins,
        round_trips_per_step=_round_trips_per_step(workers),
        shared_tables_workers=sum(1 for w in workers if w.get("shared_tables")), **counts,
        **validation_summary(config, run_log.validation, best_validation, stopped_early),
        **pipeline_summary(config, workers),
        **epoch_metrics_summary(run_log.epochs))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, events=events,
                       attempts=runner.attempts, validation=validation)


def _round_trips_per_step(workers: list[dict[str, Any]]) -> float:
    """The round trips a worker's step waited on (pushes and table pulls), per push, over every worker."""
    pushes = sum(w.get("pushes", 0) for w in workers if "round_trips" in w)
    return sum(w["round_trips"] for w in workers if "round_trips" in w) / pushes if pushes else 0.0


def _warn_of_tcp_fallback(workers: list[dict[str, Any]]) -> None:
    """Say once, on the driver, that workers were offered shared memory and went over TCP (each says why)."""
    notes = [w["transport_note"] for w in workers if w.get("transport_note")]
    if notes:
        warnings.warn(f"{len(notes)} of {len(workers)} workers exchanged over TCP although the parameter server "
                      f"offered shared memory: {notes[0]} (every worker's reason: TrainResult.workers "
                      "'transport_note'; ps_transport='tcp' takes TCP on purpose and says nothing)", stacklevel=4)
