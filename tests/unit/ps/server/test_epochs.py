"""Epoch reports driven by scripted events: an epoch's row waits for every slot that trains it, validation keeps
the best weights and stops early, a callback stops training, late and stale reports are dropped."""
import torch

from sparkdl._internal.ps.server.epochs import Epochs
from sparkdl._internal.ps.server.membership import Membership
from sparkdl._internal.ps.server.policy import UpdatePolicy
from sparkdl._internal.ps.server.runlog import RunLog
from sparkdl.config import TrainConfig


class Run:
    """Two active slots, a version the test moves, and a record of what the epochs asked of the core."""

    def __init__(self, **settings):
        config = TrainConfig(**{"num_workers": 2, "policy": "async", "loss": "mse", **settings})
        self.log = RunLog()
        self.members = Membership(config, UpdatePolicy.from_config(config), self.log)
        self.tokens = [self.members.register(slot, 0, 64, 0) for slot in range(2)]
        self.version = 0
        self.stops = 0
        self.epochs = Epochs(config, self.log, self.members, lambda: self.version,
                             lambda: (torch.full((2,), float(self.version)), None), self._stopped)

    def _stopped(self) -> None:
        self.stops += 1


def test_an_epochs_row_waits_for_every_active_slot_and_a_lost_one_is_waited_for_no_longer():
    run = Run()
    run.epochs.report_epoch(0, 0, rows=10, sums={"loss": 5.0})
    assert run.log.epochs == [] and run.epochs.take_completed() == []
    run.epochs.report_epoch(1, 0, rows=30, sums={"loss": 3.0, "acc": 15.0})
    (row,) = run.epochs.take_completed()
    assert row.epoch == 0 and row.samples == 40 and row.metrics == {"acc": 15.0 / 40, "loss": 8.0 / 40}
    run.epochs.report_epoch(0, 1, 10, {"loss": 1.0})
    run.members.lose(1, run.tokens[1])
    run.epochs.complete()
    assert [r.epoch for r in run.epochs.take_completed()] == [1]
    run.epochs.report_epoch(1, 1, 10, {"loss": 1.0})    # a retried task reports the closed epoch again: dropped
    assert run.epochs.take_completed() == [] and len(run.log.epochs) == 2
    assert run.epochs.first_unbegun() == 2


def test_validation_keeps_the_best_epochs_state_and_stops_after_its_patience():
    run = Run(validation_fraction=0.2, early_stopping_patience=2, restore_best_weights=True)
    for epoch, losses in enumerate([(2.0, 2.0), (1.0, 1.0), (1.5, 1.5), (1.2, 1.2)]):
        run.version = 10 * (epoch + 1)
        for slot, loss in enumerate(losses):
            run.epochs.report_validation(slot, epoch, samples=4, loss_sum=4 * loss, metric_total=0.0)
    assert [r.val_loss for r in run.log.validation] == [2.0, 1.0, 1.5, 1.2]
    assert run.epochs.best_validation.epoch == 1 and torch.equal(run.epochs.best[0], torch.full((2,), 20.0))
    assert run.epochs.stopped_early and run.stops == 1
    assert [e["event"] for e in run.log.events] == ["stopped_early"]
    run.epochs.report_validation(0, 4, 4, 0.0, 0.0)      # reported after the stop, of a later epoch: no epoch
    run.epochs.report_validation(1, 4, 4, 0.0, 0.0)
    assert len(run.log.validation) == 4


def test_a_callback_stops_training_once_and_later_reports_are_dropped():
    run = Run()
    run.epochs.report_epoch(0, 2, 10, {"loss": 1.0})     # a quick slot's report of a later epoch
    run.epochs.stop_by_callback(1, "on_epoch_end")
    run.epochs.stop_by_callback(1, "on_epoch_end")
    assert run.epochs.stopped_early and run.stops == 1
    assert [e["event"] for e in run.log.events] == ["stopped_by_callback"]
    run.epochs.report_epoch(1, 2, 10, {"loss": 1.0})
    assert run.log.epochs == []
