"""The parameter server's state machine: the push path -- aggregation, the optimizer step, the reply. No I/O.

``PSCore`` holds the master weights (the whole model, or one shard's key range), the optimizer,
the embedding tables and the update policy, and turns the events of a run -- hello, push, lost,
done, failed -- into state changes and answers.  It has no sockets and no threads: the server
(``server.ParameterServer``) decodes frames, calls these methods under its lock, and does the
waiting (a sync pusher waits until :meth:`round_settled` holds).  Tests drive it with scripted
call sequences.

It is composed of three more no-I/O objects, each driven the same way:

* ``members`` (:class:`~sparkdl._internal.ps.server.membership.Membership`): the slots across
  task attempts, the step plan and the sample budget;
* ``epochs`` (:class:`~sparkdl._internal.ps.server.epochs.Epochs`): the workers' epoch reports,
  validation, early stopping and the callbacks' rows;
* ``snapshots`` (:class:`~sparkdl._internal.ps.server.snapshots.Snapshots`): checkpoints and
  shard snapshots, and the restore of one.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.epochs import BestState, Epochs
from sparkdl._internal.ps.server.membership import Membership, SlotStatus
from sparkdl._internal.ps.server.policy import LossDecision, PushDecision, Refusal, Update, UpdatePolicy
from sparkdl._internal.ps.server.runlog import GradientRow, RunLog, ServerStats, UpdateRow
from sparkdl._internal.ps.server.snapshots import Snapshots
from sparkdl._internal.training.optim import TensorLayout, learning_rate_at, make_optimizer, server_momentum
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError, PSTimeoutError

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """Statistics of the gradients buffered for the next update."""

    loss: float = 0.0
    samples: int = 0
    weight: float = 0.0          # the gradients' weights summed: the average's divisor
    staleness: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    epoch: int = 0
    slots: list[int] = field(default_factory=list)

    def add(self, slot: int, loss: float, samples: int, weight: float, staleness: int, scale: float,
            epoch: int) -> None:
        self.slots.append(slot)
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


#: one table's part of a push: (the table's index, this shard's indices of its touched rows, their gradients);
#: the indices are checked (the server's one check of the message) and distinct
PushedRows = tuple[int, torch.Tensor, torch.Tensor]


class RoundAbandoned(ParameterServerError):
    """A sync round a worker pushed into was given up because a worker was lost."""


class PSCore:
    """One parameter server's (or PS shard's) state; every method runs under the caller's lock."""

    def __init__(self, config: TrainConfig, initial_weights: torch.Tensor, float_buffer_count: int = 0,
                 layout: TensorLayout | None = None, tables: Sequence[EmbeddingTable] = (),
                 master_storage: torch.Tensor | None = None) -> None:
        """``layout``: the model's parameter tensors in this key range (``training.optim.tensor_layout``), for
        AdamW's decay rule (None: the range decays as a whole); ``tables``: the model's embedding tables,
        held as rows (their pushes and pulls name the rows a batch touched); ``master_storage``: where the
        master weights live (shared memory the workers read; None: a tensor of the PS's own)."""
        if initial_weights.dim() != 1 or initial_weights.dtype != torch.float32:
            raise ValueError("initial_weights must be a flat float32 tensor")
        self.config = config
        self.num_params = initial_weights.numel()
        self.float_buffer_count = float_buffer_count
        self.policy = UpdatePolicy.from_config(config)
        self.master = torch.nn.Parameter(initial_weights.detach().clone().contiguous() if master_storage is None
                                         else master_storage.copy_(initial_weights))
        self.master.grad = None   # set to the averaged gradient for each step
        self.optimizer = make_optimizer(config, self.master, layout, momentum=server_momentum(config))
        # local SGD: pushes are model deltas of the workers' own optimizer steps, applied as they are
        self.applies_deltas = config.local_update == "sgd"
        self.tables = list(tables)
        self.log = RunLog()
        self.worker_failures: dict[int, str] = {}
        self.failure: BaseException | None = None
        self.members = Membership(config, self.policy, self.log)
        self.epochs = Epochs(config, self.log, self.members, lambda: self.policy.version, self._best_state,
                             self._drop_collecting_round)
        self.snapshots = Snapshots(config, self.master, self.optimizer, self.tables, self.policy, self.members,
                                   self.log)
        self._grad_sum = torch.zeros_like(self.master.data)   # sum of samples x scale x gradient, buffered
        self._divisor = torch.ones(())      # the fused optimizer's grad_scale: the samples of the update
        self._grad_sum_empty = True   # the next buffered gradient overwrites instead of adding
        self._pending = _Pending()
        #: per table: the (row indices, weight x gradients) buffered for the next update, summed when it is applied
        self._row_sums: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.tables]
        # Bumped when a loss abandons a sync round: a pusher waiting in that round learns that
        # its gradient was discarded (the round is redone after the stage retry).
        self._generation = 0

    # ----------------------------------------------------------------- views
    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def stats(self) -> ServerStats:
        return self.log.stats

    @property
    def training_over(self) -> bool:
        """The sample budget is spent or early stopping fired: workers are told to stop.

        With work units each task's pass is its plan, and the passes add up to the budget: the last one ends
        as it spends it, with its epoch's report still to send, so only early stopping stops them."""
        return (self.members.budget_spent and not self.members.units) or self.epochs.stopped_early

    def may_start(self, slot: int) -> bool:
        """Whether a hello for ``slot`` may take it now (a failed run answers every hello at once)."""
        return self.failure is not None or self.members.may_start(slot)

    def weights(self, span: tuple[int, int] | None = None) -> torch.Tensor:
        """A copy of the current master weights (of the key range ``span`` only, when given)."""
        master = self.master.detach()
        return (master if span is None else master[span[0]:span[1]]).clone()

    def planned_updates(self) -> int | None:
        """Optimizer steps the whole run will take (the horizon of a cosine schedule)."""
        pushes = self.members.planned_pushes()
        if pushes is None:
            return None
        if self.policy.rounds_are_atomic:   # one round per push of each slot
            return self.members.planned_rounds()
        return -(-pushes // self.config.gradients_per_update)

    def table_rate(self) -> float:
        """The tables' learning rate for the next update (the rate :meth:`_apply` steps rows at)."""
        return learning_rate_at(self.config, self.stats.updates, self.planned_updates())

    def ssp_released(self, slot: int, token: int) -> bool:
        """SSP: whether ``slot`` may have its reply (within the bound of the slowest, or no longer waiting)."""
        if self.failure is not None or not self.members.is_current(slot, token):
            return True
        return not self.policy.ahead_of_bound(slot, dict(enumerate(self.members.positions())))

    def final_weights(self) -> torch.Tensor:
        """The run's result: the best validation epoch's weights (``restore_best_weights``), else the last."""
        best = self.epochs.best
        if self.config.restore_best_weights and best is not None:
            return best[0].clone()
        return self.weights()

    def final_tables(self) -> dict[str, torch.Tensor]:
        """The embedding tables of the run's result, by module name (the best epoch's, as :meth:`final_weights`)."""
        best = self.epochs.best[1] if self.config.restore_best_weights and self.epochs.best is not None else None
        return {table.spec.name: (best[i] if best is not None else table.weight).clone()
                for i, table in enumerate(self.tables)}

    def pull_rows(self, table: int, index: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The current values of table ``table``'s rows at ``index`` (this shard's row indices, checked), and
        the version they belong to."""
        if not 0 <= table < len(self.tables):
            raise ProtocolError(f"table {table} is not one of the run's {len(self.tables)} tables")
        return self.tables[table].rows_at(index), self.version

    def _best_state(self) -> BestState:
        """What a new best validation epoch keeps (``restore_best_weights``)."""
        return self.weights(), [table.weight.clone() for table in self.tables] if self.tables else None

    # ----------------------------------------------------------------- reports
    def validation(self, slot: int, token: int, epoch: int, samples: int, loss_sum: float,
                   metric_total: float) -> bool:
        """``slot``'s validation score after ``epoch``; returns whether training stops early."""
        if self.members.is_current(slot, token):
            self.epochs.report_validation(slot, epoch, samples, loss_sum, metric_total)
        return self.epochs.stopped_early

    def epoch_end(self, slot: int, token: int, epoch: int, rows: int, sums: dict[str, float]) -> bool:
        """``slot`` finished ``epoch`` with these row-weighted sums; returns whether training stops."""
        if self.members.is_current(slot, token):
            self.epochs.report_epoch(slot, epoch, rows, sums)
        return self.training_over

    def _drop_collecting_round(self) -> None:
        """Training stopped: under sync the round still collecting is dropped, not applied.

        Every gradient of the epoch the stop was decided on is in an applied round by then, so the
        collecting round holds gradients of the next epoch from the workers that were quicker to
        validate.  The workers' ``done()`` would apply it as a partial round and move the weights
        the stop was judged on (the "last" weights of ``restore_best_weights=False``).
        """
        if self.policy.rounds_are_atomic and self.policy.buffered:
            self.stats.past_end += self.policy.drop_round()
            self._discard_buffer()

    def _discard_buffer(self) -> None:
        """Forget the gradients summed for the update being collected (the policy dropped that round)."""
        self._grad_sum_empty = True
        self._pending = _Pending()
        self._row_sums = [[] for _ in self.tables]

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
        self.fail(PSTimeoutError(
            f"workers {self.members.missing()} did not reach the parameter server within {self.config.timeout_s:.0f} s;"
            " check that executors can connect to the driver ('spark.driver.host') and that the "
            "cluster has enough free task slots"))

    # ----------------------------------------------------------------- membership events
    def hello(self, slot: int, task_attempt: int, partition_rows: int) -> int:
        """Register a task for ``slot`` (first attempt or a retry); return the token of its session.

        A newer task attempt takes over an active slot.  When the older attempt's gradient sits
        in the sync round being collected, the older attempt counts as lost first, so that
        round is abandoned and redone rather than the new push refused as a second one of the
        same slot; otherwise the older attempt is only silenced (a round other slots' new
        attempts are already filling is not abandoned).
        """
        self.members.check(slot)
        held = self.members.slots[slot]
        if held.status is SlotStatus.ACTIVE:
            if task_attempt <= held.task_attempt:
                raise ProtocolError(f"worker {slot} is already connected (attempt {held.task_attempt})")
            if self.policy.rounds_are_atomic and self.policy.in_current_round(slot):
                self.lost(slot, held.token, f"replaced by task attempt {task_attempt}")
        return self.members.register(slot, task_attempt, partition_rows, self.epochs.first_unbegun())

    def welcome(self, slot: int, span: tuple[int, int] | None = None) -> WelcomeReply:
        """The answer to ``slot``'s hello, once the plan is ready.

        ``span``: a pipeline stage's key range, whose weights it always gets (it starts from none).
        """
        steps = self.members.epoch_steps
        assert steps is not None, "welcome() before every worker said hello"
        position = self.members.slots[slot].consumed * self.config.local_steps
        weights = self.weights(span) if span is not None else None if self.version == 0 else self.weights()
        return WelcomeReply(self.version, steps[slot], position, weights)

    def failed_before_hello(self, slot: int, text: bytes, part_attempt: int | None = None) -> None:
        """A task reported its failure on a fresh connection (it never got to say hello).

        ``part_attempt``: the failed task is one stage of a pipelined worker, of this attempt;
        its replica counts as lost unless a newer attempt already holds the slot.
        """
        self.members.check(slot)
        held = self.members.slots[slot]
        if part_attempt is not None:
            if part_attempt >= held.task_attempt:
                self.worker_failed(slot, text)
            return
        if held.status is SlotStatus.ACTIVE:
            raise ProtocolError(f"FAIL for worker {slot}, which is connected on another connection")
        self.worker_failed(slot, text)

    def worker_failed(self, slot: int, text: bytes, token: int | None = None) -> None:
        """A task's failure with this traceback; its slot counts as lost."""
        message = text.decode("utf-8", "replace")
        last_line = (message.strip().splitlines() or ["?"])[-1]
        # a pipelined replica's stages share its id: the first report is the cause, the later ones
        # are its partners losing their peer
        self.worker_failures.setdefault(slot, message)
        self.log.event("failed", self.version, worker=slot, reason=last_line)
        self.lost(slot, self.members.slots[slot].token if token is None else token, "failed: " + last_line)

    def lost(self, slot: int, token: int, reason: str) -> None:
        """A task died or went silent; the run may continue when the stage is retried."""
        if not self.members.lose(slot, token):
            return
        decision: LossDecision = self.policy.on_worker_lost(slot)
        if decision.round_abandoned:   # every slot redoes the interrupted round
            self._discard_buffer()
            self.stats.discarded_on_loss += decision.discarded
            self._generation += 1
        if decision.update is not None:   # the others' buffered gradients no longer wait for it
            self._apply(decision.update)
        self.log.event("lost", self.version, worker=slot, reason=reason)
        log.warning("parameter server: worker %d %s", slot, reason)
        self.epochs.complete()

    def done(self, slot: int, token: int, float_buffers: torch.Tensor | None, samples: int = 0) -> None:
        """``slot`` finished its plan (handing over its float buffers, if it trained any)."""
        if not self.members.is_current(slot, token):
            return
        self.members.finish(slot, float_buffers, samples)
        update = self.policy.on_worker_done(slot)
        if update is not None:
            self._apply(update)
        self.epochs.complete()

    # ----------------------------------------------------------------- push path
    def push(self, slot: int, token: int, meta: PushMeta, grad: torch.Tensor, finite: bool,
             rows: Sequence[PushedRows] = ()) -> PushDecision | None:
        """Take one pushed gradient (with its tables' ``rows``: accepted, buffered or refused with it) per the policy.

        Returns the policy's decision (``wait_for_version``: the pusher's reply waits until
        :meth:`round_settled`, given the :attr:`round_generation` read right after this call),
        or None when no weights may be sent back (the run failed or a newer attempt holds the
        slot).  ``grad`` may be stepped on in place.
        """
        if self.failure is not None or not self.members.is_current(slot, token):
            return None
        self.stats.pushes += 1
        if self.training_over:
            self.stats.past_end += 1
            decision = self.policy.refuse(meta.computed_on, Refusal.TRAINING_OVER,
                                          "stopped early" if self.epochs.stopped_early else "the sample budget is spent")
        elif not finite:
            self.stats.rejected_nonfinite += 1
            if self.config.nonfinite == "fail":
                self.fail(ParameterServerError(
                    f"worker {slot} pushed a gradient with NaN/Inf values (nonfinite='fail'); lower the "
                    "learning rate, check the data, or set nonfinite='skip'"))
                return None
            decision = self.policy.refuse(meta.computed_on, Refusal.NOT_FINITE, "gradient holds NaN/Inf values")
        else:
            decision = self.policy.on_push(slot, meta.computed_on)
        self.log.gradients.append(GradientRow(self.log.now(), slot, meta.epoch, meta.computed_on,
                                              decision.staleness, decision.accepted))
        if decision.accepted:
            self._pending.add(slot, meta.loss, meta.samples, meta.average_weight, decision.staleness, decision.scale,
                              meta.epoch)
            if not self.policy.rounds_are_atomic:   # never discarded: final now
                self.members.consume(slot, meta.samples)
            update = decision.update
            if update is not None and update.num_gradients == 1 and meta.average_weight > 0:
                if decision.scale != 1.0:
                    grad.mul_(decision.scale)
                    rows = [(table, index, values * decision.scale) for table, index, values in rows]
                self._apply(update, grad, rows)      # one gradient: step on it directly, no buffer pass
            else:
                self._buffer(grad, meta.average_weight * decision.scale)
                for table, index, values in rows:
                    self._row_sums[table].append((index, values * (meta.average_weight * decision.scale)))
                if update is not None:
                    self._apply(update)
        elif decision.refusal is not Refusal.TRAINING_OVER:   # past the end nothing is consumed
            self.members.consume(slot, meta.samples, count_samples=not self.policy.rounds_are_atomic)
            if decision.refusal is Refusal.TOO_STALE:
                self.stats.dropped_stale += 1
            elif decision.refusal is Refusal.LATE_FOR_ROUND:
                self.stats.dropped_late += 1
            elif decision.refusal is not Refusal.NOT_FINITE:
                self.stats.refused_gradients += 1
                log.warning("parameter server refused a gradient from worker %d: %s", slot, decision.detail)
        return decision

    @property
    def round_generation(self) -> int:
        """Changes whenever a lost worker abandons a sync round; a pusher remembers it when it starts waiting."""
        return self._generation

    def round_settled(self, slot: int, token: int, target: int, generation: int) -> bool:
        """Whether a pusher waiting for version ``target`` may stop waiting (for any reason)."""
        return (self.version >= target or self.failure is not None or self._generation != generation
                or self.epochs.stopped_early or not self.members.is_current(slot, token))

    def after_round_wait(self, slot: int, token: int, target: int, generation: int, timed_out: bool) -> None:
        """Settle a pusher's wait: raise if its round was abandoned, fail the run if it timed out."""
        if (self.failure is not None or not self.members.is_current(slot, token) or self.version >= target
                or self.epochs.stopped_early):   # a round dropped by the stop: the reply says stop
            return
        if self._generation != generation:
            raise RoundAbandoned(f"sync round {target - 1} was abandoned because a worker was lost; "
                                 "the stage will be retried")
        if timed_out:
            self.fail(PSTimeoutError(
                f"sync round {target - 1} waited {2 * self.config.timeout_s:.0f} s for workers "
                f"{self.policy.missing_from_round()}; a worker is gone or far slower than the others "
                "(raise timeout_s, or use policy='async'/'softsync' for stragglers)"))

    def reply_weights(self, slot: int, token: int, out: torch.Tensor | None,
                      span: tuple[int, int] | None = None) -> int | None:
        """Copy the current weights (of the key range ``span``) into ``out`` and return their version.

        ``out`` None: the worker reads the master in place (shared memory), nothing is copied.  Returns None:
        send no weights.
        """
        if self.failure is not None or not self.members.is_current(slot, token):
            return None
        if out is not None:
            master = self.master.detach()
            out.copy_(master if span is None else master[span[0]:span[1]])
        return self.version

    def _apply_rows(self, single: Sequence[PushedRows] | None, divisor: float, rate: float) -> None:
        """Step each table on the rows of this update: ``single``'s, or the buffered ones summed (a row several
        gradients touched gets their weighted sum, divided by the update's weight like the dense average)."""
        if single is not None:    # one worker's rows: distinct already, no sort
            for table, index, values in single:
                self.tables[table].apply_rows(index, values, 1.0, rate, distinct=True)
            return
        for held, buffered in zip(self.tables, self._row_sums, strict=True):
            if buffered:    # several gradients' rows may repeat: summed per row first
                held.apply_rows(torch.cat([index for index, _ in buffered]), torch.cat([v for _, v in buffered]),
                                divisor, rate, distinct=len(buffered) == 1)

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
            for member in pending.slots:
                self.members.consume(member, 0, count_samples=False)
        staleness = pending.staleness or [0]
        scales = pending.scales or [1.0]
        self.log.updates.append(UpdateRow(update.version, self.log.now(), pending.epoch,
                                          pending.loss / max(pending.samples, 1), pending.samples,
                                          update.num_gradients, sum(staleness) / len(staleness), max(staleness),
                                          sum(scales) / len(scales), 0.0 if self.applies_deltas else rate))
        self.snapshots.after_update(update.version)
