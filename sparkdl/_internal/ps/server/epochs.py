"""Epochs as the parameter server sees them: workers' reports, validation, early stopping, callbacks' rows. No I/O.

Every slot that trains an epoch reports it (its loss and trainStep metrics, and with a
validation fraction its held-out score); an epoch's row is recorded once every slot it waits
for has reported (:meth:`Membership.awaited`; finished and lost ones are not waited for).
Validation rows drive early stopping and keep the best epoch's weights; metric rows wait for
the driver's callbacks, which may stop training too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from sparkdl._internal.ps.server.membership import Membership
from sparkdl._internal.ps.server.runlog import EpochRow, RunLog, ValidationRow
from sparkdl._internal.training.losses import finish_metric
from sparkdl.config import TrainConfig

T = TypeVar("T")
#: what the best epoch keeps: the master weights and (when the model has them) every table's rows
BestState = tuple[torch.Tensor, list[torch.Tensor] | None]


class Epochs:
    """One run's epoch reports and what they decide (under the core's caller's lock)."""

    def __init__(self, config: TrainConfig, log: RunLog, members: Membership, version: Callable[[], int],
                 best_state: Callable[[], BestState], on_stop: Callable[[], None]) -> None:
        """``version``: the PS version now; ``best_state``: a copy of what a new best epoch keeps;
        ``on_stop``: called when training stops (the core drops a sync round still collecting)."""
        self.config = config
        self.log = log
        self.members = members
        self._version = version
        self._best_state = best_state
        self._on_stop = on_stop
        #: epoch -> slot -> (rows, loss sum, metric sum) of the held-out rows
        self._validation_reports: dict[int, dict[int, tuple[int, float, float]]] = {}
        #: epoch -> slot -> (rows, row-weighted sums of the loss and metrics)
        self._epoch_reports: dict[int, dict[int, tuple[int, dict[str, float]]]] = {}
        #: per kind of report ("validation", "metrics"): the last epoch taken out (late reports of it are dropped)
        self._last_closed_epoch = {"validation": -1, "metrics": -1}
        #: completed epochs not yet handed to the driver's callbacks (see take_completed)
        self._completed: list[EpochRow] = []
        self.best_validation: ValidationRow | None = None
        #: the best validation epoch's weights and tables (``restore_best_weights``)
        self.best: BestState | None = None
        self._validations_without_improvement = 0
        self.stopped_early = False
        #: the epoch whose row stopped training (early stopping, a callback): later epochs' reports are dropped
        self._stopped_at_epoch: int | None = None

    def first_unbegun(self) -> int:
        """The first epoch no slot has begun (nor reported, nor updated in): where a late joiner starts."""
        begun = [*self._last_closed_epoch.values(), *self._epoch_reports, *self._validation_reports,
                 *(update.epoch for update in self.log.updates[-1:])]
        return max(begun) + 1

    # ----------------------------------------------------------------- reports
    def report_validation(self, slot: int, epoch: int, samples: int, loss_sum: float, metric_total: float) -> None:
        """``slot``'s validation score after ``epoch``."""
        if not self._after_stop(epoch):
            self._validation_reports.setdefault(epoch, {})[slot] = (samples, loss_sum, metric_total)
            self.complete()

    def report_epoch(self, slot: int, epoch: int, rows: int, sums: dict[str, float]) -> None:
        """``slot`` finished ``epoch`` with these row-weighted sums."""
        if not self._after_stop(epoch):
            self._epoch_reports.setdefault(epoch, {})[slot] = (rows, sums)
            self.complete()

    def complete(self) -> None:
        """Record every epoch whose reports are all in (a slot done or lost is waited for no longer)."""
        self._complete_validations()
        self._complete_epochs()

    def take_completed(self) -> list[EpochRow]:
        """The epochs completed since the last call, for the driver's callbacks (called outside the lock)."""
        rows, self._completed = self._completed, []
        return rows

    def _after_stop(self, epoch: int) -> bool:
        """Whether ``epoch`` comes after the one training stopped on: workers told to stop inside it report
        their part of it, which is no epoch of the run."""
        return self._stopped_at_epoch is not None and epoch > self._stopped_at_epoch

    def _take_complete(self, reports_by_epoch: dict[int, dict[int, T]], kind: str) -> Iterator[tuple[int, dict[int, T]]]:
        """Take out, in order, every epoch whose reports are all in.

        A slot's report of an epoch already taken out is dropped: a retried task that resumes inside
        an epoch recorded without it (while it was lost) reports that epoch again, and a new entry for
        it would wait for the others' reports forever and hold back every later epoch.
        """
        for epoch in [e for e in reports_by_epoch if e <= self._last_closed_epoch[kind]]:
            del reports_by_epoch[epoch]
        for epoch in sorted(reports_by_epoch):
            if epoch not in reports_by_epoch:   # training stopped on an earlier one, which dropped it
                return
            if not self.members.awaited(epoch) <= set(reports_by_epoch[epoch]):
                return
            self._last_closed_epoch[kind] = epoch
            yield epoch, reports_by_epoch.pop(epoch)

    def _complete_validations(self) -> None:
        for epoch, reports in self._take_complete(self._validation_reports, "validation"):
            samples = sum(r[0] for r in reports.values())
            if not samples:
                continue
            row = ValidationRow(epoch, self._version(), self.log.now(), samples,
                                sum(r[1] for r in reports.values()) / samples,
                                finish_metric(self.config.loss, sum(r[2] for r in reports.values()), samples))
            self.log.validation.append(row)
            self._early_stopping(row)

    def _complete_epochs(self) -> None:
        for epoch, reports in self._take_complete(self._epoch_reports, "metrics"):
            rows = sum(r[0] for r in reports.values())
            if not rows:
                continue
            names = sorted({name for _, sums in reports.values() for name in sums})
            means = {name: sum(sums.get(name, 0.0) for _, sums in reports.values()) / rows for name in names}
            row = EpochRow(epoch, self._version(), self.log.now(), rows, means)
            self.log.epochs.append(row)
            self._completed.append(row)

    # ----------------------------------------------------------------- stopping
    def stop_by_callback(self, epoch: int, callback: str) -> None:
        """A callback asked to stop after ``epoch``: training ends as with early stopping."""
        if not self.stopped_early:
            self._stop(epoch)
            self.log.event("stopped_by_callback", self._version(), epoch=epoch, callback=callback)

    def _stop(self, epoch: int) -> None:
        """Training stops now; the reports of later epochs (sent before the stop) belong to no epoch of the run."""
        self.stopped_early = True
        self._stopped_at_epoch = epoch
        for reports in (self._validation_reports, self._epoch_reports):
            for later in [e for e in reports if e > epoch]:
                del reports[later]
        self._on_stop()

    def _early_stopping(self, row: ValidationRow) -> None:
        best = self.best_validation
        if best is None or row.val_loss < best.val_loss - self.config.early_stopping_min_delta:
            self.best_validation = row
            self._validations_without_improvement = 0
            if self.config.restore_best_weights:
                self.best = self._best_state()
            return
        self._validations_without_improvement += 1
        patience = self.config.early_stopping_patience
        if patience is not None and self._validations_without_improvement >= patience and not self.stopped_early:
            self._stop(row.epoch)
            self.log.event("stopped_early", self._version(), epoch=row.epoch, best_epoch=best.epoch,
                           best_val_loss=best.val_loss)
