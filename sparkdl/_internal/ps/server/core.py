"""The parameter server's state machine: membership, aggregation, optimizer step. No I/O.

``PSCore`` holds the master weights (the whole model, or one shard's key range), the
optimizer and the update policy, and turns the events of a run -- hello, push, lost, done,
failed -- into state changes and answers.  It has no sockets and no threads: the transport
(``transport.ParameterServer``) decodes frames, calls these methods under its lock, and does
the waiting (a sync pusher waits until :meth:`round_settled` holds).  Tests drive it with
scripted call sequences.

Membership: each worker id has a slot that outlives task attempts.  A hello from a newer
task attempt takes the slot over (a bumped ``token`` silences the older connection); the
slot's ``consumed`` count is the worker's data position, where a retried task resumes.
"""
from __future__ import annotations

import copy
import enum
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.policy import LossDecision, PushDecision, Refusal, Update, UpdatePolicy
from sparkdl._internal.ps.server.runlog import EpochRow, GradientRow, RunLog, UpdateRow, ValidationRow
from sparkdl._internal.training.losses import finish_metric
from sparkdl._internal.training.optim import TensorLayout, learning_rate_at, make_optimizer, server_momentum
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError, PSTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerStatus(enum.Enum):
    ABSENT = "absent"   # has not said hello yet
    ACTIVE = "active"   # a task attempt holds the slot and trains
    LOST = "lost"       # its task died or went silent; a retried task may take the slot again
    DONE = "done"       # finished its plan


@dataclass
class WorkerSlot:
    """What the PS knows about one worker id across task attempts."""

    status: WorkerStatus = WorkerStatus.ABSENT
    task_attempt: int = -1       # Spark task attempt id of the task holding the slot
    token: int = 0               # bumped at every hello: calls with an older token are ignored
    partition_rows: int = 0
    consumed: int = 0            # pushes whose fate is final (applied or refused): the data position
    float_buffers: torch.Tensor | None = None   # BatchNorm statistics ... reported at the end
    samples_trained: int = 0     # samples behind those buffers (their weight when pooled)
    #: the first epoch whose metrics wait for this worker (a late joiner's: the first one not yet begun)
    awaited_from_epoch: int = 0


@dataclass
class _Pending:
    """Statistics of the gradients buffered for the next update."""

    loss: float = 0.0
    samples: int = 0
    weight: float = 0.0          # the gradients' weights summed: the average's divisor
    staleness: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    epoch: int = 0
    workers: list[int] = field(default_factory=list)

    def add(self, worker: int, loss: float, samples: int, weight: float, staleness: int, scale: float,
            epoch: int) -> None:
        self.workers.append(worker)
        self.loss += loss * samples
        self.samples += samples
        self.weight += weight
        self.staleness.append(staleness)
        self.scales.append(scale)
        self.epoch = max(self.epoch, epoch)


@dataclass(frozen=True)
class PushMeta:
    """What a PUSH frame says about its gradient."""

    computed_on: int   # weight version the gradient was computed on
    samples: int
    loss: float
    epoch: int
    #: the rows' sum of weights with a weight column (None: the samples, every row weighing 1)
    weight: float | None = None

    @property
    def average_weight(self) -> float:
        """The gradient's weight in a PS average: its rows' weights, or its samples."""
        return float(self.samples) if self.weight is None else self.weight


@dataclass(frozen=True)
class WelcomeReply:
    """The answer to a hello: the step plan, the resume position and (past version 0) the weights."""

    version: int
    steps_per_epoch: int
    position: int                  # this worker's mini-batches already consumed
    weights: torch.Tensor | None   # None at version 0: the workers start from the broadcast weights


#: one table's part of a push: (the table's index, its touched row ids, their gradients)
PushedRows = tuple[int, torch.Tensor, torch.Tensor]


class RoundAbandoned(ParameterServerError):
    """A sync round a worker pushed into was given up because a worker was lost."""


class PSCore:
    """One parameter server's (or PS shard's) state; every method runs under the caller's lock."""

    def __init__(self, config: TrainConfig, initial_weights: torch.Tensor, float_buffer_count: int = 0,
                 layout: TensorLayout | None = None, tables: Sequence[EmbeddingTable] = ()) -> None:
        """``layout``: the model's parameter tensors in this key range (``training.optim.tensor_layout``), for
        AdamW's decay rule (None: the range decays as a whole); ``tables``: the model's embedding tables,
        held as rows (their pushes and pulls name the rows a batch touched)."""
        if initial_weights.dim() != 1 or initial_weights.dtype != torch.float32:
            raise ValueError("initial_weights must be a flat float32 tensor")
        self.config = config
        self.num_params = initial_weights.numel()
        self.float_buffer_count = float_buffer_count
        self.policy = UpdatePolicy.from_config(config)
        self.master = torch.nn.Parameter(initial_weights.detach().clone().contiguous())
        self.master.grad = None   # set to the averaged gradient for each step
        self.optimizer = make_optimizer(config, self.master, layout, momentum=server_momentum(config))
        # local SGD: pushes are model deltas of the workers' own optimizer steps, applied as they are
        self.applies_deltas = config.local_update == "sgd"
        #: async/softsync with a global budget: train until this many samples are consumed in all
        self.sample_budget: int | None = None
        self.samples_consumed = 0
        # validation and early stopping: per-epoch reports until every active worker's is in
        self._validation_reports: dict[int, dict[int, tuple[int, float, float]]] = {}
        #: epoch -> worker -> (rows, row-weighted sums of the loss and metrics)
        self._epoch_reports: dict[int, dict[int, tuple[int, dict[str, float]]]] = {}
        #: per kind of report ("validation", "metrics"): the last epoch taken out (late reports of it are dropped)
        self._last_closed_epoch = {"validation": -1, "metrics": -1}
        #: completed epochs not yet handed to the driver's callbacks (see take_completed_epochs)
        self._completed_epochs: list[EpochRow] = []
        self.best_validation: ValidationRow | None = None
        self._best_weights: torch.Tensor | None = None
        self._validations_without_improvement = 0
        self.stopped_early = False
        #: the epoch whose row stopped training (early stopping, a callback): later epochs' reports are dropped
        self._stopped_at_epoch: int | None = None
        self.log = RunLog()
        self.worker_failures: dict[int, str] = {}
        self.failure: BaseException | None = None
        self.slots = [WorkerSlot() for _ in range(config.worker_slots)]
        #: work units (``max_workers``): slot ``epoch x units + unit`` trains one pass over ``unit``; 0: none
        self.units = config.work_units
        #: work units: the rows of every unit seen so far (its first task counted them into the budget)
        self._unit_rows: dict[int, int] = {}
        #: the most workers that have trained at once (a task holding a slot is one)
        self.peak_workers = 0
        self._grad_sum = torch.zeros_like(self.master.data)   # sum of samples x scale x gradient, buffered
        self._divisor = torch.ones(())      # the fused optimizer's grad_scale: the samples of the update
        self._grad_sum_empty = True   # the next buffered gradient overwrites instead of adding
        self._pending = _Pending()
        self.tables = list(tables)
        #: per table: the (ids, weight x gradients) buffered for the next update, summed when it is applied
        self._row_sums: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.tables]
        self._best_tables: list[torch.Tensor] | None = None
        self._plan: dict[int, int] | None = None
        # Bumped when a loss abandons a sync round: a pusher waiting in that round learns that
        # its gradient was discarded (the round is redone after the stage retry).
        self._generation = 0
        self._due_snapshot: dict | None = None
        #: executor-hosted shards: periodic snapshots carry only the table rows changed since the previous one
        #: (the coordinator lays them over the cut it keeps), as (table update counts, PS version) marks
        self.table_changes_only = False
        self._table_marks = ([table.steps for table in self.tables], 0)
        self._due_marks = self._table_marks   # where the due snapshot's changes start
        self._start_marks = self._table_marks   # where this PS started (its final changes start there)
        #: versions at which a snapshot becomes due: multiples of any of these (checkpoint files, shard snapshots)
        self.snapshot_every: tuple[int, ...] = (config.checkpoint_every,) if config.checkpoint_dir else ()

    # ----------------------------------------------------------------- views
    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def stats(self):
        return self.log.stats

    @property
    def finished(self) -> bool:
        return all(s.status is WorkerStatus.DONE for s in self.slots)

    @property
    def active_workers(self) -> int:
        """Workers training now."""
        return sum(s.status is WorkerStatus.ACTIVE for s in self.slots)

    def may_start(self, worker: int) -> bool:
        """Whether ``worker``'s hello may take its slot now: a run with work units trains at most
        ``max_workers`` of them at once."""
        self._check_worker_id(worker)
        # a newer attempt of a training task takes its place over; a stage retry's task of a finished unit
        # trains nothing; a lost unit's re-run waits as any other task
        if not self.units or self.failure is not None or self.slots[worker].status in (
                WorkerStatus.ACTIVE, WorkerStatus.DONE):
            return True
        return self.active_workers < cast(int, self.config.max_workers)

    @property
    def workers_seen(self) -> int:
        """Workers that have said hello so far."""
        return sum(s.status is not WorkerStatus.ABSENT for s in self.slots)

    @property
    def plan_ready(self) -> bool:
        """Every worker (an elastic run: ``min_workers`` of them) has said hello once, so the step plan is known."""
        return self._plan is not None

    def is_current(self, worker: int, token: int) -> bool:
        """Whether ``token`` still holds ``worker``'s slot (no newer attempt took it over)."""
        return self.slots[worker].token == token

    def is_active(self, worker: int, token: int) -> bool:
        """Whether ``token``'s session of ``worker`` still trains (not replaced, not lost, not done)."""
        return self.is_current(worker, token) and self.slots[worker].status is WorkerStatus.ACTIVE

    def positions(self) -> list[int]:
        """Per worker: pushes whose gradients the server has consumed."""
        return [s.consumed for s in self.slots]

    def weights(self, span: tuple[int, int] | None = None) -> torch.Tensor:
        """A copy of the current master weights (of the key range ``span`` only, when given)."""
        master = self.master.detach()
        return (master if span is None else master[span[0]:span[1]]).clone()

    def session_of(self, worker: int, task_attempt: int) -> int | None:
        """The token of ``worker``'s session when ``task_attempt`` holds its slot (the other parts of a
        pipelined worker join the session its first part opened), else None."""
        self._check_worker_id(worker)
        slot = self.slots[worker]
        if slot.status is WorkerStatus.ACTIVE and slot.task_attempt == task_attempt:
            return slot.token
        return None

    def progress(self) -> dict:
        """A cheap view of the run for progress displays."""
        updates = self.log.updates
        last = updates[-1] if updates else None
        planned = self.planned_pushes()
        recent = self.log.gradients[-200:]
        budget = self.sample_budget
        # Under a global sample budget a fast worker may start another pass over its partition while the
        # others finish theirs: the run's epoch is the share of the budget consumed, not that worker's pass.
        epoch = (min(self.config.epochs - 1, self.samples_consumed * self.config.epochs // budget) if budget
                 else last.epoch if last else 0)
        return {"pushes": sum(self.positions()), "planned_pushes": planned, "version": self.version,
                "samples_consumed": self.samples_consumed, "sample_budget": budget,
                "epoch": epoch, "loss": last.loss if last else float("nan"),
                "samples": sum(row.samples for row in updates[-50:]),
                "window_s": (cast(UpdateRow, last).time_s - updates[-50].time_s) if len(updates) >= 50 else None,
                "staleness": sum(r.staleness for r in recent) / len(recent) if recent else 0.0,
                "retries": self.stats.rejoins, "joins": self.stats.late_joins,
                # work units: the tasks training now (executors come and go)
                "workers": self.active_workers if self.units else None,
                "val_loss": self.log.validation[-1].val_loss if self.log.validation else None,
                # the newest completed epoch's trainStep metrics (the loss is shown above)
                "metrics": ({k: v for k, v in self.log.epochs[-1].metrics.items() if k != "loss"}
                            if self.log.epochs else {})}

    def planned_pushes(self) -> int | None:
        """Pushes the whole run will take (None before the plan is known)."""
        if self._plan is None:
            return None
        if self.sample_budget is not None:
            budget = self.sample_budget
            if self.units and 0 < len(self._unit_rows) < self.units:   # the units not seen yet: as the seen ones
                budget = budget * self.units // len(self._unit_rows)
            return -(-budget // (self.config.batch_size * self.config.local_steps))
        return sum(-(-steps * self.config.epochs // self.config.local_steps) for steps in self._plan.values())

    def planned_updates(self) -> int | None:
        """Optimizer steps the whole run will take (the horizon of a cosine schedule)."""
        pushes = self.planned_pushes()
        if pushes is None or self._plan is None:
            return None
        if self.policy.rounds_are_atomic:   # one round per push of each worker
            return max((-(-steps * self.config.epochs // self.config.local_steps) for steps in self._plan.values()),
                       default=0)
        return -(-pushes // self.config.gradients_per_update)

    def reported_float_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Each worker's float buffers (BatchNorm statistics ...) with the samples behind them; with work units,
        those of the newest epoch's tasks (each went on from its Python worker's previous unit)."""
        reported = [(i, s) for i, s in enumerate(self.slots) if s.float_buffers is not None]
        if self.units and reported:
            newest = max(i for i, _ in reported) // self.units
            reported = [(i, s) for i, s in reported if i // self.units == newest]
        return [(cast(torch.Tensor, s.float_buffers), s.samples_trained) for _, s in reported]

    def ssp_released(self, worker: int, token: int) -> bool:
        """SSP: whether ``worker`` may have its reply (within the bound of the slowest, or no longer waiting)."""
        if self.failure is not None or not self.is_current(worker, token):
            return True
        return not self.policy.ahead_of_bound(worker, {i: s.consumed for i, s in enumerate(self.slots)})

    @property
    def budget_spent(self) -> bool:
        return self.sample_budget is not None and self.samples_consumed >= self.sample_budget

    @property
    def training_over(self) -> bool:
        """The sample budget is spent or early stopping fired: workers are told to stop.

        With work units each task's pass is its plan, and the passes add up to the budget: the last one ends
        as it spends it, with its epoch's report still to send, so only early stopping stops them."""
        return (self.budget_spent and not self.units) or self.stopped_early

    def final_weights(self) -> torch.Tensor:
        """The run's result: the best validation epoch's weights (``restore_best_weights``), else the last."""
        if self.config.restore_best_weights and self._best_weights is not None:
            return self._best_weights.clone()
        return self.weights()

    def final_tables(self) -> dict[str, torch.Tensor]:
        """The embedding tables of the run's result, by module name (the best epoch's, as :meth:`final_weights`)."""
        best = self._best_tables if self.config.restore_best_weights and self._best_weights is not None else None
        return {table.spec.name: (best[i] if best is not None else table.weight).clone()
                for i, table in enumerate(self.tables)}

    def pull_rows(self, table: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The current values of rows ``ids`` of table ``table``, and the version they belong to."""
        if not 0 <= table < len(self.tables):
            raise ProtocolError(f"table {table} is not one of the run's {len(self.tables)} tables")
        try:
            return self.tables[table].gather(ids), self.version
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

    # ----------------------------------------------------------------- validation
    def validation(self, worker: int, token: int, epoch: int, samples: int, loss_sum: float,
                   metric_total: float) -> bool:
        """``worker``'s validation score after ``epoch``; returns whether training stops early."""
        if self.is_current(worker, token) and not self._after_stop(epoch):
            self._validation_reports.setdefault(epoch, {})[worker] = (samples, loss_sum, metric_total)
            self._complete_validations()
        return self.stopped_early

    def _after_stop(self, epoch: int) -> bool:
        """Whether ``epoch`` comes after the one training stopped on: workers told to stop inside it report
        their part of it, which is no epoch of the run."""
        return self._stopped_at_epoch is not None and epoch > self._stopped_at_epoch

    def _completed(self, reports_by_epoch: dict[int, dict[int, T]], kind: str) -> Iterator[tuple[int, dict[int, T]]]:
        """Take out, in order, every epoch whose reports are all in (finished and lost workers are not waited for).

        A worker's report of an epoch already taken out is dropped: a retried task that resumes inside
        an epoch recorded without it (while it was lost) reports that epoch again, and a new entry for
        it would wait for the others' reports forever and hold back every later epoch.
        """
        for epoch in [e for e in reports_by_epoch if e <= self._last_closed_epoch[kind]]:
            del reports_by_epoch[epoch]
        for epoch in sorted(reports_by_epoch):
            if epoch not in reports_by_epoch:   # training stopped on an earlier one, which dropped it
                return
            if not self._awaited(epoch) <= set(reports_by_epoch[epoch]):
                return
            self._last_closed_epoch[kind] = epoch
            yield epoch, reports_by_epoch.pop(epoch)

    def _awaited(self, epoch: int) -> set[int]:
        """The workers whose report ``epoch``'s row waits for: the active ones that train it; with work units, every
        unit's task of that epoch not yet done (those not started yet too: each unit's pass is in every epoch)."""
        if self.units:
            first = epoch * self.units
            return {i for i in range(first, min(first + self.units, len(self.slots)))
                    if self.slots[i].status is not WorkerStatus.DONE}
        return {i for i, s in enumerate(self.slots) if s.status is WorkerStatus.ACTIVE and epoch >= s.awaited_from_epoch}

    def _complete_validations(self) -> None:
        """Record every validated epoch whose reports are all in."""
        for epoch, reports in self._completed(self._validation_reports, "validation"):
            samples = sum(r[0] for r in reports.values())
            if not samples:
                continue
            row = ValidationRow(epoch, self.version, self.log.now(), samples,
                                sum(r[1] for r in reports.values()) / samples,
                                finish_metric(self.config.loss, sum(r[2] for r in reports.values()), samples))
            self.log.validation.append(row)
            self._early_stopping(row)

    # ----------------------------------------------------------------- epochs' metrics and callbacks
    def epoch_end(self, worker: int, token: int, epoch: int, rows: int, sums: dict[str, float]) -> bool:
        """``worker`` finished ``epoch`` with these row-weighted sums; returns whether training stops."""
        if self.is_current(worker, token) and not self._after_stop(epoch):
            self._epoch_reports.setdefault(epoch, {})[worker] = (rows, sums)
            self._complete_epochs()
        return self.training_over

    def _complete_epochs(self) -> None:
        """Record every trained epoch whose reports are all in; the driver's callbacks take them next."""
        for epoch, reports in self._completed(self._epoch_reports, "metrics"):
            rows = sum(r[0] for r in reports.values())
            if not rows:
                continue
            names = sorted({name for _, sums in reports.values() for name in sums})
            means = {name: sum(sums.get(name, 0.0) for _, sums in reports.values()) / rows for name in names}
            row = EpochRow(epoch, self.version, self.log.now(), rows, means)
            self.log.epochs.append(row)
            self._completed_epochs.append(row)

    def take_completed_epochs(self) -> list[EpochRow]:
        """The epochs completed since the last call, for the driver's callbacks (called outside this lock)."""
        rows, self._completed_epochs = self._completed_epochs, []
        return rows

    def stop_by_callback(self, epoch: int, callback: str) -> None:
        """A callback asked to stop after ``epoch``: training ends as with early stopping."""
        if not self.stopped_early:
            self._stop_early(epoch)
            self.log.event("stopped_by_callback", self.version, epoch=epoch, callback=callback)

    def _stop_early(self, epoch: int) -> None:
        """Training stops now; under sync the round still collecting is dropped, not applied.

        Every gradient of the epoch the stop was decided on is in an applied round by then, so the
        collecting round holds gradients of the next epoch from the workers that were quicker to
        validate.  The workers' ``done()`` would apply it as a partial round and move the weights
        the stop was judged on (the "last" weights of ``restore_best_weights=False``).
        """
        self.stopped_early = True
        self._stopped_at_epoch = epoch
        for reports in (self._validation_reports, self._epoch_reports):   # in before the stop: no epoch of the run
            for later in [e for e in reports if e > epoch]:
                del reports[later]
        if self.policy.rounds_are_atomic and self.policy.buffered:
            self.stats.past_end += self.policy.drop_round()
            self._discard_buffer()

    def _discard_buffer(self) -> None:
        """Forget the gradients summed for the update being collected (the policy dropped that round)."""
        self._grad_sum_empty = True
        self._pending = _Pending()
        self._row_sums = [[] for _ in self.tables]

    def _early_stopping(self, row: ValidationRow) -> None:
        best = self.best_validation
        if best is None or row.val_loss < best.val_loss - self.config.early_stopping_min_delta:
            self.best_validation = row
            self._validations_without_improvement = 0
            if self.config.restore_best_weights:
                self._best_weights = self.weights()
                self._best_tables = [table.weight.clone() for table in self.tables] if self.tables else None
            return
        self._validations_without_improvement += 1
        patience = self.config.early_stopping_patience
        if patience is not None and self._validations_without_improvement >= patience and not self.stopped_early:
            self._stop_early(row.epoch)
            self.log.event("stopped_early", self.version, epoch=row.epoch, best_epoch=best.epoch,
                           best_val_loss=best.val_loss)

    # ----------------------------------------------------------------- checkpoints
    def snapshot(self, tables: str = "whole", table_optimizer_state: bool = True) -> dict:
        """A copy of everything a checkpoint holds.

        ``tables``: ``"whole"`` copies every table; ``"changed"`` takes only the rows changed since the
        previous ``"changed"`` snapshot, ``"since_start"`` those changed since this PS started (restored);
        then ``tables_after`` is the version those changes start from, and the changed rows come without
        their optimizer state unless ``table_optimizer_state``.
        """
        state = {"version": self.version, "weights": self.master.detach().clone(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "updates": self.stats.updates,
                "applied_gradients": self.stats.applied_gradients, "policy": self.config.policy,
                "num_params": self.num_params, "consumed": self.positions(), "time_s": self.log.now(),
                "samples_consumed": self.samples_consumed,
                # the run log's rows at this snapshot: a run resumed from it drops the later ones
                "log_rows": list(self.log.row_counts()[:3])}
        if tables == "whole":
            state["tables"] = [table.state_dict() for table in self.tables]
            return state
        if tables not in ("changed", "since_start"):
            raise ValueError(f"tables must be 'whole', 'changed' or 'since_start', not {tables!r}")
        steps, after = self._table_marks if tables == "changed" else self._start_marks
        state["tables"] = [table.changes_since(mark, table_optimizer_state)
                           for table, mark in zip(self.tables, steps, strict=True)]
        state["tables_after"] = after
        if tables == "changed":
            self._table_marks = ([table.steps for table in self.tables], self.version)
        return state

    def restore(self, checkpoint: dict) -> None:
        """Continue from a checkpoint: weights, optimizer state, version, data positions."""
        if checkpoint["num_params"] != self.num_params:
            raise ValueError(f"the checkpoint holds {checkpoint['num_params']} parameters, the model has "
                             f"{self.num_params}: it belongs to another model")
        positions = checkpoint.get("consumed", [])
        if len(positions) != len(self.slots):
            raise ValueError(f"the checkpoint was written by a run with {len(positions)} workers; resume with "
                             f"num_workers={len(positions)}")
        tables = checkpoint.get("tables", [])
        if [t["weight"].shape for t in tables] != [t.weight.shape for t in self.tables]:
            raise ValueError(f"the checkpoint holds embedding tables of {[tuple(t['weight'].shape) for t in tables]}, "
                             f"the model has {[tuple(t.weight.shape) for t in self.tables]}: it belongs to another model")
        self.master.data.copy_(checkpoint["weights"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        for table, state in zip(self.tables, tables, strict=True):
            table.load_state_dict(state)
        self._table_marks = self._due_marks = self._start_marks = (
            [table.steps for table in self.tables], int(checkpoint["version"]))
        self.policy.version = int(checkpoint["version"])
        self.stats.updates = int(checkpoint.get("updates", 0))
        self.stats.applied_gradients = int(checkpoint.get("applied_gradients", 0))
        for slot, consumed in zip(self.slots, positions, strict=True):
            slot.consumed = int(consumed)
        self.samples_consumed = int(checkpoint.get("samples_consumed", 0))
        self.log.event("resumed", self.version, path=checkpoint.get("path", ""))

    def take_due_snapshot(self) -> dict | None:
        """The snapshot a completed update made due for writing, once (written outside the lock)."""
        due, self._due_snapshot = self._due_snapshot, None
        return due

    # ----------------------------------------------------------------- run-level events
    def fail(self, error: BaseException) -> None:
        """Mark the run failed; every waiting or later request is answered with an error."""
        if self.failure is None:
            self.failure = error
            log.error("parameter server: %s", error)

    def failure_text(self) -> str:
        return f"the training run failed: {self.failure}"

    def rendezvous_timed_out(self) -> None:
        """Not every worker said hello within ``timeout_s``: fail the run, naming who is missing."""
        missing = ([i for i, s in enumerate(self.slots) if s.status is WorkerStatus.ABSENT] if not self.units else
                   f"{(self.config.min_workers or self.config.num_workers) - self.workers_seen} of the "
                   f"{self.config.min_workers or self.config.num_workers} needed to start")
        self.fail(PSTimeoutError(
            f"workers {missing} did not reach the parameter server within {self.config.timeout_s:.0f} s;"
            " check that executors can connect to the driver ('spark.driver.host') and that the "
            "cluster has enough free task slots"))

    # ----------------------------------------------------------------- worker events
    def _check_worker_id(self, worker: int) -> None:
        if not 0 <= worker < len(self.slots):
            raise ProtocolError(f"worker id {worker} is outside [0, {len(self.slots)})")

    def hello(self, worker: int, task_attempt: int, partition_rows: int) -> int:
        """Register ``worker`` (first attempt or a retry); return the token of its session.

        A newer task attempt takes over an active slot.  When the older attempt's gradient sits
        in the sync round being collected, the older attempt counts as lost first, so that
        round is abandoned and redone rather than the new push refused as a second one of the
        same worker; otherwise the older attempt is only silenced (a round other workers' new
        attempts are already filling is not abandoned).
        """
        self._check_worker_id(worker)
        slot = self.slots[worker]
        if slot.status is WorkerStatus.ACTIVE:
            if task_attempt <= slot.task_attempt:
                raise ProtocolError(f"worker {worker} is already connected (attempt {slot.task_attempt})")
            if self.policy.rounds_are_atomic and self.policy.in_current_round(worker):
                self.lost(worker, slot.token, f"replaced by task attempt {task_attempt}")
        rejoining = slot.status is not WorkerStatus.ABSENT
        slot.status, slot.task_attempt, slot.partition_rows = WorkerStatus.ACTIVE, task_attempt, partition_rows
        slot.token += 1
        if rejoining:
            self.stats.rejoins += 1
            self.log.event("rejoined", self.version, worker=worker, attempt=task_attempt)
        self.peak_workers = max(self.peak_workers, self.active_workers)
        if self._plan is None:
            started = {i: s.partition_rows for i, s in enumerate(self.slots) if s.status is not WorkerStatus.ABSENT}
            if len(started) >= (self.config.min_workers or self.config.num_workers):
                self._plan = self.policy.steps_per_epoch(started, self.config.batch_size)
                self.policy.set_active({w for w, n in self._plan.items() if n > 0})
                if self.config.sample_budget == "global" and not self.policy.rounds_are_atomic:
                    self.sample_budget = self.config.epochs * sum(self._unread_rows(i, rows)
                                                                  for i, rows in started.items())
        elif worker not in self._plan:
            self._join_late(worker, partition_rows)
        elif self._plan.get(worker, 0) > 0:
            self.policy.on_worker_joined(worker)
        return slot.token

    def _unread_rows(self, worker: int, partition_rows: int) -> int:
        """The rows ``worker`` brings that no budget counts yet: its partition's, or (work units) its unit's the
        first time a task of that unit says hello (the budget holds every epoch of a unit at once)."""
        if not self.units:
            return partition_rows
        unit = worker % self.units
        if unit in self._unit_rows:
            return 0
        self._unit_rows[unit] = partition_rows
        return partition_rows

    def _join_late(self, worker: int, partition_rows: int) -> None:
        """A worker of an elastic run whose task got its slot after training began (``min_workers``): it trains
        its own partition, whose rows were in no budget yet, so the global budget grows by epochs x them.

        With work units every task after the starting ones comes here: its unit's rows join the budget once,
        and its epoch's row waits for it (:meth:`_awaited`); it is no new worker, so no join is counted."""
        assert self._plan is not None
        self._plan[worker] = self.policy.steps_per_epoch({worker: partition_rows}, self.config.batch_size)[worker]
        if self.sample_budget is not None:
            self.sample_budget += self.config.epochs * self._unread_rows(worker, partition_rows)
        if self._plan[worker] > 0:
            self.policy.on_worker_joined(worker)
        if self.units:
            return
        # the epochs the others have begun close without it (its own first epochs come later)
        begun = [*self._last_closed_epoch.values(), *self._epoch_reports, *self._validation_reports,
                 *(update.epoch for update in self.log.updates[-1:])]
        self.slots[worker].awaited_from_epoch = max(begun) + 1
        self.stats.late_joins += 1
        self.log.event("joined", self.version, worker=worker, rows=partition_rows)

    def welcome(self, worker: int, span: tuple[int, int] | None = None) -> WelcomeReply:
        """The answer to ``worker``'s hello, once the plan is ready.

        ``span``: a pipeline stage's key range, whose weights it always gets (it starts from none).
        """
        assert self._plan is not None, "welcome() before every worker said hello"
        position = self.slots[worker].consumed * self.config.local_steps
        weights = self.weights(span) if span is not None else None if self.version == 0 else self.weights()
        return WelcomeReply(self.version, self._plan[worker], position, weights)

    def failed_before_hello(self, worker: int, text: bytes, part_attempt: int | None = None) -> None:
        """A task reported its failure on a fresh connection (it never got to say hello).

        ``part_attempt``: the failed task is one stage of a pipelined worker, of this attempt;
        its replica counts as lost unless a newer attempt already holds the slot.
        """
        self._check_worker_id(worker)
        slot = self.slots[worker]
        if part_attempt is not None:
            if part_attempt >= slot.task_attempt:
                self.worker_failed(worker, text)
            return
        if slot.status is WorkerStatus.ACTIVE:
            raise ProtocolError(f"FAIL for worker {worker}, which is connected on another connection")
        self.worker_failed(worker, text)

    def worker_failed(self, worker: int, text: bytes, token: int | None = None) -> None:
        """A worker's task failed with this traceback; it counts as lost."""
        message = text.decode("utf-8", "replace")
        last_line = (message.strip().splitlines() or ["?"])[-1]
        # a pipelined replica's stages share its id: the first report is the cause, the later ones
        # are its partners losing their peer
        self.worker_failures.setdefault(worker, message)
        self.log.event("failed", self.version, worker=worker, reason=last_line)
        self.lost(worker, self.slots[worker].token if token is None else token, "failed: " + last_line)

    def lost(self, worker: int, token: int, reason: str) -> None:
        """A worker's task died or went silent; the run may continue when the stage is retried."""
        slot = self.slots[worker]
        if slot.token != token or slot.status is not WorkerStatus.ACTIVE:
            return
        slot.status = WorkerStatus.LOST
        self.stats.workers_lost += 1
        decision: LossDecision = self.policy.on_worker_lost(worker)
        if decision.round_abandoned:   # every worker redoes the interrupted round
            self._discard_buffer()
            self.stats.discarded_on_loss += decision.discarded
            self._generation += 1
        if decision.update is not None:   # the others' buffered gradients no longer wait for it
            self._apply(decision.update)
        self.log.event("lost", self.version, worker=worker, reason=reason)
        log.warning("parameter server: worker %d %s", worker, reason)
        self._complete_validations()
        self._complete_epochs()

    def done(self, worker: int, token: int, float_buffers: torch.Tensor | None, samples: int = 0) -> None:
        """``worker`` finished its plan (handing over its float buffers, if it trained any)."""
        if not self.is_current(worker, token):
            return
        slot = self.slots[worker]
        if float_buffers is not None:
            slot.float_buffers = float_buffers
            slot.samples_trained = samples
            if self.units and worker >= self.units:   # its unit's statistics of an earlier epoch are superseded
                self.slots[worker - self.units].float_buffers = None
        slot.status = WorkerStatus.DONE
        update = self.policy.on_worker_done(worker)
        if update is not None:
            self._apply(update)
        self._complete_validations()
        self._complete_epochs()

    # ----------------------------------------------------------------- push path
    def push(self, worker: int, token: int, meta: PushMeta, grad: torch.Tensor, finite: bool,
             rows: Sequence[PushedRows] = ()) -> PushDecision | None:
        """Take one pushed gradient (with its tables' ``rows``: accepted, buffered or refused with it) per the policy.

        Returns the policy's decision (``wait_for_version``: the pusher's reply waits until
        :meth:`round_settled`, given the :attr:`round_generation` read right after this call),
        or None when no weights may be sent back (the run failed or a newer attempt holds the
        slot).  ``grad`` may be stepped on in place.
        """
        if self.failure is not None or not self.is_current(worker, token):
            return None
        slot = self.slots[worker]
        self.stats.pushes += 1
        if self.training_over:
            self.stats.past_end += 1
            decision = self.policy.refuse(meta.computed_on, Refusal.TRAINING_OVER,
                                          "stopped early" if self.stopped_early else "the sample budget is spent")
        elif not finite:
            self.stats.rejected_nonfinite += 1
            if self.config.nonfinite == "fail":
                self.fail(ParameterServerError(
                    f"worker {worker} pushed a gradient with NaN/Inf values (nonfinite='fail'); lower the "
                    "learning rate, check the data, or set nonfinite='skip'"))
                return None
            decision = self.policy.refuse(meta.computed_on, Refusal.NOT_FINITE, "gradient holds NaN/Inf values")
        else:
            decision = self.policy.on_push(worker, meta.computed_on)
        self.log.gradients.append(GradientRow(self.log.now(), worker, meta.epoch, meta.computed_on,
                                              decision.staleness, decision.accepted))
        if decision.accepted:
            self._pending.add(worker, meta.loss, meta.samples, meta.average_weight, decision.staleness, decision.scale,
                              meta.epoch)
            if not self.policy.rounds_are_atomic:   # never discarded: final now
                slot.consumed += 1
                self.samples_consumed += meta.samples
            update = decision.update
            if update is not None and update.num_gradients == 1 and meta.average_weight > 0:
                if decision.scale != 1.0:
                    grad.mul_(decision.scale)
                    rows = [(table, ids, values * decision.scale) for table, ids, values in rows]
                self._apply(update, grad, rows)      # one gradient: step on it directly, no buffer pass
            else:
                self._buffer(grad, meta.average_weight * decision.scale)
                for table, ids, values in rows:
                    self._row_sums[table].append((ids, values * (meta.average_weight * decision.scale)))
                if update is not None:
                    self._apply(update)
        elif decision.refusal is not Refusal.TRAINING_OVER:   # past the end nothing is consumed
            slot.consumed += 1
            if not self.policy.rounds_are_atomic:
                self.samples_consumed += meta.samples
            if decision.refusal is Refusal.TOO_STALE:
                self.stats.dropped_stale += 1
            elif decision.refusal is Refusal.LATE_FOR_ROUND:
                self.stats.dropped_late += 1
            elif decision.refusal is not Refusal.NOT_FINITE:
                self.stats.refused_gradients += 1
                log.warning("parameter server refused a gradient from worker %d: %s", worker, decision.detail)
        return decision

    @property
    def round_generation(self) -> int:
        """Changes whenever a lost worker abandons a sync round; a pusher remembers it when it starts waiting."""
        return self._generation

    def round_settled(self, worker: int, token: int, target: int, generation: int) -> bool:
        """Whether a pusher waiting for version ``target`` may stop waiting (for any reason)."""
        return (self.version >= target or self.failure is not None or self._generation != generation
                or self.stopped_early or not self.is_current(worker, token))

    def after_round_wait(self, worker: int, token: int, target: int, generation: int, timed_out: bool) -> None:
        """Settle a pusher's wait: raise if its round was abandoned, fail the run if it timed out."""
        if (self.failure is not None or not self.is_current(worker, token) or self.version >= target
                or self.stopped_early):   # a round dropped by the stop: the reply says stop
            return
        if self._generation != generation:
            raise RoundAbandoned(f"sync round {target - 1} was abandoned because a worker was lost; "
                                 "the stage will be retried")
        if timed_out:
            self.fail(PSTimeoutError(
                f"sync round {target - 1} waited {2 * self.config.timeout_s:.0f} s for workers "
                f"{self.policy.missing_from_round()}; a worker is gone or far slower than the others "
                "(raise timeout_s, or use policy='async'/'softsync' for stragglers)"))

    def reply_weights(self, worker: int, token: int, out: torch.Tensor,
                      span: tuple[int, int] | None = None) -> int | None:
        """Copy the current weights (of the key range ``span``) into ``out`` and return their version.

        None: send no weights.
        """
        if self.failure is not None or not self.is_current(worker, token):
            return None
        master = self.master.detach()
        out.copy_(master if span is None else master[span[0]:span[1]])
        return self.version

    def _apply_rows(self, single: Sequence[PushedRows] | None, divisor: float, rate: float) -> None:
        """Step each table on the rows of this update: ``single``'s, or the buffered ones summed (a row several
        gradients touched gets their weighted sum, divided by the update's weight like the dense average)."""
        if single is not None:
            for index, ids, values in single:
                self.tables[index].apply(ids, values, 1.0, rate)
            return
        for held, buffered in zip(self.tables, self._row_sums, strict=True):
            if buffered:
                held.apply(torch.cat([ids for ids, _ in buffered]), torch.cat([v for _, v in buffered]), divisor,
                            rate)

    def _buffer(self, grad: torch.Tensor, weight: float) -> None:
        """Add ``weight x grad`` (weight: the gradient's samples times its staleness factor)."""
        started = time.perf_counter()
        if self._grad_sum_empty:
            torch.mul(grad, weight, out=self._grad_sum)
            self._grad_sum_empty = False
        else:
            self._grad_sum.add_(grad, alpha=weight)
        self.stats.aggregate_seconds += time.perf_counter() - started

    def _apply(self, update: Update, single: torch.Tensor | None = None, single_rows: Sequence[PushedRows] = ()) -> None:
        """Average the buffered gradients (or take ``single`` and its tables' ``single_rows``, already scaled) and step.

        The average weights every gradient by its samples (or its rows' sum of weights, with a
        weight column) and its staleness factor s_i: ``sum(n_i s_i g_i) / sum(n_i)``; the optimizer
        (and so its momentum or Adam state)
        sees this scaled gradient (clipped with ``grad_clip_norm``).  Under local SGD the pushes
        are model deltas, applied as they are (``w <- w - average delta``).  An update whose
        gradients weigh nothing (pushed with weight 0: a mixed-precision step whose loss scaler
        found an overflow) leaves the weights and the optimizer state as they are.
        """
        started = time.perf_counter()
        pending, self._pending = self._pending, _Pending()
        gradient = single if single is not None else self._grad_sum
        divisor = 1.0 if single is not None else (pending.weight if pending.weight > 0 else 1.0)
        self._grad_sum_empty = True
        applied = self.stats.updates
        rate = learning_rate_at(self.config, applied, self.planned_updates())
        if single is None and pending.weight <= 0:
            pass   # nothing to learn from: no step (an empty step would still move momentum and Adam)
        elif self.applies_deltas:
            if divisor != 1.0:
                gradient.mul_(1.0 / divisor)
            self.master.data.sub_(gradient)
        else:
            self.optimizer.lr = rate
            # the fused step divides by grad_scale as it reads the sum: averaging costs no pass of its own
            self.optimizer.step(gradient, self._divisor.fill_(divisor) if divisor != 1.0 else None)
            self._apply_rows(single_rows if single is not None else None, divisor, rate)
        self._row_sums = [[] for _ in self.tables]
        self.stats.optimizer_seconds += time.perf_counter() - started
        self.stats.updates += 1
        self.stats.applied_gradients += update.num_gradients
        if self.policy.rounds_are_atomic:   # a round's gradients become final only now
            for member in pending.workers:
                self.slots[member].consumed += 1
        staleness = pending.staleness or [0]
        scales = pending.scales or [1.0]
        self.log.updates.append(UpdateRow(update.version, self.log.now(), pending.epoch,
                                          pending.loss / max(pending.samples, 1), pending.samples,
                                          update.num_gradients, sum(staleness) / len(staleness), max(staleness),
                                          sum(scales) / len(scales), 0.0 if self.applies_deltas else rate))
        if any(update.version % every == 0 for every in self.snapshot_every):
            if self.table_changes_only:
                if self._due_snapshot is not None:
                    # replaced before it was taken out, so never sent: the new one's changes start where its did
                    self._table_marks = self._due_marks
                self._due_marks = self._table_marks
            self._due_snapshot = self.snapshot("changed" if self.table_changes_only else "whole")
