"""Executor side of ``policy="allreduce"``: the ring alternative to the parameter server.

Workers average gradients among themselves with ``torch.distributed`` (gloo on CPU, nccl on
GPU) and each steps an identical optimizer, so replicas stay identical.  The rendezvous is
one ``BarrierTaskContext.allGather`` at the start (rank 0's port and every partition size); no
Spark call happens per step.  Every rank returns its 1/N of the final weights; rank 0 also the run's history.
"""
from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.modes.allreduce.buckets import StepCollective
from sparkdl._internal.modes.allreduce.host_reduction import HostReduction
from sparkdl._internal.ps.server.policy import steps_per_epoch
from sparkdl._internal.ps.server.runlog import EpochRow, UpdateRow, row_values
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.rendezvous import process_group
from sparkdl._internal.spark.task import JobSpec, TaskEnv, build_replica, model_call, open_partition, partition_summary
from sparkdl._internal.training.flat import FlatReplica, flatten_buffers
from sparkdl._internal.training.loop import LoopPlan, run_step_loop, task_summary
from sparkdl._internal.training.losses import resolve_loss
from sparkdl._internal.training.optim import learning_rate_at, make_optimizer, tensor_layout
from sparkdl._internal.training.precision import MixedPrecision, worker_precision
from sparkdl._internal.training.steps import EpochTotals, TrainStep
from sparkdl.config import TrainConfig
from sparkdl.transforms import resolve_transform


class _Allreduce:
    """The exchange of one replica in the process group: every ``local_steps`` mini-batches the workers'
    gradients (or local SGD's model deltas) are averaged, row-weighted, and every replica takes the same step;
    rank 0 keeps the run's update and epoch rows."""

    def __init__(self, rank: int, world: int, replica: FlatReplica, config: TrainConfig, precision: MixedPrecision,
                 device: torch.device, planned_updates: int) -> None:
        self.rank, self.world, self.replica, self.precision, self.device = rank, world, replica, precision, device
        self.config, self.planned_updates = config, planned_updates
        self.local_sgd = config.local_update == "sgd"
        # CPU ranks on one host reduce in shared memory (overlap asks for the group's buckets); elsewhere one
        # collective a step: the gradient and the step's statistics, in buckets during backward when overlapped
        shared = None
        if device.type == "cpu" and world > 1 and not config.overlap_communication:
            shared = HostReduction.open(replica, rank, world)
        self.collective: StepCollective | HostReduction = (
            shared or StepCollective(replica, overlap=config.overlap_communication))
        self.reduction = "shared_memory" if shared is not None else dist.get_backend()
        # steps the replica's own buffer
        self.optimizer = make_optimizer(config, replica.weights, tensor_layout(replica.model.parameters()))
        self.rows: list[UpdateRow] = []
        self.epoch_rows: list[EpochRow] = []
        self.totals = EpochTotals()
        self.version = 0
        self.anchor = replica.weights.clone() if self.local_sgd else None
        self.started = time.perf_counter()

    def local_step(self) -> None:
        if self.precision.unscale():   # a float16 step whose gradient overflowed is skipped
            self.optimizer.step(self.replica.grads)
        self.replica.release_grads()

    def before_backward(self, loss: float, samples: int, epoch: int, weight: float | None) -> None:
        """Overlapped: the step's statistics in place and its buckets armed; backward's hooks launch them.

        The loop leaves a streamed gradient unweighted (the batch's mean), so each bucket takes its rows'
        weight as it leaves."""
        rows_weight = float(samples) if weight is None else weight
        assert isinstance(self.collective, StepCollective)   # only the group's collective has buckets
        self.collective.start(loss * samples, samples, rows_weight, rows_weight)

    def step(self, divisor: float, samples: int, loss: float, epoch: int, weight: float | None) -> tuple[bool, bool]:
        replica, world, collective = self.replica, self.world, self.collective
        rows_weight = float(samples) if weight is None else weight
        if self.anchor is not None:   # average the workers' model deltas (local SGD / model averaging)
            torch.sub(self.anchor, replica.weights, out=replica.grads)
            reduced = collective.reduce(loss * samples, samples, rows_weight, 1.0, by_weight=False)
            torch.sub(self.anchor, reduced.gradient, alpha=1.0 / reduced.divisor, out=replica.weights)
            self.anchor.copy_(replica.weights)
        elif collective.buckets:
            reduced = collective.finish()
        else:
            # every worker's mean gradient weighs its rows' weight (their count without a weight column)
            reduced = collective.reduce(loss * samples, samples, rows_weight,
                                        rows_weight / divisor if divisor > 0 else 1.0)
        # float16: unscaled after the allreduce, so that every worker finds the same overflow (or none), skips
        # the same steps and keeps the same loss scale
        if not self.local_sgd and self.precision.unscale():
            # the PS's rate for this update: scaling, warm-up and schedule (local SGD's steps keep alpha0, as there)
            self.optimizer.lr = learning_rate_at(self.config, self.version, self.planned_updates)
            # clips the averaged gradient first, with grad_clip_norm
            self.optimizer.step(reduced.gradient, reduced.grad_scale())
        replica.release_grads()   # the next backward writes the gradient once: no zeroing pass
        self.version += 1
        if self.rank == 0:
            self.rows.append(UpdateRow(self.version, time.perf_counter() - self.started, epoch,
                                       reduced.loss_sum / max(reduced.rows, 1.0), int(reduced.rows), world, 0.0, 0, 1.0,
                                       0.0 if self.local_sgd else self.optimizer.lr))
        return True, False

    def epoch_end(self, epoch: int) -> bool:
        """The epoch's loss and trainStep metrics, row-weighted over the workers (rank 0 keeps them)."""
        rows, means = self.totals.take_over_group(self.device)
        if self.rank == 0 and rows:
            self.epoch_rows.append(EpochRow(epoch, self.version, time.perf_counter() - self.started, rows, means))
        return False


def train_allreduce(rank: int, world: int, data: PartitionBatches, spec: JobSpec, device: torch.device, steps: int,
                    task_attempt: int = 0) -> dict[str, Any]:
    """Train one replica in an initialised process group; rank 0 also returns the history."""
    started = time.perf_counter()
    config = spec.config
    replica = build_replica(spec, rank, device)
    precision = worker_precision(config.precision, device, replica.model.parameters())
    exchange = _Allreduce(rank, world, replica, config, precision, device,
                          planned_updates=-(-steps * config.epochs // config.local_steps))
    plan = LoopPlan(rank, data.rows, steps, config.epochs, config.batch_size, config.local_steps, config.seed,
                    config.shuffle, wrap_partition=True)
    call = model_call(spec, replica.model)
    step = TrainStep(resolve_loss(config.loss), call, resolve_transform(config.train_step, "train_step"))
    try:
        counters = run_step_loop(replica, step, data, plan, exchange.step,
                                 exchange.local_step if exchange.local_sgd else None, exchange.epoch_end,
                                 exchange.before_backward if exchange.collective.buckets else None,
                                 call=call, precision=precision, totals=exchange.totals)
    finally:
        exchange.collective.close()
    buffers = flatten_buffers(replica.model).to(device)
    if buffers.numel():
        dist.all_reduce(buffers)
        buffers /= world
    ring_bytes = 2 * (world - 1) / world * replica.grads.numel() * 4 * exchange.version
    summary = task_summary(plan, counters, task_attempt, started, int(ring_bytes), int(ring_bytes), device)
    summary["amp_skipped_steps"] = precision.skipped_steps
    summary["reduction"] = exchange.reduction
    # every replica holds the same weights (the same averaged steps), so each brings back its 1/N of
    # them: a task's result, which passes whole through its executor's JVM, stays at 4 P / N bytes
    # (rank 0 bringing all of a 50M-parameter model ran a 1g executor out of memory).  base64 text:
    # the summary also travels as JSON through mapInArrow
    summary["weights"] = base64.b64encode(torch.tensor_split(replica.weights, world)[rank].cpu().numpy()
                                          .tobytes()).decode()
    if rank == 0:
        summary["history_rows"] = [row_values(row) for row in exchange.rows]
        summary["epoch_rows"] = [row_values(row) for row in exchange.epoch_rows]
        summary["buffers"] = base64.b64encode(buffers.cpu().numpy().tobytes()).decode()
    return summary


def allreduce_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of allreduce training: rendezvous, process group, train."""
    device = select_device(env.spec.config.device, gpu_addresses(env.context.resources()))
    with open_partition(env, rows, read_chunks, device) as (data, cached):
        summary = _rendezvous_and_train(env, data, device)
    return {**summary, **partition_summary(cached)}


def _rendezvous_and_train(env: TaskEnv, data: PartitionBatches, device: torch.device) -> dict[str, Any]:
    config = env.spec.config
    # The one Spark-level rendezvous of the run: rank 0's port and every partition size.
    with process_group(env, device, config.timeout_s, n=data.rows) as gathered:
        if any(g["n"] == 0 for g in gathered):
            raise ValueError("allreduce needs data in every partition; lower num_workers")
        steps = steps_per_epoch("allreduce", {i: g["n"] for i, g in enumerate(gathered)}, config.batch_size)
        return train_allreduce(env.rank, len(gathered), data, env.spec, device, steps[env.rank], env.task_attempt)
