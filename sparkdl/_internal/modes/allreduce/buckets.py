"""The allreduce exchange's one collective per step: the flat gradient with the step's statistics at its tail,
reduced whole after backward or in buckets while backward still runs.

The statistics (the rows' summed loss, their count, their weight) ride as three more float32 values after
the gradient, so a step makes one collective where it made two (a float64 statistics all-reduce, then the
gradient's); float32 holds the counts exactly up to 2**24 rows per step.

Overlapped (``overlap_communication``), the gradient is cut into buckets in reverse parameter order, the
order backward finalises them, and each bucket's all-reduce starts (``async_op=True``) as soon as a
post-accumulate-grad hook has seen its last parameter: DDP's reducer (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020) with its bucket sizes (1 MB first, 25 MB
after), over the replica's own flat buffer, so no bucket copy is made.  Buckets are launched strictly in
order (a ready bucket waits for the ones before it) and those backward did not reach (unused parameters)
after it ends, so every rank issues the same collectives in the same order.  DDP itself is not used: it
reduces buckets of its own (copies, or gradients as views of its buckets rather than of the flat buffer
the optimizer steps), and averages by the number of workers where sparkdl weighs each worker by its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparkdl._internal.training.flat import FlatReplica

#: DDP's defaults: a small first bucket starts the reduction early, larger ones after amortise each call
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
#: (loss x rows, rows, rows' weight) after the gradient, padded so that the buffer's length is a multiple of 16
#: floats (gloo cuts it into chunks for its ring: unaligned chunks measured slower)
STATISTICS = 3
ALIGN = 16


@dataclass(frozen=True)
class Reduced:
    """A step's reduction: ``gradient / divisor`` is the workers' average (the optimizer divides in its own pass,
    sparing one over the gradient), with the step's summed loss and rows."""

    gradient: torch.Tensor
    divisor: float
    loss_sum: float
    rows: float

    def grad_scale(self) -> torch.Tensor | None:
        """The divisor as the fused optimizers take it (None: 1)."""
        return None if self.divisor == 1.0 else torch.tensor(self.divisor, device=self.gradient.device)


class StepCollective:
    """The flat gradient and the step's statistics in one buffer, reduced by one collective per step."""

    def __init__(self, replica: FlatReplica, overlap: bool,
                 bucket_bytes: tuple[int, int] = (FIRST_BUCKET_BYTES, BUCKET_BYTES)) -> None:
        self.replica = replica
        self.size = replica.grads.numel()
        self.world = dist.get_world_size()
        tail = STATISTICS + (-(self.size + STATISTICS)) % ALIGN
        self.buffer = torch.zeros(self.size + tail, dtype=torch.float32, device=replica.grads.device)
        # the model trains in the buffer's head: backward accumulates where the collective reads
        replica.rebind(replica.weights, self.buffer[:self.size])
        self.buckets = _bucket_spans(replica, self.buffer.numel(), *bucket_bytes) if overlap else []
        self._owner = {id(p): b for b, (_, _, members) in enumerate(self.buckets) for p in members}
        self._left: list[int] = []
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        self._scale = 1.0
        self._hooks = [p.register_post_accumulate_grad_hook(self._final) for p in replica.parameters
                       if p.requires_grad and id(p) in self._owner]

    @property
    def statistics(self) -> torch.Tensor:
        """(loss x rows, rows, weight): this worker's before the collective, every worker's sum after it."""
        return self.buffer[self.size:self.size + STATISTICS]

    def start(self, loss_sum: float, samples: int, weight: float, scale: float) -> None:
        """Before backward (overlapped): this step's statistics, and ``scale`` for every bucket as it leaves."""
        self._write(loss_sum, samples, weight)
        self._scale = scale
        self._left = [len(members) for _, _, members in self.buckets]
        self._seen = set()
        self._handles = []

    def finish(self) -> Reduced:
        """After backward (overlapped): launch what backward did not reach, wait for every bucket; then as
        :meth:`reduce`."""
        while len(self._handles) < len(self.buckets):
            self._launch(len(self._handles))
        for handle in self._handles:
            handle.wait()
        self._handles, self._left = [], []
        return self._averaged(by_weight=True)

    def reduce(self, loss_sum: float, samples: int, weight: float, scale: float, by_weight: bool = True) -> Reduced:
        """After backward (not overlapped): ``sum_i scale_i g_i`` over the workers' total weight (or their number),
        the gradient and the statistics in one collective."""
        self._write(loss_sum, samples, weight)
        if scale != 1.0:
            self.replica.grads.mul_(scale)
        dist.all_reduce(self.buffer)
        return self._averaged(by_weight)

    def _averaged(self, by_weight: bool) -> Reduced:
        loss_sum, rows, total_weight = self.statistics.tolist()   # the step's one host synchronisation
        divisor = max(total_weight, torch.finfo(torch.float32).tiny) if by_weight else float(self.world)
        return Reduced(self.replica.grads, divisor, loss_sum, rows)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _write(self, loss_sum: float, samples: int, weight: float) -> None:
        self.statistics.copy_(torch.tensor([loss_sum, samples, weight], dtype=torch.float32))

    def _final(self, param: torch.Tensor) -> None:
        """Autograd hook: ``param``'s gradient is complete; launch every bucket now ready, in order."""
        if not self._left:     # a backward outside a step (none in training; a user's own, say)
            return
        if id(param) in self._seen:   # its bucket may already be reducing: a second gradient would be lost
            raise RuntimeError("a parameter received its gradient twice in one backward pass (reentrant activation "
                               "checkpointing does this): overlap_communication under allreduce reduces each "
                               "parameter once a step; use torch.utils.checkpoint with use_reentrant=False, or "
                               "set overlap_communication=False")
        self._seen.add(id(param))
        self.replica.adopt_grad(param)
        self._left[self._owner[id(param)]] -= 1
        while len(self._handles) < len(self.buckets) and self._left[len(self._handles)] == 0:
            self._launch(len(self._handles))

    def _launch(self, index: int) -> None:
        start, stop, _ = self.buckets[index]
        if self._scale != 1.0:
            self.buffer[start:min(stop, self.size)].mul_(self._scale)
        self._handles.append(dist.all_reduce(self.buffer[start:stop], async_op=True))


def _bucket_spans(replica: FlatReplica, length: int, first_bytes: int, bytes_after: int
                  ) -> list[tuple[int, int, list[torch.Tensor]]]:
    """(start, stop, parameters) of each bucket of a ``length``-value buffer, last parameters first; the first also
    carries the statistics."""
    spans: list[tuple[int, int, list[torch.Tensor]]] = []
    offsets, offset = [], 0
    for p in replica.parameters:
        offsets.append(offset)
        offset += p.numel()
    stop, members, cap = length, [], first_bytes
    for p, start in reversed(list(zip(replica.parameters, offsets, strict=True))):
        if p.requires_grad:
            members.append(p)
        if 4 * (stop - start) >= cap:
            spans.append((start, stop, members))
            stop, members, cap = start, [], bytes_after
    if stop > 0 or not spans:
        spans.append((0, stop, members))
    return spans
