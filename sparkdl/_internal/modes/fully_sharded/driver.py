"""Driver side of ``Mode.FULLY_SHARDED``: no parameter server and no initial weights shipped; the barrier tasks
build and train their shards (``worker``), and the driver assembles the final state dict from them."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from sparkdl._internal.modes.fully_sharded.checkpoints import complete_checkpoints, local_directory, read_progress
from sparkdl._internal.modes.fully_sharded.worker import fully_sharded_worker
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
from sparkdl._internal.spark.preflight import check_results_fit_driver
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.fully_sharded import assemble_state, decode_state
from sparkdl.config import TrainConfig


def resume_point(config: TrainConfig, barrier_attempt: int, since: float) -> str | None:
    """The sharded checkpoint an attempt starts from: after a failed attempt the newest this run wrote, else the
    newest in ``resume_from``, else none; refused when it was trained with another global batch."""
    path: Path | None = None
    if barrier_attempt > 0 and config.checkpoint_dir:
        written = complete_checkpoints(local_directory(config.checkpoint_dir), since)
        path = written[-1][1] if written else None
    if path is None and config.resume_from:
        found = complete_checkpoints(local_directory(config.resume_from))
        if not found:
            raise ValueError(f"resume_from={config.resume_from!r} holds no complete fsdp checkpoint "
                             "(fsdp-epoch-*/ with its .metadata)")
        path = found[-1][1]
    if path is None:
        return None
    trained = read_progress(path)["global_batch"]
    if trained != config.batch_size * config.num_workers:
        raise ValueError(f"the checkpoint {str(path)!r} was trained with a global batch of {trained} rows; this run's "
                         f"is batch_size x num_workers = {config.batch_size} x {config.num_workers}: set batch_size so "
                         "that the global batch stays the same")
    return str(path)


#: the job spec's initial weights: none, every task initialises its own shards
_NO_WEIGHTS = np.empty(0, dtype=np.float32)


def drive_fully_sharded(launch: Launch) -> TrainResult:
    """``policy="fsdp"``: the workers train 1/N of the model each; the driver reads their shards back.

    The launcher's template was built on the meta device (no memory); the driver allocates the model's
    weights only at the end, when it assembles them.  A failed attempt starts again from the newest sharded
    checkpoint the run wrote (``checkpoint_dir``), else from ``resume_from``'s or the initial weights.
    """
    backend, config, template = launch.backend, launch.config, launch.template
    parameters = sum(p.numel() for p in template.parameters())
    check_results_fit_driver(4 * -(-4 * parameters // 3), backend.driver_heap_bytes(),
                             "fsdp's final weights (each rank's shards, as base64 text)",
                             "train with the parameter server and ps_hosts='executors', where the weights stay on "
                             "the executors")
    runner = BarrierStageRunner(backend, launch.run_barrier_stage, launch.read_chunks, fully_sharded_worker,
                                f"policy=fsdp, workers={config.num_workers}", config.max_attempts, config.timeout_s,
                                num_tasks=config.num_workers)
    barrier_started = time.perf_counter()
    since = time.time()
    workers = runner.run(lambda barrier_attempt: JobSpec(shipped(config), launch.model_fn, _NO_WEIGHTS,
                                                         barrier_attempt=barrier_attempt,
                                                         input_args=launch.input_args,
                                                         resume_checkpoint=resume_point(config, barrier_attempt,
                                                                                        since)))
    stage_seconds = time.perf_counter() - barrier_started
    workers = sorted(workers, key=lambda w: w["worker"])
    lead = workers[0]
    shards = [decode_state(w.pop("state")) for w in workers]
    state = assemble_state(iter(template.state_dict()), shards)
    rows = [UpdateRow(*row) for row in lead.pop("history_rows")]
    epoch_rows = [EpochRow(*row) for row in lead.pop("epoch_rows")]
    history, epochs, gradients = history_frames(rows, [])
    epochs = with_epoch_metrics(epochs, epoch_rows)
    resumed = lead["version"] - len(rows)
    summary = run_summary(config, workers, history, gradients, runner.attempts, launch.started, stage_seconds,
                          updates=len(rows), version=lead["version"], pushes=sum(w["pushes"] for w in workers),
                          applied_gradients=len(rows) * config.num_workers, dropped_stale=0,
                          rejected_nonfinite=0, checkpoints_written=lead["checkpoints_written"], workers_lost=0,
                          rejoins=0, resumed_from_version=resumed if resumed or lead["resumed_at_batch"] else None,
                          **epoch_metrics_summary(epoch_rows))
    return TrainResult(state, history, epochs, gradients, workers, summary, attempts=runner.attempts)
