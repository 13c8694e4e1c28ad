"""Executor side of ``policy="allreduce"``: the ring alternative to the parameter server.

Workers average gradients among themselves with ``torch.distributed`` (gloo on CPU, nccl on
GPU) and each steps an identical optimizer, so replicas stay identical.  The rendezvous is
one ``BarrierTaskContext.allGather`` at the start (rank 0's port and every shard size); no
Spark call happens per step.  Rank 0 returns the run's history with its summary.
"""
from __future__ import annotations

import base64
import datetime
import functools
import json
import pickle
import socket
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..ps.flat import flatten_buffers
from ..ps.policy import LocalSteps, steps_per_epoch
from ..ps.server import make_optimizer
from .data import epoch_order
from .devices import gpu_addresses, select_device
from .worker import JobSpec, backward_step, build_replica, resolve_loss, shard_tensors


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def train_allreduce(rank: int, world: int, features: np.ndarray, labels: np.ndarray, spec: JobSpec,
                    device: torch.device, steps: int) -> dict[str, Any]:
    """Train one replica in an initialised process group; rank 0 also returns the history."""
    started = time.perf_counter()
    config = spec.config
    replica = build_replica(spec, rank, device)
    master = torch.nn.Parameter(replica.weights)          # shares storage: the optimizer steps the replica
    master.grad = replica.grads
    optimizer = make_optimizer(config, master)
    loss_fn = resolve_loss(config.loss)
    n = len(features)
    x, y = shard_tensors(features, labels, config.loss, device)
    local = LocalSteps(config.local_steps)
    stats = torch.zeros(2, dtype=torch.float64, device=device)     # (loss sum, samples) across workers
    rows: list[tuple] = []
    batches = version = pending_samples = 0
    pending_loss = 0.0
    compute_s = comm_s = 0.0
    total_batches = steps * config.epochs
    t0 = time.perf_counter()
    for epoch in range(config.epochs):
        order = epoch_order(n, epoch, config.seed, rank, config.shuffle, steps * config.batch_size).to(device)
        for k in range(steps):
            t = time.perf_counter()
            index = order[k * config.batch_size:(k + 1) * config.batch_size]
            pending_loss += backward_step(replica, loss_fn, x, y, index)
            pending_samples += len(index)
            batches += 1
            count = local.after_batch(last=batches == total_batches)
            compute_s += time.perf_counter() - t
            if not count:
                continue
            t = time.perf_counter()
            dist.all_reduce(replica.grads)
            replica.grads.div_(world * count)
            stats[0], stats[1] = pending_loss / count, pending_samples
            dist.all_reduce(stats)
            comm_s += time.perf_counter() - t
            optimizer.step()
            replica.zero_grads()
            version += 1
            if rank == 0:
                rows.append((version, time.perf_counter() - t0, epoch, float(stats[0]) / world, int(stats[1]),
                             world, 0.0, 0, 1.0))
            pending_loss, pending_samples = 0.0, 0
    buffers = flatten_buffers(replica.model).to(device)
    if buffers.numel():
        dist.all_reduce(buffers)
        buffers /= world
    ring_bytes = 2 * (world - 1) / world * replica.grads.numel() * 4 * version
    summary = {"worker": rank, "attempt": 0, "shard_size": n, "steps_per_epoch": steps, "resumed_at_batch": 0,
               "batches": batches, "pushes": version, "accepted": version, "samples": batches * config.batch_size,
               "compute_seconds": compute_s, "communication_seconds": comm_s,
               "wall_seconds": time.perf_counter() - started, "bytes_pushed": int(ring_bytes),
               "bytes_pulled": int(ring_bytes), "device": str(device)}
    if rank == 0:
        summary["history_rows"] = rows
        # base64 text: the summary also travels as JSON through mapInArrow
        summary["weights"] = base64.b64encode(replica.weights.cpu().numpy().tobytes()).decode()
        summary["buffers"] = base64.b64encode(buffers.cpu().numpy().tobytes()).decode()
    return summary


def make_allreduce_task(spec_broadcast: Any, to_arrays: Callable) -> Callable[[Iterator[Any]], Iterator[dict]]:
    """The barrier task of an allreduce run (a module-level function: pickled by reference)."""
    return functools.partial(run_allreduce_task, spec_broadcast, to_arrays)


def run_allreduce_task(spec_broadcast: Any, to_arrays: Callable, rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    spec: JobSpec = pickle.loads(spec_broadcast.value)
    config = spec.config
    torch.set_num_threads(max(1, context.cpus()))
    device = select_device(config.device, gpu_addresses(context.resources()))
    features, labels = to_arrays(rows)
    infos = context.getTaskInfos()
    world = len(infos)
    port = _free_port() if rank == 0 else 0
    # The one Spark-level rendezvous of the run: rank 0's port and every shard size.
    gathered = [json.loads(m) for m in context.allGather(json.dumps({"port": port, "n": len(features)}))]
    if any(g["n"] == 0 for g in gathered):
        raise ValueError("allreduce needs data in every partition; lower num_workers")
    host = infos[0].address.rsplit(":", 1)[0]
    steps = steps_per_epoch("sync", {i: g["n"] for i, g in enumerate(gathered)}, config.batch_size)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{host}:{gathered[0]['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.timeout_s))
    try:
        yield train_allreduce(rank, world, features, labels, spec, device, steps[rank])
    finally:
        dist.destroy_process_group()
