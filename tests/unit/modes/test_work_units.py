"""Work units as one value (a slot's epoch and unit) and the per-process store of carried statistics."""
import torch
from torch import nn

from sparkdl._internal.modes.parameter_server.work_units import CarriedStatistics, WorkUnit
from sparkdl._internal.training.flat import flatten_buffers
from sparkdl.config import UNITS_PER_WORKER, TrainConfig


def test_a_slot_is_one_epochs_pass_over_one_unit():
    assert WorkUnit.of(TrainConfig(num_workers=2, policy="async"), 1) is None
    config = TrainConfig(num_workers=2, policy="async", elastic=True, max_workers=2, epochs=3)
    units = UNITS_PER_WORKER * 2
    unit = WorkUnit.of(config, 2 * units + 3)
    assert unit is not None and (unit.epoch, unit.unit) == (2, 3)
    assert unit.first_batch(steps_per_epoch=5) == 10
    assert unit.summary(resumed_at_batch=4, carried=True) == {"unit": 3, "unit_epoch": 2, "resumed_at_batch": 4,
                                                              "buffers_carried": True}
    assert {WorkUnit.of(config, e * units + 3).unit for e in range(3)} == {3}   # held-out rows are chosen by unit


def bn_model(fill: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(fill)
    return model


def test_carried_statistics_go_on_within_one_run_only():
    store = CarriedStatistics()
    fresh = bn_model(0.0)
    assert not store.load_into(b"run-a", fresh)
    store.keep(b"run-a", flatten_buffers(bn_model(5.0)))
    assert store.load_into(b"run-a", fresh) and torch.all(fresh[1].running_mean == 5.0)
    assert not store.load_into(b"run-b", bn_model(0.0))          # another run starts from its own statistics
    store.keep(b"run-b", flatten_buffers(bn_model(7.0)))
    assert not store.load_into(b"run-a", bn_model(0.0))          # one run's at a time
    store.keep(b"run-c", torch.zeros(0))                         # a model without buffers keeps nothing
    assert store.load_into(b"run-b", bn_model(0.0))


def test_a_unit_holds_out_the_same_rows_in_every_epoch_and_units_hold_out_different_ones():
    config = TrainConfig(num_workers=2, policy="async", elastic=True, max_workers=2, epochs=3)
    units = config.work_units
    splits = [WorkUnit.of(config, epoch * units + 5).held_out(200, 0.1, seed=3) for epoch in range(3)]
    assert all(torch.equal(split[1], splits[0][1]) for split in splits) and len(splits[0][1]) == 20
    other = WorkUnit.of(config, 6).held_out(200, 0.1, seed=3)
    assert not torch.equal(other[1], splits[0][1])
