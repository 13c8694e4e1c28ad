"""Driver side of ``Mode.ALLREDUCE``: no parameter server; the barrier tasks average their gradients with
torch.distributed and bring back the final weights, 1/N each."""
from __future__ import annotations

import base64
import time

import numpy as np
import torch

from sparkdl._internal.modes.allreduce.worker import allreduce_worker
from sparkdl._internal.modes.launch import Launch, shipped
from sparkdl._internal.modes.result import (
    TrainResult,
    epoch_metrics_summary,
    history_frames,
    with_epoch_metrics,
)
from sparkdl._internal.modes.summary import run_summary
from sparkdl._internal.ps.server.runlog import EpochRow, UpdateRow
from sparkdl._internal.spark.barrier import BarrierStageRunner
from sparkdl._internal.spark.preflight import (
    check_results_fit_driver,
)
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import (
    flatten_parameters,
    load_flat_buffers,
    load_flat_parameters,
)


def drive_allreduce(launch: Launch) -> TrainResult:
    """``policy="allreduce"``: no parameter server; workers average gradients with torch.distributed.

    A failed attempt restarts from the initial weights (there is no PS state to resume from).
    """
    backend, model_fn, config, template = launch.backend, launch.model_fn, launch.config, launch.template
    input_args = launch.input_args
    initial = flatten_parameters(template)
    check_results_fit_driver(4 * -(-4 * initial.numel() // 3), backend.driver_heap_bytes(),
                             "allreduce's final weights (base64 text, each rank 1/N of them)",
                             "train with the parameter server (policy='sync', where the weights stay on the "
                             "PS; ps_hosts='executors' for large models)")
    runner = BarrierStageRunner(backend, launch.run_barrier_stage, launch.read_chunks, allreduce_worker,
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
    summary = run_summary(config, workers, history, gradients, runner.attempts, launch.started, stage_seconds,
                           updates=len(rows), version=len(rows), pushes=sum(w["pushes"] for w in workers),
                           applied_gradients=len(rows) * config.num_workers, dropped_stale=0,
                           rejected_nonfinite=0, checkpoints_written=0, workers_lost=0, rejoins=0,
                           resumed_from_version=None, **epoch_metrics_summary(epoch_rows))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, attempts=runner.attempts)
