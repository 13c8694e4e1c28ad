"""The parameter server's membership driven by scripted events: slots across task attempts, the step plan, the
sample budget, late joiners and work units. No sockets, no threads."""
import pytest
import torch

from sparkdl._internal.ps.server.membership import Membership, SlotStatus
from sparkdl._internal.ps.server.policy import UpdatePolicy
from sparkdl._internal.ps.server.runlog import RunLog
from sparkdl.config import TrainConfig
from sparkdl.errors import ProtocolError


def make_members(**settings) -> Membership:
    config = TrainConfig(**{"num_workers": 2, "policy": "async", "batch_size": 8, **settings})
    return Membership(config, UpdatePolicy.from_config(config), RunLog())


def test_a_newer_attempt_takes_the_slot_over_and_silences_the_older_one():
    members = make_members()
    old = members.register(0, task_attempt=0, partition_rows=64, first_unbegun_epoch=0)
    members.register(1, 0, 64, 0)
    new = members.register(0, task_attempt=3, partition_rows=64, first_unbegun_epoch=0)
    assert new != old and members.is_active(0, new) and not members.is_current(0, old)
    assert members.log.stats.rejoins == 1 and members.session_of(0, 3) == new and members.session_of(0, 0) is None
    assert not members.lose(0, old)                      # the silenced attempt's loss changes nothing
    assert members.slots[0].status is SlotStatus.ACTIVE
    assert members.lose(0, new) and members.slots[0].status is SlotStatus.LOST and members.log.stats.workers_lost == 1


def test_the_plan_and_the_budget_wait_for_every_starter():
    members = make_members(epochs=1)
    members.register(0, 0, 64, 0)
    assert not members.steps_known and members.sample_budget is None and members.planned_pushes() is None
    members.register(1, 0, 16, 0)
    assert members.steps_known and members.epoch_steps == {0: 8, 1: 2}
    assert members.sample_budget == 80                    # one epoch of both partitions
    assert members.planned_pushes() == 10
    members.consume(0, 8)
    members.consume(1, 8, count_samples=False)
    assert members.positions() == [1, 1] and members.samples_consumed == 8 and not members.budget_spent


def test_a_late_joiner_brings_its_rows_to_the_budget_and_its_reports_start_at_the_next_epoch():
    members = make_members(elastic=True, min_workers=1, epochs=2)
    members.register(0, 0, 64, first_unbegun_epoch=0)
    assert members.steps_known and members.sample_budget == 128
    members.register(1, 0, 32, first_unbegun_epoch=1)
    assert members.sample_budget == 192 and members.log.stats.late_joins == 1
    assert members.slots[1].awaited_from_epoch == 1
    assert members.awaited(0) == {0} and members.awaited(1) == {0, 1}
    assert [e["event"] for e in members.log.events] == ["joined"]


def test_work_units_start_at_most_max_workers_and_count_each_units_rows_once():
    members = make_members(elastic=True, max_workers=2, epochs=2)   # 8 units x 2 epochs = 16 slots
    assert len(members.slots) == 16 and members.units == 8
    members.register(0, 0, 10, 0)
    members.register(1, 0, 10, 0)
    assert not members.may_start(2) and members.may_start(0)          # two train already; a holder may come back
    members.finish(0, torch.ones(3), samples=10)
    assert members.may_start(2)
    members.register(2, 0, 10, 0)
    members.register(8, 0, 10, 0)                                      # unit 0's second epoch: rows counted once
    assert members.sample_budget == 2 * 30
    assert members.awaited(0) == {1, 2, 3, 4, 5, 6, 7}                 # every unit's pass not done, started or not
    members.finish(8, torch.full((3,), 2.0), samples=10)
    assert members.slots[0].float_buffers is None                      # superseded by its unit's newer epoch
    assert [float(b[0]) for b, _ in members.reported_float_buffers()] == [2.0]


def test_slot_ids_outside_the_run_are_a_protocol_error():
    members = make_members()
    with pytest.raises(ProtocolError, match="outside"):
        members.may_start(2)
    assert members.missing() == "[0, 1]"
