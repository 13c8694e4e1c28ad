"""The one Spark-level rendezvous of a run whose tasks talk to each other with ``torch.distributed``.

Rank 0 picks a free port; one ``BarrierTaskContext.allGather`` hands it (and whatever each
task adds) to every task; then the process group forms over TCP.  No Spark call happens
per step.  On CUDA every task must hold its own GPU (NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ClusterConfigError
from .task import TaskEnv


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def process_group(env: TaskEnv, device: torch.device, timeout_s: float, **shared: Any
                  ) -> Iterator[list[dict[str, Any]]]:
    """Join the run's process group (gloo on CPU, nccl on GPU); yields every task's ``shared`` values.

    Leaving the block normally waits for every rank first, so no rank tears the group (and rank
    0's store) down while a peer still uses it; leaving on an error only tears this rank down.
    """
    context, rank = env.context, env.rank
    infos = context.getTaskInfos()
    host = infos[env.rank].address.rsplit(":", 1)[0]
    mine = {"port": free_port() if rank == 0 else 0, "host": host, "device": str(device), **shared}
    gathered = [json.loads(m) for m in context.allGather(json.dumps(mine))]
    kinds = {g["device"].split(":")[0] for g in gathered}
    if len(kinds) > 1:
        raise ClusterConfigError(f"the tasks of one run train on {sorted(kinds)}: they must all use CUDA or all the "
                                 "CPU (give every task a GPU with spark.task.resource.gpu.amount, or set device='cpu')")
    if device.type == "cuda":
        places = [(g["host"], g["device"]) for g in gathered]
        if len(set(places)) < len(places):
            raise ClusterConfigError("two tasks of one run would share a GPU, which NCCL refuses: let Spark assign one "
                                     "GPU per task (spark.task.resource.gpu.amount=1 with a discovery script)")
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{infos[0].address.rsplit(':', 1)[0]}:{gathered[0]['port']}",
                            rank=rank, world_size=len(infos), timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield gathered
        dist.barrier()
    finally:
        dist.destroy_process_group()
