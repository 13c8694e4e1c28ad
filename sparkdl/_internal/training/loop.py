"""One replica's epoch/step loop, written once for parameter-server and allreduce workers.

The loop owns the data order (a seeded permutation per epoch), forward/backward, the
``local_steps`` mini-batches between two exchanges and the timing; what happens at an
exchange (push to a PS, or allreduce and step) is the ``exchange`` callback's business.

Between exchanges a worker either accumulates gradients on the same weights (gradient
accumulation: the mean over the s mini-batches, each weighted by its samples) or, with a
``local_step`` callback, steps its own optimizer after every mini-batch (local SGD /
delayed update: the exchange then carries the model delta of s real steps).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from sparkdl._internal.data.block import Batch
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.training.flat import FlatReplica
from sparkdl._internal.training.inputs import POSITIONAL, ModelCall
from sparkdl._internal.training.losses import LossFn
from sparkdl._internal.training.precision import FLOAT32, MixedPrecision
from sparkdl._internal.training.steps import EpochTotals, TrainStep


class Replica(Protocol):
    """What the loop needs of a worker's model copy: a flat replica, or one split over the workers (fsdp)."""

    model: nn.Module

    def ensure_grad_views(self) -> None: ...


def epoch_order(n: int, epoch: int, seed: int, worker: int, shuffle: bool, length: int) -> torch.Tensor:
    """``length`` sample indices for one epoch: a seeded permutation of ``range(n)``, wrapped around."""
    if shuffle:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + worker) * 1_009 + epoch)
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    if length > n:
        order = order.repeat((length + n - 1) // n)
    return order[:length]


class LocalSteps:
    """Gradient accumulation: one exchange every ``local_steps`` mini-batches (and after the last)."""

    def __init__(self, local_steps: int) -> None:
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        self.local_steps = local_steps
        self.pending = 0

    def after_batch(self, last: bool) -> int:
        """Count one mini-batch; return how many are to be averaged and exchanged now (0: none)."""
        self.pending += 1
        if self.pending >= self.local_steps or last:
            count, self.pending = self.pending, 0
            return count
        return 0


@dataclass(frozen=True)
class LoopPlan:
    """Which mini-batches one worker trains on, in which order."""

    worker: int
    partition_rows: int
    steps_per_epoch: int
    #: None: until an exchange says stop (a global sample budget shared by all workers)
    epochs: int | None
    batch_size: int
    local_steps: int
    seed: int
    shuffle: bool
    #: every epoch takes ``steps_per_epoch`` full batches, a small partition wrapping around its order
    #: (sync rounds need the same number of pushes from every worker)
    wrap_partition: bool
    #: mini-batches already consumed in an earlier task attempt: the loop resumes after them
    start_batch: int = 0

    @property
    def total_batches(self) -> int | None:
        return None if self.epochs is None else self.steps_per_epoch * self.epochs


@dataclass
class LoopCounters:
    """What one replica's loop did; the per-task summary is built from it."""

    batches: int = 0
    exchanges: int = 0
    accepted: int = 0
    samples: int = 0
    compute_seconds: float = 0.0
    #: the exchange callbacks' time: wire, waiting, and (allreduce) the optimizer step
    communication_seconds: float = 0.0
    #: the epoch an exchange's stop ended the loop in, before that epoch's end (None: not stopped so)
    stopped_in_epoch: int | None = None


#: exchange(gradient divisor, samples, sample-weighted mean loss, epoch, rows' weight) -> (gradient used?, stop now?)
#: The divisor turns the accumulated ``replica.grads`` into the weighted mean gradient; the rows' weight
#: (their sum of weights with a weight column; None without one: the samples) is the gradient's weight in an average.
Exchange = Callable[[float, int, float, int, "float | None"], "tuple[bool, bool]"]


#: before_backward(loss, samples, epoch, rows' weight or None): the forward is done, the backward is about to start
BeforeBackward = Callable[[float, int, int, "float | None"], None]


def backward_step(replica: Replica, loss_fn: LossFn | TrainStep, batch: Batch, weight: float = 1.0,
                  before_backward: Callable[[float], None] | None = None, call: ModelCall = POSITIONAL,
                  precision: MixedPrecision = FLOAT32, totals: EpochTotals | None = None) -> float:
    """Forward and backward on one mini-batch; ``weight`` x its gradient adds into ``replica.grads``.

    ``loss_fn`` is the run's loss on ``call``'s output, or a :class:`TrainStep` (the user's
    ``trainStep``), whose metrics add into ``totals``.  The forward and the loss run under
    ``precision``'s autocast; under float16 the gradient added is multiplied by the loss scale
    (``precision.unscale`` divides it back).
    """
    assert batch.labels is not None   # training rows are labelled
    step = loss_fn if isinstance(loss_fn, TrainStep) else TrainStep(loss_fn, call)
    with precision.autocast():
        loss, metrics = step(replica.model, batch)
    value = loss.item()
    if totals is not None:
        totals.add(value, metrics, len(batch))
    if before_backward is not None:
        before_backward(value)
    precision.scale(loss * weight if weight != 1.0 else loss).backward()
    replica.ensure_grad_views()
    return value


def run_step_loop(replica: Replica, loss_fn: LossFn | TrainStep, data: PartitionBatches, plan: LoopPlan,
                  exchange: Exchange, local_step: Callable[[], None] | None = None,
                  epoch_end: Callable[[int], bool] | None = None, before_backward: BeforeBackward | None = None,
                  call: ModelCall = POSITIONAL, precision: MixedPrecision = FLOAT32,
                  totals: EpochTotals | None = None, lookahead: Callable[[Batch], None] | None = None
                  ) -> LoopCounters:
    """Train ``plan``'s mini-batches from ``plan.start_batch`` on; exchange every ``local_steps`` of them.

    Without ``local_step`` the gradients of the mini-batches accumulate in ``replica.grads``,
    each weighted by its rows' weight over ``batch_size`` (a short last batch counts less); with it,
    ``local_step()`` runs after every backward (a local optimizer step that also clears the
    gradient).  ``exchange`` leaves the new weights in place and the gradient zeroed; when it
    says stop (the run's sample budget is spent, or early stopping), the loop ends.
    ``epoch_end(epoch)`` runs after every completed epoch (validation, the epoch's metrics in ``totals``);
    True stops the loop.
    ``before_backward(loss, samples, epoch)`` runs between every forward and its backward
    (streaming the gradient as backward produces it).  ``precision``: the forward's autocast
    and loss scaling (the callbacks unscale).  ``lookahead(batch)`` is shown the epoch's next
    mini-batch, read before each exchange (the exchange may bring what its forward needs).
    """
    counters = LoopCounters()
    step = loss_fn if isinstance(loss_fn, TrainStep) else TrainStep(loss_fn, call)   # made once, not per batch
    steps = plan.steps_per_epoch
    if not steps or not data.has_labels:
        return counters
    total = plan.total_batches
    start = plan.start_batch if total is None else min(plan.start_batch, total)
    epoch, first_step = divmod(start, steps)
    local = LocalSteps(plan.local_steps)
    done = start
    pending_samples, pending_loss, pending_weight, pending_rows_weight = 0, 0.0, 0.0, 0.0
    replica.model.train()
    while plan.epochs is None or epoch < plan.epochs:
        length = steps * plan.batch_size if plan.wrap_partition else plan.partition_rows
        order = epoch_order(plan.partition_rows, epoch, plan.seed, plan.worker, plan.shuffle, length)
        indices = [order[k * plan.batch_size:(k + 1) * plan.batch_size] for k in range(first_step, steps)]
        # closing: leaving the epoch early (stop, error) also stops the loader's thread
        with contextlib.closing(data.batches(indices, epoch, first_step)) as batches:
            upcoming: Batch | None = None
            for index in range(first_step, steps):
                t0 = time.perf_counter()
                batch, upcoming = (next(batches) if upcoming is None else upcoming), None
                rows, rows_weight = len(batch), batch.weight_sum
                weighted = batch.weights is not None
                # a streamed gradient goes out as backward makes it: no later division by the batch's weight
                weight = 1.0 if local_step is not None or before_backward is not None else rows_weight / plan.batch_size
                # the defaults bind this step's values for the hook that runs later
                announce = None if before_backward is None else (
                    lambda value, samples=rows, at=epoch, w=rows_weight if weighted else None:  # noqa: B008
                    before_backward(value, samples, at, w))
                pending_loss += backward_step(replica, step, batch, weight, announce, call, precision, totals) * rows
                if local_step is not None:
                    local_step()
                pending_samples += rows
                pending_weight += weight
                pending_rows_weight += rows_weight
                done += 1
                counters.batches += 1
                count = local.after_batch(last=done == total)
                t1 = time.perf_counter()
                counters.compute_seconds += t1 - t0
                if not count:
                    continue
                if lookahead is not None and index + 1 < steps:
                    upcoming = next(batches)
                    lookahead(upcoming)
                accepted, stop = exchange(pending_weight, pending_samples, pending_loss / pending_samples, epoch,
                                          pending_rows_weight if weighted else None)
                counters.accepted += accepted
                counters.exchanges += 1
                counters.samples += pending_samples
                pending_samples, pending_loss, pending_weight, pending_rows_weight = 0, 0.0, 0.0, 0.0
                counters.communication_seconds += time.perf_counter() - t1
                if stop:
                    counters.stopped_in_epoch = epoch
                    return counters
        first_step = 0
        if epoch_end is not None and epoch_end(epoch):
            return counters
        epoch += 1
    return counters


def task_summary(plan: LoopPlan, counters: LoopCounters, task_attempt: int, started: float,
                 bytes_pushed: int, bytes_pulled: int, device: torch.device) -> dict[str, Any]:
    """One training task's summary (JSON-friendly); the same fields in every mode."""
    resumed = plan.start_batch if plan.total_batches is None else min(plan.start_batch, plan.total_batches)
    return summary_fields(plan.worker, task_attempt, plan.partition_rows, plan.steps_per_epoch, resumed, counters,
                          started, bytes_pushed, bytes_pulled, device)


def summary_fields(worker: int, task_attempt: int, partition_rows: int, steps_per_epoch: int, resumed_at_batch: int,
                   counters: LoopCounters, started: float, bytes_pushed: int, bytes_pulled: int,
                   device: torch.device) -> dict[str, Any]:
    """The fields every mode's task summary has, from what its loop counted (pipeline stages run their own loop)."""
    return {"worker": worker, "task_attempt": task_attempt, "partition_rows": partition_rows,
            "steps_per_epoch": steps_per_epoch, "resumed_at_batch": resumed_at_batch,
            "batches": counters.batches, "pushes": counters.exchanges, "accepted": counters.accepted,
            "samples": counters.samples, "compute_seconds": counters.compute_seconds,
            "communication_seconds": counters.communication_seconds,
            "wall_seconds": time.perf_counter() - started,
            "bytes_pushed": int(bytes_pushed), "bytes_pulled": int(bytes_pulled), "device": str(device)}


def holdout_split(n: int, fraction: float, seed: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) of a partition: a seeded ``fraction`` of it held out."""
    held = int(round(n * fraction)) if n >= 2 else 0
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 104_729 + worker * 7_919 + 17))
    return order[held:].sort().values, order[:held].sort().values


def evaluate(replica: FlatReplica, loss_fn: LossFn, metric: Callable[[torch.Tensor, torch.Tensor], float],
             data: PartitionBatches, batch_size: int = 1024, call: ModelCall = POSITIONAL) -> tuple[float, float]:
    """(summed loss, summed metric) of the replica's current weights over ``data``, in eval mode.

    Row weights do not enter validation: it reports the plain mean loss and metric over the rows.
    """
    model = replica.model
    model.eval()
    loss_sum = metric_total = 0.0
    indices = [torch.arange(start, min(start + batch_size, data.rows)) for start in range(0, data.rows, batch_size)]
    with torch.no_grad(), contextlib.closing(data.batches(indices, epoch=None)) as batches:
        for batch in batches:
            target = batch.labels
            assert target is not None   # evaluation data is held out of labelled training data
            output = call(model, batch.inputs, batch.masks)
            loss_sum += float(loss_fn(output, target, None)) * len(target)
            metric_total += metric(output, target)
    model.train()
    return loss_sum, metric_total
