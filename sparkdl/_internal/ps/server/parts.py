"""One worker's pushes assembled from parts: the pipeline stages of a model replica. No I/O.

Under model parallelism a replica's parameters are spread over its P stage tasks, and each
stage task pushes and pulls only its own key range.  The parameter server still sees one
worker per replica: the P parts of a push land in one full-size gradient buffer, and only
when all of them are in does the assembled gradient go to :class:`~sparkdl._internal.ps.server.core.PSCore`,
as one push.  So every stage of a replica takes part in the same updates (the same version,
the same data position), and a lost stage task loses its whole replica, whose retried
tasks resume together from the PS's position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkdl._internal.ps.server.core import PSCore, PushMeta
from sparkdl._internal.ps.server.policy import PushDecision
from sparkdl.errors import ProtocolError


@dataclass(frozen=True)
class PartRanges:
    """The key ranges of one part: (start, end) in the flat parameter and float-buffer vectors."""

    params: tuple[int, int]
    buffers: tuple[int, int]

    @property
    def num_params(self) -> int:
        return self.params[1] - self.params[0]


def check_part_ranges(parts: list[PartRanges], num_params: int, float_buffer_count: int) -> None:
    """The parts must tile both vectors, in order, with no gap or overlap."""
    params = [p.params for p in parts]
    buffers = [p.buffers for p in parts]
    for name, ranges, total in (("parameter", params, num_params), ("buffer", buffers, float_buffer_count)):
        ends = [0, *(end for _, end in ranges)]
        if [start for start, _ in ranges] != ends[:-1] or ends[-1] != total or any(e < s for s, e in ranges):
            raise ValueError(f"the parts' {name} ranges {ranges} do not tile [0, {total})")


class PartAssembly:
    """The parts of one worker's current push and of its DONE, until all have arrived."""

    def __init__(self, ranges: list[PartRanges], num_params: int, float_buffer_count: int) -> None:
        self.ranges = ranges
        #: the full-size gradient the parts are received into, each at its own range
        self.gradient = torch.empty(num_params, dtype=torch.float32)
        self.float_buffers = torch.zeros(float_buffer_count, dtype=torch.float32)
        self.token = -1
        self.completed = 0                 # pushes assembled and decided since the last reset
        self.decision: PushDecision | None = None   # the PS's answer to the last assembled push
        self._arrived: dict[int, tuple[PushMeta, bool]] = {}
        self._done: dict[int, int] = {}    # part -> samples it trained

    @property
    def parts(self) -> int:
        return len(self.ranges)

    def reset(self, token: int) -> None:
        """A new task attempt took the worker's slot: forget what older parts sent."""
        self.token = token
        self.completed = 0
        self.decision = None
        self._arrived.clear()
        self._done.clear()

    def arrive(self, part: int, meta: PushMeta, finite: bool) -> bool:
        """Part ``part``'s range of the gradient is in; True when it was the last one missing."""
        if part in self._arrived:
            raise ProtocolError(f"part {part} pushed twice before its other parts pushed once")
        self._arrived[part] = (meta, finite)
        return len(self._arrived) == self.parts

    def assembled(self) -> tuple[PushMeta, bool]:
        """The whole push: its meta (the loss comes from the last stage, which computes it) and finiteness.

        Every part must have trained on the same weight version and batch.
        """
        metas = [self._arrived[p][0] for p in range(self.parts)]
        first = metas[0]
        if any((m.computed_on, m.samples, m.epoch) != (first.computed_on, first.samples, first.epoch) for m in metas):
            raise ProtocolError("the parts of one push disagree on version, samples or epoch: "
                                + ", ".join(f"part {p}: {m}" for p, m in enumerate(metas)))
        finite = all(self._arrived[p][1] for p in range(self.parts))
        return PushMeta(first.computed_on, first.samples, metas[-1].loss, first.epoch), finite

    def settle(self, decision: PushDecision | None) -> None:
        """The PS decided on the assembled push; the parts waiting for it may read :attr:`decision`."""
        self.decision = decision
        self.completed += 1
        self._arrived.clear()

    def part_done(self, part: int, samples: int) -> bool:
        """Part ``part`` finished (its buffers are in :attr:`float_buffers`); True when all have."""
        self._done[part] = samples
        return len(self._done) == self.parts

    @property
    def samples_done(self) -> int:
        """Samples the worker trained (each part trained the same batches)."""
        return self._done.get(0, 0)


class PipelineParts:
    """A pipelined PS's view of its workers' parts: which range each part pushes, and every worker's assembly.

    No I/O and no lock of its own: the server calls it under its lock, and does the waiting.
    """

    def __init__(self, ranges: list[PartRanges], num_workers: int, num_params: int, float_buffer_count: int) -> None:
        check_part_ranges(ranges, num_params, float_buffer_count)
        self.ranges = ranges
        self.assemblies = {worker: PartAssembly(ranges, num_params, float_buffer_count) for worker in range(num_workers)}

    def __len__(self) -> int:
        return len(self.ranges)

    def check_hello(self, worker: int, parts: int, part: int) -> int:
        """The part a worker's connection pushes; a hello that counts parts otherwise is a protocol error."""
        if parts != len(self.ranges):
            raise ProtocolError(f"worker {worker} pushes its model in {parts or 1} part(s); this parameter "
                                f"server expects {len(self.ranges)}")
        return part

    def offer(self, core: PSCore, worker: int, token: int, part: int, meta: PushMeta, grad: torch.Tensor,
              finite: bool) -> tuple[PushDecision | None, int]:
        """Part ``part``'s gradient joins the worker's assembly; the last part to arrive hands the whole to the core.

        Returns ``(decision, target)``: the core's decision when this part completed the push (or
        None when it may not push: a failed run, a replaced session), else ``(None, target)`` with
        the assembly count the caller waits for before reading :meth:`decision_for`.
        """
        assembly = self.assemblies[worker]
        if core.failure is not None or not core.members.is_active(worker, token) or assembly.token != token:
            return None, -1
        lo, hi = self.ranges[part].params
        assembly.gradient[lo:hi].copy_(grad)
        target = assembly.completed + 1
        if assembly.arrive(part, meta, finite):
            meta, finite = assembly.assembled()
            assembly.settle(core.push(worker, token, meta, assembly.gradient, finite))
            return assembly.decision, -1
        return None, target

    def settled(self, worker: int, target: int) -> bool:
        """Whether the push a waiting part is in has been decided."""
        return self.assemblies[worker].completed >= target

    def decision_for(self, worker: int) -> PushDecision | None:
        return self.assemblies[worker].decision

    def done(self, core: PSCore, worker: int, token: int, part: int, samples: int,
             float_buffers: torch.Tensor | None) -> bool:
        """A part finished (its float buffers, if it sent them); the worker is done when every part is.

        An older attempt's part is ignored.  True when the worker was reported done to the core.
        """
        assembly = self.assemblies[worker]
        if assembly.token != token:    # an older attempt's part: its buffers are not the run's
            return False
        if float_buffers is not None:
            lo, hi = self.ranges[part].buffers
            assembly.float_buffers[lo:hi].copy_(float_buffers)
        if not assembly.part_done(part, samples):
            return False
        total = assembly.samples_done
        core.done(worker, token, assembly.float_buffers.clone() if total > 0 else None, total)
        return True
