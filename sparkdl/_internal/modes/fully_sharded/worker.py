"""Executor side of ``policy="fsdp"``: fully sharded data parallelism in the barrier tasks.

Each task joins the run's process group (gloo on CPU, nccl on GPU), builds its replica sharded
(``training.fully_sharded``: only its own 1/N of every parameter is ever allocated), and steps a ``torch.optim``
optimizer over its shards.  Backward reduce-scatters each block's gradient (a mean over the workers); the step
scales it by the workers' summed rows' weight, so the update is the row-weighted mean gradient of all workers' batches,
exactly what ``policy="allreduce"`` applies.  Every rank returns its shards of the final weights; rank 0
also the buffers and the run's history.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.memory import return_large_blocks_when_freed
from sparkdl._internal.modes.fully_sharded.checkpoints import load_checkpoint, local_directory, prune, save_checkpoint
from sparkdl._internal.ps.server.policy import steps_per_epoch
from sparkdl._internal.ps.server.runlog import EpochRow, UpdateRow, row_values
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.rendezvous import process_group, process_groups_outlive_their_users
from sparkdl._internal.spark.task import TaskEnv, model_call, open_partition, partition_summary
from sparkdl._internal.training.fully_sharded import build_sharded, encode_state, local_state
from sparkdl._internal.training.loop import LoopPlan, run_step_loop, task_summary
from sparkdl._internal.training.losses import resolve_loss
from sparkdl._internal.training.optim import ADAM_BETAS, ADAM_EPS, learning_rate_at
from sparkdl._internal.training.steps import EpochTotals, TrainStep
from sparkdl.config import TrainConfig
from sparkdl.transforms import resolve_transform


class ShardedReplica:
    """A fully sharded model as the step loop sees it: its gradients stay in the parameters' ``.grad``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def ensure_grad_views(self) -> None:
        """Nothing to do: the gradients are the sharded parameters' own."""


def sharded_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``config.optimizer`` over this rank's shards, with the arithmetic of the other modes' flat optimizer:
    SGD with momentum and weight decay, Adam, or AdamW decaying only tensors of 2 or more dimensions (unless
    ``decay_all_parameters``; a shard keeps its parameter's dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = config.learning_rate
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=config.weight_decay)
    decayed = [p for p in params if p.dim() > 1 or config.decay_all_parameters]
    kept = [p for p in params if not (p.dim() > 1 or config.decay_all_parameters)]
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS)


class _ShardedStep:
    """The exchange of one sharded replica: the workers' step statistics summed, the summed gradient shards
    turned into the mean, clipped across shards, and one optimizer step; rank 0 keeps the run's rows."""

    def __init__(self, rank: int, world: int, model: nn.Module, config: TrainConfig, device: torch.device,
                 planned_updates: int) -> None:
        self.rank, self.world, self.config, self.device = rank, world, config, device
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = sharded_optimizer(config, model)
        self.planned_updates = planned_updates
        self.rows: list[UpdateRow] = []
        self.epoch_rows: list[EpochRow] = []
        self.totals = EpochTotals()
        self.version = 0
        self.started = time.perf_counter()
        self.checkpoints_written = 0
        self.written: list[Path] = []   # this run's checkpoints, oldest first
        self.directory = local_directory(config.checkpoint_dir) if config.checkpoint_dir else None

    def step(self, divisor: float, samples: int, loss: float, epoch: int, weight: float | None) -> tuple[bool, bool]:
        # [summed gradient's divisor, loss x rows, rows]: one small all-reduce a step
        stats = torch.tensor([divisor, loss * samples, float(samples)], dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)
        total_divisor, loss_sum, rows = stats.tolist()
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and total_divisor > 0:
            # the reduce-scatter averaged the workers' summed gradients: x world / summed divisor is their mean
            torch._foreach_div_(grads, total_divisor / self.world)
        if self.config.grad_clip_norm is not None:
            # the norm of the whole gradient: each shard's norm reduced over the group (DTensor)
            torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip_norm)
        rate = learning_rate_at(self.config, self.version, self.planned_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.rank == 0:
            self.rows.append(UpdateRow(self.version, time.perf_counter() - self.started, epoch,
                                       loss_sum / max(rows, 1.0), int(rows), self.world, 0.0, 0, 1.0, rate))
        return True, False

    def epoch_end(self, epoch: int) -> bool:
        """The epoch's loss and trainStep metrics, row-weighted over the workers (rank 0 keeps them)."""
        rows, means = self.totals.take_over_group(self.device)
        if self.rank == 0 and rows:
            self.epoch_rows.append(EpochRow(epoch, self.version, time.perf_counter() - self.started, rows, means))
        if self.directory is not None:
            self.written.append(save_checkpoint(self.directory, self.model, self.optimizer, epoch, self.version,
                                                self.config.batch_size * self.world, self.rank))
            self.checkpoints_written += 1
            if self.rank == 0:
                prune(self.written, self.config.checkpoint_keep)
        return False

    def resume(self, path: str, steps: int) -> int:
        """Load a sharded checkpoint; the mini-batch the run goes on from (the next epoch's first)."""
        progress = load_checkpoint(Path(path), self.model, self.optimizer)
        self.version = progress["version"]
        return (progress["epoch"] + 1) * steps


def _average_float_buffers(model: nn.Module, world: int) -> None:
    """BatchNorm statistics and other float buffers: the workers' mean (each saw its own batches)."""
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer)
            buffer /= world


def train_fully_sharded(env: TaskEnv, data: PartitionBatches, device: torch.device, steps: int,
                        world: int) -> dict[str, Any]:
    """Train this rank's shards in an initialised process group; rank 0 also returns the history."""
    from torch.distributed.device_mesh import init_device_mesh

    started = time.perf_counter()
    spec, rank = env.spec, env.rank
    config = spec.config
    mesh = init_device_mesh(device.type, (world,))
    model = build_sharded(spec.model_fn, config, mesh, device)
    torch.manual_seed(config.seed + rank)   # dropout and other randomness differ per replica
    replica = ShardedReplica(model)
    updates = -(-steps * config.epochs // config.local_steps)
    exchange = _ShardedStep(rank, world, model, config, device, updates)
    start_batch = exchange.resume(spec.resume_checkpoint, steps) if spec.resume_checkpoint else 0
    plan = LoopPlan(rank, data.rows, steps, config.epochs, config.batch_size, config.local_steps, config.seed,
                    config.shuffle, wrap_partition=True, start_batch=start_batch)
    call = model_call(spec, model)
    step = TrainStep(resolve_loss(config.loss), call, resolve_transform(config.train_step, "train_step"))
    counters = run_step_loop(replica, step, data, plan, exchange.step, None, exchange.epoch_end,
                             call=call, totals=exchange.totals)
    _average_float_buffers(model, world)
    sharded = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    # each step all-gathers every block's parameters twice (forward, backward) and reduce-scatters the gradient
    moved = int(3 * (world - 1) / world * total * 4 * exchange.version)
    summary = task_summary(plan, counters, env.task_attempt, started, moved // 3, 2 * moved // 3, device)
    summary["sharded_parameters"] = sharded
    summary["checkpoints_written"] = exchange.checkpoints_written
    summary["version"] = exchange.version
    summary["state"] = encode_state(local_state(model, with_buffers=rank == 0))
    if rank == 0:
        summary["history_rows"] = [row_values(row) for row in exchange.rows]
        summary["epoch_rows"] = [row_values(row) for row in exchange.epoch_rows]
    return summary


def fully_sharded_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of fully sharded training: rendezvous, process group, train."""
    config = env.spec.config
    return_large_blocks_when_freed()   # the blocks gathered and freed every step stay out of glibc's heaps
    device = select_device(config.device, gpu_addresses(env.context.resources()))
    with open_partition(env, rows, read_chunks, device) as (data, cached), process_groups_outlive_their_users():
        with process_group(env, device, config.timeout_s, n=data.rows) as gathered:
            if any(g["n"] == 0 for g in gathered):
                raise ValueError("fsdp needs data in every partition; lower num_workers")
            steps = steps_per_epoch("fsdp", {i: g["n"] for i, g in enumerate(gathered)}, config.batch_size)
            summary = train_fully_sharded(env, data, device, steps[env.rank], len(gathered))
    return {**summary, **partition_summary(cached)}
