"""Who trains: the parameter server's slots across task attempts, the step plan, and the sample budget. No I/O.

A *slot* is one PS worker id: one per worker, or with work units (``max_workers``) one per unit
and epoch (slot ``e x units + u`` trains epoch ``e``'s pass over unit ``u``).  A slot outlives
task attempts: a hello from a newer attempt takes it over (a bumped ``token`` silences the
older connection), and its ``consumed`` count is the data position a retried task resumes at.
The core (:class:`~sparkdl._internal.ps.server.core.PSCore`) drives this object under its
caller's lock and asks the policy what a change of membership means for the update being
collected.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

import torch

from sparkdl._internal.ps.server.policy import UpdatePolicy
from sparkdl._internal.ps.server.runlog import RunLog
from sparkdl.config import TrainConfig
from sparkdl.errors import ProtocolError


class SlotStatus(enum.Enum):
    ABSENT = "absent"   # no task has said hello for it yet
    ACTIVE = "active"   # a task attempt holds the slot and trains
    LOST = "lost"       # its task died or went silent; a retried task may take the slot again
    DONE = "done"       # finished its plan


@dataclass
class Slot:
    """What the PS knows about one slot across task attempts."""

    status: SlotStatus = SlotStatus.ABSENT
    task_attempt: int = -1       # Spark task attempt id of the task holding the slot
    token: int = 0               # bumped at every hello: calls with an older token are ignored
    partition_rows: int = 0
    consumed: int = 0            # pushes whose fate is final (applied or refused): the data position
    float_buffers: torch.Tensor | None = None   # BatchNorm statistics ... reported at the end
    samples_trained: int = 0     # samples behind those buffers (their weight when pooled)
    #: the first epoch whose metrics wait for this slot (a late joiner's: the first one not yet begun)
    awaited_from_epoch: int = 0


class Membership:
    """The slots of one run, the steps per epoch each trains, and the global sample budget."""

    def __init__(self, config: TrainConfig, policy: UpdatePolicy, log: RunLog) -> None:
        self.config = config
        self.policy = policy
        self.log = log
        self.slots = [Slot() for _ in range(config.worker_slots)]
        #: work units (``max_workers``): slot ``epoch x units + unit`` trains one pass over ``unit``; 0: none
        self.units = config.work_units
        #: work units: the rows of every unit seen so far (its first task counted them into the budget)
        self._unit_rows: dict[int, int] = {}
        #: the most slots that have trained at once (a task holding a slot is one)
        self.peak_workers = 0
        #: steps per epoch of every slot that has said hello, once the run's starters have (None before)
        self.epoch_steps: dict[int, int] | None = None
        #: async/softsync with a global budget: train until this many samples are consumed in all
        self.sample_budget: int | None = None
        self.samples_consumed = 0

    # ----------------------------------------------------------------- views
    @property
    def finished(self) -> bool:
        return all(s.status is SlotStatus.DONE for s in self.slots)

    @property
    def active(self) -> int:
        """Slots training now."""
        return sum(s.status is SlotStatus.ACTIVE for s in self.slots)

    @property
    def seen(self) -> int:
        """Slots a task has said hello for so far."""
        return sum(s.status is not SlotStatus.ABSENT for s in self.slots)

    @property
    def steps_known(self) -> bool:
        """Every slot (an elastic run: ``min_workers`` of them) has said hello once, so the step plan is known."""
        return self.epoch_steps is not None

    @property
    def budget_spent(self) -> bool:
        return self.sample_budget is not None and self.samples_consumed >= self.sample_budget

    def check(self, slot: int) -> None:
        if not 0 <= slot < len(self.slots):
            raise ProtocolError(f"worker id {slot} is outside [0, {len(self.slots)})")

    def may_start(self, slot: int) -> bool:
        """Whether a hello for ``slot`` may take it now: a run with work units trains at most ``max_workers``
        of them at once."""
        self.check(slot)
        # a newer attempt of a training task takes its place over; a stage retry's task of a finished unit
        # trains nothing; a lost unit's re-run waits as any other task
        if not self.units or self.slots[slot].status in (SlotStatus.ACTIVE, SlotStatus.DONE):
            return True
        return self.active < cast(int, self.config.max_workers)

    def is_current(self, slot: int, token: int) -> bool:
        """Whether ``token`` still holds ``slot`` (no newer attempt took it over)."""
        return self.slots[slot].token == token

    def is_active(self, slot: int, token: int) -> bool:
        """Whether ``token``'s session of ``slot`` still trains (not replaced, not lost, not done)."""
        return self.is_current(slot, token) and self.slots[slot].status is SlotStatus.ACTIVE

    def positions(self) -> list[int]:
        """Per slot: pushes whose gradients the server has consumed."""
        return [s.consumed for s in self.slots]

    def session_of(self, slot: int, task_attempt: int) -> int | None:
        """The token of ``slot``'s session when ``task_attempt`` holds it (the other parts of a pipelined worker
        join the session its first part opened), else None."""
        self.check(slot)
        held = self.slots[slot]
        if held.status is SlotStatus.ACTIVE and held.task_attempt == task_attempt:
            return held.token
        return None

    def missing(self) -> str:
        """Who a run that cannot start is waiting for, in words."""
        needed = self.config.min_workers or self.config.num_workers
        if self.units:
            return f"{needed - self.seen} of the {needed} needed to start"
        return str([i for i, s in enumerate(self.slots) if s.status is SlotStatus.ABSENT])

    def awaited(self, epoch: int) -> set[int]:
        """The slots whose report ``epoch``'s row waits for: the active ones that train it; with work units, every
        unit's task of that epoch not yet done (those not started yet too: each unit's pass is in every epoch)."""
        if self.units:
            first = epoch * self.units
            return {i for i in range(first, min(first + self.units, len(self.slots)))
                    if self.slots[i].status is not SlotStatus.DONE}
        return {i for i, s in enumerate(self.slots)
                if s.status is SlotStatus.ACTIVE and epoch >= s.awaited_from_epoch}

    def planned_pushes(self) -> int | None:
        """Pushes the whole run will take (None before the plan is known)."""
        if self.epoch_steps is None:
            return None
        config = self.config
        if self.sample_budget is not None:
            budget = self.sample_budget
            if self.units and 0 < len(self._unit_rows) < self.units:   # the units not seen yet: as the seen ones
                budget = budget * self.units // len(self._unit_rows)
            return -(-budget // (config.batch_size * config.local_steps))
        return sum(-(-steps * config.epochs // config.local_steps) for steps in self.epoch_steps.values())

    def planned_rounds(self) -> int:
        """Sync: rounds the whole run will take (one per push of the slot with the most steps)."""
        assert self.epoch_steps is not None
        config = self.config
        return max((-(-steps * config.epochs // config.local_steps) for steps in self.epoch_steps.values()), default=0)

    def reported_float_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Each slot's float buffers (BatchNorm statistics ...) with the samples behind them; with work units,
        those of the newest epoch's tasks (each went on from its Python worker's previous unit)."""
        reported = [(i, s) for i, s in enumerate(self.slots) if s.float_buffers is not None]
        if self.units and reported:
            newest = max(i for i, _ in reported) // self.units
            reported = [(i, s) for i, s in reported if i // self.units == newest]
        return [(cast(torch.Tensor, s.float_buffers), s.samples_trained) for _, s in reported]

    # ----------------------------------------------------------------- events
    def register(self, slot: int, task_attempt: int, partition_rows: int, first_unbegun_epoch: int) -> int:
        """A task attempt takes ``slot`` (its first, or a retry's); returns the token of its session.

        ``first_unbegun_epoch``: the first epoch no slot has begun, where a late joiner's reports start.
        """
        held = self.slots[slot]
        rejoining = held.status is not SlotStatus.ABSENT
        held.status, held.task_attempt, held.partition_rows = SlotStatus.ACTIVE, task_attempt, partition_rows
        held.token += 1
        if rejoining:
            self.log.stats.rejoins += 1
            self.log.event("rejoined", self.policy.version, worker=slot, attempt=task_attempt)
        self.peak_workers = max(self.peak_workers, self.active)
        if self.epoch_steps is None:
            started = {i: s.partition_rows for i, s in enumerate(self.slots) if s.status is not SlotStatus.ABSENT}
            if len(started) >= (self.config.min_workers or self.config.num_workers):
                self.epoch_steps = self.policy.steps_per_epoch(started, self.config.batch_size)
                self.policy.set_active({w for w, n in self.epoch_steps.items() if n > 0})
                if self.config.sample_budget == "global" and not self.policy.rounds_are_atomic:
                    self.sample_budget = self.config.epochs * sum(self._unread_rows(i, rows)
                                                                  for i, rows in started.items())
        elif slot not in self.epoch_steps:
            self._join_late(slot, partition_rows, first_unbegun_epoch)
        elif self.epoch_steps.get(slot, 0) > 0:
            self.policy.on_worker_joined(slot)
        return held.token

    def _unread_rows(self, slot: int, partition_rows: int) -> int:
        """The rows ``slot`` brings that no budget counts yet: its partition's, or (work units) its unit's the
        first time a task of that unit says hello (the budget holds every epoch of a unit at once)."""
        if not self.units:
            return partition_rows
        unit = slot % self.units
        if unit in self._unit_rows:
            return 0
        self._unit_rows[unit] = partition_rows
        return partition_rows

    def _join_late(self, slot: int, partition_rows: int, first_unbegun_epoch: int) -> None:
        """A slot of an elastic run whose task got it after training began (``min_workers``): it trains its own
        partition, whose rows were in no budget yet, so the global budget grows by epochs x them.

        With work units every task after the starting ones comes here: its unit's rows join the budget once,
        and its epoch's row waits for it (:meth:`awaited`); it is no new worker, so no join is counted."""
        assert self.epoch_steps is not None
        self.epoch_steps[slot] = self.policy.steps_per_epoch({slot: partition_rows}, self.config.batch_size)[slot]
        if self.sample_budget is not None:
            self.sample_budget += self.config.epochs * self._unread_rows(slot, partition_rows)
        if self.epoch_steps[slot] > 0:
            self.policy.on_worker_joined(slot)
        if self.units:
            return
        # the epochs the others have begun close without it (its own first epochs come later)
        self.slots[slot].awaited_from_epoch = first_unbegun_epoch
        self.log.stats.late_joins += 1
        self.log.event("joined", self.policy.version, worker=slot, rows=partition_rows)

    def lose(self, slot: int, token: int) -> bool:
        """``token``'s session of ``slot`` ended without finishing; False when it no longer held the slot."""
        held = self.slots[slot]
        if held.token != token or held.status is not SlotStatus.ACTIVE:
            return False
        held.status = SlotStatus.LOST
        self.log.stats.workers_lost += 1
        return True

    def finish(self, slot: int, float_buffers: torch.Tensor | None, samples: int) -> None:
        """``slot`` finished its plan, handing over its float buffers (if it trained any)."""
        held = self.slots[slot]
        if float_buffers is not None:
            held.float_buffers = float_buffers
            held.samples_trained = samples
            if self.units and slot >= self.units:   # its unit's statistics of an earlier epoch are superseded
                self.slots[slot - self.units].float_buffers = None
        held.status = SlotStatus.DONE

    def consume(self, slot: int, samples: int, count_samples: bool = True) -> None:
        """A push of ``slot`` is final (applied or refused): its data position moves on."""
        self.slots[slot].consumed += 1
        if count_samples:
            self.samples_consumed += samples
