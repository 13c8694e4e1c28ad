"""Allreduce among ranks on one host through shared memory, where gloo would copy every byte through loopback TCP.

Rank ``r`` trains with its flat gradient in slot ``r`` of one mapped file, the step's statistics (summed loss,
rows, rows' weight, the gradient's scale) after it.  A step is: every rank ends its backward and passes a
barrier; rank ``r`` reduces its 1/N chunk of every slot, ``sum_i scale_i g_i / total``, straight into the
chunk of every rank's output region, and passes a second barrier; each rank steps its optimizer from its own
output region.  Per rank that reads 2 x (N/N) of the model and writes it once, with no pass to scale the
gradient before and none to average it after, and no socket: with gloo the same reduction crosses loopback
TCP twice (reduce-scatter, then all-gather), each byte copied through the kernel.  The barriers are gloo's
(a one-value collective each).  Nothing is read while it is written: a slot is written only by its rank's
backward, between the second barrier of a step and the first of the next; an output region only by the
reducers, between the two barriers, and read by its rank after the second.

The file is made owner-only and ``O_EXCL``, its space reserved up front, under a random name that rank 0
hands the others through the process group and removes once every rank has mapped it (the PS's segments
follow the same rules: ``sparkdl._internal.ps.wire.shared_memory``).  When any rank cannot map it (another
host, a full ``/dev/shm``), every rank uses the process group's all-reduce instead.
"""
from __future__ import annotations

import mmap
import os
import secrets

import torch
import torch.distributed as dist

from sparkdl._internal.modes.allreduce.buckets import Reduced
from sparkdl._internal.ps.wire.shared_memory import SHM_DIR, attach_mapped, create_mapped, host_identity, remove_name
from sparkdl._internal.training.flat import FlatReplica

#: (loss x rows, rows, rows' weight, the scale of this rank's gradient) after its gradient
STATISTICS = 4


class HostReduction:
    """The ranks' gradients reduced in one host's shared memory (every rank of the group holds one)."""

    def __init__(self, replica: FlatReplica, rank: int, world: int, mapped: mmap.mmap) -> None:
        self.replica, self.rank, self.world = replica, rank, world
        self._mapped = mapped     # the tensors below read it: it lives as long as they do
        buffer = torch.frombuffer(mapped, dtype=torch.float32)
        self.size = size = replica.grads.numel()
        width = size + STATISTICS
        self._slots = [buffer[i * width:(i + 1) * width] for i in range(world)]
        self._outputs = [buffer[(world + i) * width:(world + i) * width + size] for i in range(world)]
        chunk = -(-size // world)
        self._chunk = (min(rank * chunk, size), min((rank + 1) * chunk, size))
        replica.rebind(replica.weights, self._slots[rank][:size])   # backward writes where the reducers read
        self.buckets: list = []     # never overlapped: the reduction is cheaper than what overlap hides on a CPU

    @classmethod
    def open(cls, replica: FlatReplica, rank: int, world: int) -> HostReduction | None:
        """Every rank of the group calls this together; each gets one, or every rank None (use the group's)."""
        size = 2 * world * (replica.grads.numel() + STATISTICS) * 4
        made = path = None
        if rank == 0:
            path = os.path.join(SHM_DIR, f"sparkdl-{secrets.token_hex(16)}")
            made = create_mapped(path, size)
        try:
            shared: list[object] = [path if made is not None else None, host_identity()]
            dist.broadcast_object_list(shared, src=0)
            made_at, boot = shared
            mapped = made
            if rank != 0 and isinstance(made_at, str) and boot == host_identity():
                mapped = attach_mapped(made_at, size)
            everyone = torch.tensor([int(mapped is not None)])
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        finally:   # mapped by every rank that could (or a peer failed): nobody else needs to find it
            if path is not None:
                remove_name(path)
        if not int(everyone):
            if mapped is not None:
                mapped.close()
            return None
        assert mapped is not None
        return cls(replica, rank, world, mapped)

    def reduce(self, loss_sum: float, samples: int, weight: float, scale: float, by_weight: bool = True) -> Reduced:
        """``sum_i scale_i g_i`` over the workers' total weight (or their number).

        Where every worker's coefficient is the same (full batches without a weight column, local SGD) the
        regions get the plain sum and the optimizer divides: one pass over the chunk instead of two."""
        self._slots[self.rank][self.size:].copy_(torch.tensor([loss_sum, samples, weight, scale]))
        dist.barrier()                                      # every gradient is written
        statistics = torch.stack([slot[self.size:] for slot in self._slots])
        sums = statistics[:, :3].sum(0).tolist()
        total = max(sums[2], torch.finfo(torch.float32).tiny) if by_weight else float(self.world)
        coefficients = (statistics[:, 3] / total).tolist()
        equal = coefficients[0] > 0 and all(c == coefficients[0] for c in coefficients)
        lo, hi = self._chunk
        if hi > lo:
            first, slots = self._outputs[0][lo:hi], [slot[lo:hi] for slot in self._slots]
            if equal:
                torch.add(slots[0], slots[1], out=first)
                for slot in slots[2:]:
                    first.add_(slot)
            else:
                torch.mul(slots[0], coefficients[0], out=first)
                for slot, coefficient in zip(slots[1:], coefficients[1:], strict=True):
                    first.add_(slot, alpha=coefficient)
            for output in self._outputs[1:]:
                output[lo:hi].copy_(first)
        dist.barrier()                                      # every chunk is in every output region
        return Reduced(self._outputs[self.rank], 1.0 / coefficients[0] if equal else 1.0, sums[0], sums[1])

    def finish(self) -> Reduced:
        raise AssertionError("the shared-memory reduction has no buckets to finish")

    def close(self) -> None:
        """Nothing to release: the mapping goes with the last tensor that views it."""
