"""The allreduce step's one collective: the gradient and the statistics together, and its buckets launched while
backward runs (two real gloo ranks in local task processes)."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparkdl._internal.modes.allreduce.buckets import StepCollective
from sparkdl._internal.training.flat import FlatReplica
from tests.unit.modes.local_stage import local_barrier_stage

#: each rank's rows' weight: the reduced gradient is w0 g0 + w1 g1
WEIGHTS = (3.0, 5.0)


class WithUnused(nn.Module):
    """Three layers, the middle one never used: its bucket is not reached by backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.unused, self.last = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.first(x)))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11 + rank)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _replica() -> FlatReplica:
    torch.manual_seed(5)
    return FlatReplica(WithUnused(), torch.device("cpu"))


def _loss(replica: FlatReplica, rank: int) -> torch.Tensor:
    x, y = _batch(rank)
    return nn.functional.cross_entropy(replica.model(x), y)


def _step(task_rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    from pyspark import TaskContext

    context = TaskContext.get()
    assert context is not None
    rank = context.partitionId()
    port = ""
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
    port = context.allGather(port)[0]   # type: ignore[attr-defined]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        expected = None
        for peer in (0, 1):       # what the reduction must give: each rank's gradient times its weight, summed
            replica = _replica()
            _loss(replica, peer).backward()
            term = replica.grads * WEIGHTS[peer]
            expected = term if expected is None else expected + term
        outcome: dict[str, Any] = {"rank": rank}
        for overlap in (False, True):
            replica = _replica()
            collective = StepCollective(replica, overlap, bucket_bytes=(64, 64))
            loss = _loss(replica, rank)
            if overlap:
                collective.start(loss.item() * 8, 8, WEIGHTS[rank], WEIGHTS[rank])
                loss.backward()
                outcome["launched_in_backward"] = len(collective._handles)
                outcome["buckets"] = len(collective.buckets)
                collective.finish()
            else:
                loss.backward()
                collective.reduce(loss.item() * 8, 8, WEIGHTS[rank], WEIGHTS[rank])
            collective.close()
            assert expected is not None
            outcome[f"error_{overlap}"] = float((replica.grads - expected).abs().max())
            outcome[f"statistics_{overlap}"] = collective.statistics.tolist()[1:]
            outcome[f"unused_{overlap}"] = float(replica.model.unused.weight.grad.abs().max())
        yield outcome
    finally:
        dist.destroy_process_group()


def test_buckets_leave_during_backward_and_reduce_to_what_one_collective_gives():
    outcomes = local_barrier_stage([[], []])(_step)
    for outcome in outcomes:
        for overlap in (False, True):
            assert outcome[f"error_{overlap}"] < 1e-6, (overlap, outcome)
            # the rows and their weights summed over both ranks, in the gradient's own collective
            assert outcome[f"statistics_{overlap}"] == [16.0, sum(WEIGHTS)]
            assert outcome[f"unused_{overlap}"] == 0.0
        assert outcome["buckets"] >= 4
        # the last layer's buckets left while backward still ran; the unused layer's (and those after it, in
        # launch order) only once backward ended
        assert 1 <= outcome["launched_in_backward"] < outcome["buckets"]
