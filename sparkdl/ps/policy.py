"""Update policies of the parameter server: pure decision objects, no I/O, no threads.

The server asks the policy what to do with every pushed gradient and applies the answer.
Versions count applied updates; a gradient computed on version ``v`` that arrives when the
server is at version ``V`` has staleness ``tau = V - v``.

* ``sync``     - one gradient from every active worker per version, averaged; pushers wait
                 for the new version (the PS is the barrier).
* ``async``    - ASGD: every gradient is applied on arrival.
* ``softsync`` - n-softsync: an update averages ``c`` gradients from any workers.

Staleness-aware learning rate (Zhang et al., IJCAI 2016): ``alpha = alpha0 / tau`` for
``tau >= 1``.  An update that averages gradients with scales ``s_i`` uses the
``s``-weighted mean gradient and learning rate ``alpha0 * mean(s_i)``; for plain SGD this is
exactly ``alpha0 / c * sum(s_i * g_i)``, i.e. every gradient gets its own ``alpha0 / tau_i``.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..config import TrainConfig


class Refusal(enum.Enum):
    """Why a pushed gradient was not used."""

    NOT_ACTIVE = "worker is not active"
    FUTURE_VERSION = "computed on a version newer than the server's"
    WRONG_ROUND = "computed on another sync round's version"
    DUPLICATE = "the worker already pushed in this sync round"
    TOO_STALE = "staleness exceeds max_staleness"
    NOT_FINITE = "gradient holds NaN/Inf values"


@dataclass(frozen=True)
class Update:
    """Instruction to average the buffered gradients and take one optimizer step."""

    version: int          # version the weights will have after the step
    num_gradients: int    # gradients averaged into this step
    weight_sum: float     # sum of the per-gradient scales (the averaging denominator)
    lr_scale: float       # multiply the base learning rate by this for this step


@dataclass(frozen=True)
class PushDecision:
    """What the server does with one pushed gradient."""

    accepted: bool                  # add it to the buffer (scaled by ``scale``)?
    staleness: int
    scale: float                    # per-gradient weight (1/tau under "inverse")
    update: Update | None           # step now (after buffering this gradient)?
    wait_for_version: int | None    # reply only once the server reaches this version
    refusal: Refusal | None = None  # why it was refused, when it was
    detail: str = ""                # the refusal with its numbers, for logs


@dataclass(frozen=True)
class LossDecision:
    """What the server does when a worker is lost."""

    discarded: int          # buffered gradients thrown away
    round_abandoned: bool   # the pushers waiting in the current round must give up (sync)


class UpdatePolicy:
    """Decides, push by push, when the parameter server buffers, steps, drops or waits.

    ``gradients_per_update`` is ``c``: N for ``sync``, 1 for ``async``, c for ``softsync``.
    """

    def __init__(self, policy: str, num_workers: int, gradients_per_update: int,
                 staleness_lr: str = "none", max_staleness: int | None = None) -> None:
        if policy not in ("sync", "async", "softsync"):
            raise ValueError(f"unknown policy {policy!r}")
        if not 1 <= gradients_per_update <= num_workers:
            raise ValueError(f"gradients_per_update must be in [1, {num_workers}], got {gradients_per_update}")
        self.policy = policy
        self.num_workers = num_workers
        self.gradients_per_update = gradients_per_update
        self.staleness_lr = staleness_lr
        self.max_staleness = max_staleness
        self.version = 0
        self.active: set[int] = set(range(num_workers))
        self._pushed_this_round: set[int] = set()   # sync only
        self._buffered = 0
        self._weight_sum = 0.0

    @classmethod
    def from_config(cls, config: TrainConfig) -> "UpdatePolicy":
        # allreduce runs without a PS; a PS made for it (e.g. in tools) behaves like sync
        policy = "sync" if config.policy == "allreduce" else config.policy
        return cls(policy, config.num_workers, config.gradients_per_update,
                   config.staleness_lr, config.max_staleness)

    @property
    def buffered(self) -> int:
        """Gradients accepted but not yet applied."""
        return self._buffered

    def set_active(self, workers: set[int]) -> None:
        """Restrict the run to these workers (e.g. those whose partition has data)."""
        if not workers <= set(range(self.num_workers)):
            raise ValueError(f"unknown worker ids {sorted(workers - set(range(self.num_workers)))}")
        self.active = set(workers)

    def missing_from_round(self) -> list[int]:
        """Active workers whose gradient the current sync round still waits for."""
        return sorted(self.active - self._pushed_this_round)

    def _needed(self) -> int:
        if self.policy == "sync":
            return len(self.active)
        return min(self.gradients_per_update, len(self.active))

    def _scale(self, staleness: int) -> float:
        if self.staleness_lr == "inverse" and staleness >= 1:
            return 1.0 / staleness
        return 1.0

    def _take_update(self) -> Update:
        self.version += 1
        update = Update(self.version, self._buffered, self._weight_sum, self._weight_sum / self._buffered)
        self._buffered = 0
        self._weight_sum = 0.0
        self._pushed_this_round.clear()
        return update

    def on_push(self, worker: int, grad_version: int) -> PushDecision:
        """A gradient from ``worker`` computed on weights of version ``grad_version``."""
        staleness = self.version - grad_version
        refusal = detail = None
        if worker not in self.active:
            refusal, detail = Refusal.NOT_ACTIVE, f"worker {worker} is not active"
        elif staleness < 0:
            refusal = Refusal.FUTURE_VERSION
            detail = f"gradient claims version {grad_version}, newer than the server's {self.version}"
        elif self.policy == "sync" and staleness != 0:
            refusal = Refusal.WRONG_ROUND
            detail = f"sync round {self.version} got a gradient computed on version {grad_version}"
        elif self.policy == "sync" and worker in self._pushed_this_round:
            refusal, detail = Refusal.DUPLICATE, f"worker {worker} pushed twice in sync round {self.version}"
        elif self.max_staleness is not None and staleness > self.max_staleness:
            refusal = Refusal.TOO_STALE
            detail = f"staleness {staleness} exceeds max_staleness {self.max_staleness}"
        if refusal is not None:
            return PushDecision(False, staleness, 0.0, None, None, refusal, detail)
        scale = self._scale(staleness)
        self._buffered += 1
        self._weight_sum += scale
        if self.policy == "sync":
            self._pushed_this_round.add(worker)
        update = self._take_update() if self._buffered >= self._needed() else None
        wait = grad_version + 1 if self.policy == "sync" else None
        return PushDecision(True, staleness, scale, update, wait)

    def refuse_nonfinite(self, grad_version: int) -> PushDecision:
        """The decision for a gradient the server found to hold NaN/Inf values."""
        return PushDecision(False, self.version - grad_version, 0.0, None, None, Refusal.NOT_FINITE,
                            "gradient holds NaN/Inf values")

    @property
    def rounds_are_atomic(self) -> bool:
        """Sync: a round's gradients count (data positions advance) only once the round is applied.

        A round interrupted by a lost worker is discarded and redone by every worker, so
        nothing of it may be counted before it completes.  Other policies count a gradient
        as soon as it is accepted: it is never discarded.
        """
        return self.policy == "sync"

    def steps_per_epoch(self, shard_sizes: dict[int, int], batch_size: int) -> dict[int, int]:
        """Mini-batches each worker takes per epoch under this policy (see :func:`steps_per_epoch`)."""
        return steps_per_epoch(self.policy, shard_sizes, batch_size)

    def on_worker_lost(self, worker: int) -> LossDecision:
        """``worker`` vanished mid-run; say what happens to the buffer and the current round.

        Sync: the worker stays expected (rounds must not go on without it, or the workers'
        data positions would drift apart) and the round's partial buffer is dropped: every
        worker redoes that round after the stage is retried.  Async and softsync stop
        waiting for it and keep their buffer: those gradients were acknowledged and will not
        be sent again.
        """
        if self.policy != "sync":
            self.active.discard(worker)
            return LossDecision(0, False)
        dropped = self._buffered
        self._buffered = 0
        self._weight_sum = 0.0
        self._pushed_this_round.clear()
        return LossDecision(dropped, True)

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
    """Whether every worker takes the same number of full batches per epoch (small shards wrap)."""
    return policy in ("sync", "allreduce")


def steps_per_epoch(policy: str, shard_sizes: dict[int, int], batch_size: int) -> dict[int, int]:
    """Mini-batches each worker takes per epoch.

    In ``sync`` every worker must push the same number of times or the barrier deadlocks, so
    all take ``max_i ceil(n_i / b)`` full batches; smaller shards wrap around their (shuffled)
    order.  Other policies take ``ceil(n_i / b)`` batches, the last one possibly short.
    Workers with an empty shard take none.
    """
    own = {w: math.ceil(n / batch_size) for w, n in shard_sizes.items()}
    if not takes_full_batches(policy):
        return own
    most = max(own.values(), default=0)
    return {w: (most if n > 0 else 0) for w, n in shard_sizes.items()}
