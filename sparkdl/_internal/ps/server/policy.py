"""Update policies of the parameter server: pure decision objects, no I/O, no threads.

The server asks the policy what to do with every pushed gradient and applies the answer.
Versions count applied updates; a gradient computed on version ``v`` that arrives when the
server is at version ``V`` has staleness ``tau = V - v``.

* ``sync``     - CaffeOnSpark's synchronous SGD: one gradient from every active worker per
                 version, averaged; pushers wait for the new version (the PS is the barrier).
                 With ``backup_workers = b`` (Chen et al. 2016, "Revisiting distributed
                 synchronous SGD"), a round completes with the first ``N - b`` gradients and
                 the late ones for that round are dropped.
* ``async``    - ASGD (Dean et al. 2012, Downpour): every gradient is applied on arrival.
* ``softsync`` - Zhang et al. 2016's n-softsync: an update averages ``c`` gradients from any
                 workers (one fast worker may fill an update alone); nobody waits.
* ``softsync_nodes`` - the first seed article's formula (3): the PS waits for gradients from
                 ``n`` distinct workers; each pusher waits until the update holding its
                 gradient is applied (n = 1: ASGD; n = N: sync).

Per-gradient staleness factor (Zhang et al., IJCAI 2016, "Staleness-aware async-SGD"):
``s_i = 1 / tau_i`` for ``tau_i >= 1`` (1 for ``tau_i = 0``) under ``staleness_lr="inverse"``;
the server multiplies each gradient by ``s_i`` before it enters the optimizer.

Bounded staleness: ``max_staleness`` drops gradients staler than the bound;
``ssp_bound`` is stale synchronous parallel (Ho et al. 2013, "More effective distributed ML
via a stale synchronous parallel parameter server"): a worker whose clock (pushes) is more
than the bound ahead of the slowest active worker waits, and nothing is dropped.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from sparkdl.config import TrainConfig


class Refusal(enum.Enum):
    """Why a pushed gradient was not used."""

    NOT_ACTIVE = "worker is not active"
    FUTURE_VERSION = "computed on a version newer than the server's"
    WRONG_ROUND = "computed on another sync round's version"
    LATE_FOR_ROUND = "its sync round completed without it (backup workers)"
    DUPLICATE = "the worker already has a gradient in the update being collected (sync, softsync_nodes)"
    TOO_STALE = "staleness exceeds max_staleness"
    NOT_FINITE = "gradient holds NaN/Inf values"
    TRAINING_OVER = "the run's sample budget was spent, or early stopping ended it"


@dataclass(frozen=True)
class Update:
    """Instruction to average the buffered gradients and take one optimizer step."""

    version: int          # version the weights will have after the step
    num_gradients: int    # gradients averaged into this step


@dataclass(frozen=True)
class PushDecision:
    """What the server does with one pushed gradient."""

    accepted: bool                  # add it to the buffer (scaled by ``scale``)?
    staleness: int
    scale: float                    # per-gradient factor (1/tau under "inverse")
    update: Update | None           # step now (after buffering this gradient)?
    wait_for_version: int | None    # reply only once the server reaches this version
    refusal: Refusal | None = None  # why it was refused, when it was
    detail: str = ""                # the refusal with its numbers, for logs


@dataclass(frozen=True)
class LossDecision:
    """What the server does when a worker is lost."""

    discarded: int          # buffered gradients thrown away
    round_abandoned: bool   # the pushers waiting in the current round must give up (sync)
    update: Update | None = None   # the buffer is complete without the lost worker: step now


class UpdatePolicy:
    """Decides, push by push, when the parameter server buffers, steps, drops or waits.

    ``gradients_per_update`` is ``c``: N - b for ``sync``, 1 for ``async``, c (or n) for the
    soft-sync policies.
    """

    def __init__(self, policy: str, num_workers: int, gradients_per_update: int,
                 staleness_lr: str = "none", max_staleness: int | None = None,
                 ssp_bound: int | None = None) -> None:
        if policy not in ("sync", "async", "softsync", "softsync_nodes"):
            raise ValueError(f"unknown policy {policy!r}")
        if not 1 <= gradients_per_update <= num_workers:
            raise ValueError(f"gradients_per_update must be in [1, {num_workers}], got {gradients_per_update}")
        self.policy = policy
        self.num_workers = num_workers
        self.gradients_per_update = gradients_per_update
        self.staleness_lr = staleness_lr
        self.max_staleness = max_staleness
        self.ssp_bound = ssp_bound
        self.version = 0
        self.active: set[int] = set(range(num_workers))
        #: workers with a gradient in the update being collected (sync, softsync_nodes: one each)
        self._in_update: set[int] = set()
        self._buffered = 0

    @classmethod
    def from_config(cls, config: TrainConfig) -> UpdatePolicy:
        # allreduce and fsdp run without a PS; a PS made for them (e.g. in tools) behaves like sync
        policy = config.policy if config.mode.has_parameter_server else "sync"
        return cls(policy, config.worker_slots, config.gradients_per_update, config.staleness_lr,
                   config.max_staleness, config.ssp_bound)

    @property
    def buffered(self) -> int:
        """Gradients accepted but not yet applied."""
        return self._buffered

    @property
    def rounds_are_atomic(self) -> bool:
        """Sync: a round's gradients count (data positions advance) only once the round is applied.

        A round interrupted by a lost worker is discarded and redone by every worker, so
        nothing of it may be counted before it completes.  Other policies count a gradient
        as soon as it is accepted: it is never discarded.
        """
        return self.policy == "sync"

    @property
    def pushers_wait(self) -> bool:
        """Whether a pusher's reply waits for the update that holds its gradient."""
        return self.policy in ("sync", "softsync_nodes")

    def set_active(self, workers: set[int]) -> None:
        """Restrict the run to these workers (e.g. those whose partition has data)."""
        if not workers <= set(range(self.num_workers)):
            raise ValueError(f"unknown worker ids {sorted(workers - set(range(self.num_workers)))}")
        self.active = set(workers)

    @property
    def distinct_workers(self) -> bool:
        """Whether an update takes at most one gradient per worker: a sync round, and formula (3)'s
        ``n`` distinct workers of ``softsync_nodes`` (n-softsync counts gradients from any workers)."""
        return self.policy in ("sync", "softsync_nodes")

    def in_current_round(self, worker: int) -> bool:
        """Whether ``worker``'s gradient already sits in the update being collected (sync, softsync_nodes)."""
        return worker in self._in_update

    def missing_from_round(self) -> list[int]:
        """Active workers whose gradient the current sync round still waits for."""
        return sorted(self.active - self._in_update)

    def steps_per_epoch(self, partition_rows: dict[int, int], batch_size: int) -> dict[int, int]:
        """Mini-batches each worker takes per epoch under this policy (see :func:`steps_per_epoch`)."""
        return steps_per_epoch(self.policy, partition_rows, batch_size)

    def _needed(self) -> int:
        return max(1, min(self.gradients_per_update, len(self.active)))

    def staleness_scale(self, staleness: int) -> float:
        """Zhang et al.'s per-gradient factor: 1/tau for tau >= 1 under "inverse", else 1."""
        if self.staleness_lr == "inverse" and staleness >= 1:
            return 1.0 / staleness
        return 1.0

    def _take_update(self) -> Update:
        self.version += 1
        update = Update(self.version, self._buffered)
        self._buffered = 0
        self._in_update.clear()
        return update

    def on_push(self, worker: int, grad_version: int) -> PushDecision:
        """A gradient from ``worker`` computed on weights of version ``grad_version``."""
        staleness = self.version - grad_version
        refusal: Refusal | None = None
        detail = ""   # set with every refusal below (and only read then)
        if worker not in self.active:
            refusal, detail = Refusal.NOT_ACTIVE, f"worker {worker} is not active"
        elif staleness < 0:
            refusal = Refusal.FUTURE_VERSION
            detail = f"gradient claims version {grad_version}, newer than the server's {self.version}"
        elif self.policy == "sync" and staleness != 0:
            late = self.gradients_per_update < self.num_workers
            refusal = Refusal.LATE_FOR_ROUND if late else Refusal.WRONG_ROUND
            detail = f"sync round {self.version} got a gradient computed on version {grad_version}"
        elif self.distinct_workers and worker in self._in_update:
            # a live pusher waits for its update, so only a retried attempt gets here, while its lost
            # attempt's gradient is still buffered: one worker must not fill two places of one update
            refusal = Refusal.DUPLICATE
            detail = (f"worker {worker} pushed twice in sync round {self.version}" if self.policy == "sync" else
                      f"worker {worker} already has a gradient in the update to version {self.version + 1}, "
                      "which softsync_nodes fills from distinct workers")
        elif self.max_staleness is not None and staleness > self.max_staleness:
            refusal = Refusal.TOO_STALE
            detail = f"staleness {staleness} exceeds max_staleness {self.max_staleness}"
        if refusal is not None:
            # a softsync_nodes duplicate waits, as its pushers do, for the update holding the worker's
            # first gradient: it then trains on weights that include it, instead of pushing again at once
            wait = self.version + 1 if refusal is Refusal.DUPLICATE and self.policy == "softsync_nodes" else None
            return PushDecision(False, staleness, 0.0, None, wait, refusal, detail)
        wait = self.version + 1 if self.pushers_wait else None
        self._buffered += 1
        if self.distinct_workers:
            self._in_update.add(worker)
        update = self._take_update() if self._buffered >= self._needed() else None
        return PushDecision(True, staleness, self.staleness_scale(staleness), update, wait)

    def refuse(self, grad_version: int, refusal: Refusal, detail: str) -> PushDecision:
        """The decision for a gradient the server refuses by itself (not finite, budget spent)."""
        return PushDecision(False, self.version - grad_version, 0.0, None, None, refusal, detail)

    def ahead_of_bound(self, worker: int, clocks: dict[int, int]) -> bool:
        """SSP: whether ``worker`` is more than ``ssp_bound`` pushes ahead of the slowest active worker."""
        if self.ssp_bound is None or worker not in self.active:
            return False
        others = [clocks[w] for w in self.active if w in clocks]
        return bool(others) and clocks[worker] - min(others) > self.ssp_bound

    def drop_round(self) -> int:
        """Throw away the gradients buffered for the update being collected; returns how many."""
        dropped, self._buffered = self._buffered, 0
        self._in_update.clear()
        return dropped

    def on_worker_lost(self, worker: int) -> LossDecision:
        """``worker`` vanished mid-run; say what happens to the buffer and the current round.

        Sync: the worker stays expected (rounds must not go on without it, or the workers'
        data positions would drift apart) and the round's partial buffer is dropped: every
        worker redoes that round after the stage is retried.  The other policies stop
        waiting for it and keep their buffer (those gradients were accepted and will not be
        sent again); when the buffer is now complete, it is applied.
        """
        if self.policy != "sync":
            self.active.discard(worker)
            update = self._take_update() if self._buffered and self._buffered >= self._needed() else None
            return LossDecision(0, False, update)
        return LossDecision(self.drop_round(), True)

    def on_worker_joined(self, worker: int) -> None:
        """``worker`` (re)joined the run, e.g. after a stage retry."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"unknown worker id {worker}")
        self.active.add(worker)

    def on_worker_done(self, worker: int) -> Update | None:
        """``worker`` has no more gradients; flush the buffer if it no longer needs to wait."""
        self.active.discard(worker)
        if self._buffered and (not self.active or self._buffered >= self._needed()):
            return self._take_update()
        return None


def takes_full_batches(policy: str) -> bool:
    """Whether every worker takes the same number of full batches per epoch (small partitions wrap)."""
    return policy in ("sync", "allreduce", "fsdp")


def steps_per_epoch(policy: str, partition_rows: dict[int, int], batch_size: int) -> dict[int, int]:
    """Mini-batches each worker takes per epoch.

    In ``sync`` every worker must push the same number of times or the barrier deadlocks, so
    all take ``max_i ceil(n_i / b)`` full batches; smaller partitions wrap around their (shuffled)
    order.  Other policies take ``ceil(n_i / b)`` batches, the last one possibly short.
    Workers with an empty partition take none.
    """
    own = {w: math.ceil(n / batch_size) for w, n in partition_rows.items()}
    if not takes_full_batches(policy):
        return own
    most = max(own.values(), default=0)
    return {w: (most if n > 0 else 0) for w, n in partition_rows.items()}
