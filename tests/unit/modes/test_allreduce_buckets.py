"""The allreduce step's reductions: one collective for the gradient and the statistics together, its buckets launched
while backward runs, and the ranks of one host reducing in shared memory (two real gloo ranks in local task
processes)."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparkdl._internal.modes.allreduce import host_reduction
from sparkdl._internal.modes.allreduce.buckets import StepCollective
from sparkdl._internal.modes.allreduce.host_reduction import HostReduction
from sparkdl._internal.ps.wire.shared_memory import SHM_DIR
from sparkdl._internal.training.flat import FlatReplica
from tests.unit.modes.local_stage import local_barrier_stage

#: each rank's rows' weight: the reduced gradient is (w0 g0 + w1 g1) / (w0 + w1)
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


def _unused_span(replica: FlatReplica) -> slice:
    """Where the unused layer's weights and bias sit in the flat gradient."""
    first = sum(p.numel() for p in replica.model.first.parameters())
    return slice(first, first + sum(p.numel() for p in replica.model.unused.parameters()))


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
        expected = torch.zeros(0)
        for peer in (0, 1):       # what the reduction must give: the gradients weighted by their rows' weight
            replica = _replica()
            _loss(replica, peer).backward()
            expected = replica.grads * WEIGHTS[peer] / sum(WEIGHTS) + (expected if peer else 0)
        outcome: dict[str, Any] = {"rank": rank}
        for variant in ("group", "overlapped", "shared_memory"):
            replica = _replica()
            collective: StepCollective | HostReduction | None
            collective = (HostReduction.open(replica, rank, 2) if variant == "shared_memory"
                          else StepCollective(replica, variant == "overlapped", bucket_bytes=(64, 64)))
            assert collective is not None    # both ranks on this host
            loss = _loss(replica, rank)
            if isinstance(collective, StepCollective) and collective.buckets:
                collective.start(loss.item() * 8, 8, WEIGHTS[rank], WEIGHTS[rank])
                loss.backward()
                outcome["launched_in_backward"] = len(collective._handles)
                outcome["buckets"] = len(collective.buckets)
                reduced = collective.finish()
            else:
                loss.backward()
                reduced = collective.reduce(loss.item() * 8, 8, WEIGHTS[rank], WEIGHTS[rank])
            collective.close()
            gradient = reduced.gradient / reduced.divisor
            outcome[f"error_{variant}"] = float((gradient - expected).abs().max())
            outcome[f"statistics_{variant}"] = [reduced.rows]
            outcome[f"unused_{variant}"] = float(gradient[_unused_span(replica)].abs().max())
            if variant == "shared_memory":   # the gradient the optimizer reads is this rank's own region
                outcome["own_region"] = reduced.gradient.data_ptr() != replica.grads.data_ptr()
        # a rank that finds itself on another host maps nothing, and then no rank reduces in shared memory; the
        # file rank 0 made is gone (named here, since other tests' files may come and go in /dev/shm meanwhile)
        marker = f"test{os.getpid()}"
        host_reduction.secrets.token_hex = lambda nbytes: marker   # type: ignore[assignment]
        if rank == 1:
            host_reduction.host_identity = lambda: b"another host"
        outcome["fallback"] = HostReduction.open(_replica(), rank, 2) is None
        outcome["left_in_shm"] = os.path.exists(os.path.join(SHM_DIR, f"sparkdl-{marker}"))
        yield outcome
    finally:
        dist.destroy_process_group()


def test_every_reduction_gives_the_weighted_mean_and_buckets_leave_during_backward():
    outcomes = local_barrier_stage([[], []])(_step)
    for outcome in outcomes:
        for variant in ("group", "overlapped", "shared_memory"):
            assert outcome[f"error_{variant}"] < 1e-6, (variant, outcome)
            # the rows summed over both ranks, with the gradient
            assert outcome[f"statistics_{variant}"] == [16.0]
            assert outcome[f"unused_{variant}"] == 0.0
        assert outcome["own_region"]
        assert outcome["fallback"] and not outcome["left_in_shm"]
        assert outcome["buckets"] >= 4
        # the last layer's buckets left while backward still ran; the unused layer's (and those after it, in
        # launch order) only once backward ended
        assert 1 <= outcome["launched_in_backward"] < outcome["buckets"]


def test_a_gradient_arriving_twice_in_one_backward_fails_the_overlapped_step_clearly(tmp_path):
    """Reentrant checkpointing runs a nested backward: a parameter used inside and outside it gets two gradients,
    the first of which may already be reducing in its bucket."""
    from torch.utils.checkpoint import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(4, 4)
        replica = FlatReplica(nn.ModuleDict({"layer": layer}), torch.device("cpu"))
        collective = StepCollective(replica, overlap=True, bucket_bytes=(8, 8))
        x = torch.randn(2, 4, requires_grad=True)
        collective.start(0.0, 2, 2.0, 2.0)
        with pytest.raises(RuntimeError, match="received its gradient twice in one backward pass"):
            (checkpoint(layer, x, use_reentrant=True) + layer(x)).sum().backward()
        collective.close()
    finally:
        dist.destroy_process_group()
