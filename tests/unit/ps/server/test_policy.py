"""Update policies driven by scripted arrival sequences (no I/O)."""
import pytest

from sparkdl._internal.ps.server.policy import LossDecision, Refusal, UpdatePolicy, steps_per_epoch
from sparkdl._internal.training.loop import LocalSteps
from sparkdl.config import TrainConfig


def run(policy: UpdatePolicy, arrivals):
    """Feed (worker, computed_on) pushes; return the decisions."""
    return [policy.on_push(worker, version) for worker, version in arrivals]


def test_async_applies_every_gradient_and_measures_staleness():
    policy = UpdatePolicy("async", 2, 1)
    decisions = run(policy, [(0, 0), (1, 0), (0, 1), (1, 1), (1, 4)])
    assert [d.staleness for d in decisions] == [0, 1, 1, 2, 0]
    assert [d.update.version for d in decisions] == [1, 2, 3, 4, 5]
    assert all(d.accepted and d.wait_for_version is None for d in decisions)
    assert all(d.scale == 1.0 for d in decisions)


@pytest.mark.parametrize("staleness, expected_scale", [(0, 1.0), (1, 1.0), (2, 0.5), (3, 1 / 3), (10, 0.1)])
def test_inverse_staleness_learning_rate(staleness, expected_scale):
    policy = UpdatePolicy("async", 4, 1, staleness_lr="inverse")
    policy.version = 10
    decision = policy.on_push(0, 10 - staleness)
    assert decision.staleness == staleness
    assert decision.scale == pytest.approx(expected_scale, abs=0)


def test_softsync_with_inverse_rate_scales_each_gradient():
    policy = UpdatePolicy("softsync", 4, 2, staleness_lr="inverse")
    policy.version = 4
    first, second = run(policy, [(0, 4), (1, 2)])   # tau 0 -> 1, tau 2 -> 1/2
    assert first.update is None and second.update is not None and second.update.num_gradients == 2
    assert (first.scale, second.scale) == (1.0, 0.5)


def test_softsync_applies_exactly_every_c_gradients():
    policy = UpdatePolicy("softsync", 4, 3)
    arrivals = [(0, 0), (0, 0), (2, 0), (3, 1), (1, 1), (1, 1), (0, 2)]
    decisions = run(policy, arrivals)
    assert [d.update is not None for d in decisions] == [False, False, True, False, False, True, False]
    assert [d.update.num_gradients for d in decisions if d.update] == [3, 3]
    assert policy.version == 2 and policy.buffered == 1
    assert all(d.wait_for_version is None for d in decisions)


def test_sync_waits_for_every_worker_once_per_version():
    policy = UpdatePolicy("sync", 3, 3)
    d0, d1 = run(policy, [(0, 0), (2, 0)])
    assert d0.update is None and d1.update is None
    assert d0.wait_for_version == 1
    assert policy.missing_from_round() == [1]
    twice = policy.on_push(0, 0)
    assert not twice.accepted and twice.refusal is Refusal.DUPLICATE and "twice" in twice.detail
    last = policy.on_push(1, 0)
    assert last.update.version == 1 and last.update.num_gradients == 3
    stale = policy.on_push(0, 0)          # a gradient on the old version is refused in sync
    assert not stale.accepted and stale.staleness == 1 and stale.refusal is Refusal.WRONG_ROUND


def test_max_staleness_drops_what_it_must():
    policy = UpdatePolicy("async", 2, 1, max_staleness=2)
    policy.version = 5
    decisions = run(policy, [(0, 3), (1, 2), (0, 6)])   # tau 2 (kept), tau 4 (dropped)...
    assert decisions[0].accepted and decisions[0].staleness == 2
    assert not decisions[1].accepted and decisions[1].staleness == 4 and decisions[1].refusal is Refusal.TOO_STALE
    assert decisions[1].update is None
    assert decisions[2].accepted and decisions[2].staleness == 0   # version 6 after the first update
    assert policy.version == 7


def test_future_versions_and_unknown_workers_are_refused():
    policy = UpdatePolicy("async", 2, 1)
    assert policy.on_push(0, 3).refusal is Refusal.FUTURE_VERSION
    policy.set_active({0})
    assert policy.on_push(1, 0).refusal is Refusal.NOT_ACTIVE
    assert policy.version == 0


def test_done_worker_flushes_partial_softsync_buffer():
    policy = UpdatePolicy("softsync", 3, 3)
    run(policy, [(0, 0), (1, 0)])
    update = policy.on_worker_done(2)      # 2 buffered, 2 workers left: c becomes min(3, 2) = 2
    assert update is not None and update.num_gradients == 2 and policy.buffered == 0
    policy2 = UpdatePolicy("softsync", 3, 3)
    run(policy2, [(0, 0)])
    update = policy2.on_worker_done(2)
    assert update is None and policy2.buffered == 1  # 1 buffered < min(3, 2)
    update = policy2.on_worker_done(1)               # only worker 0 left: needs 1
    assert update is not None and update.num_gradients == 1


def test_sync_round_completes_when_a_worker_leaves():
    policy = UpdatePolicy("sync", 3, 3)
    run(policy, [(0, 0), (1, 0)])
    update = policy.on_worker_done(2)
    assert update is not None and update.num_gradients == 2 and policy.version == 1


def test_policy_from_config_maps_c():
    assert UpdatePolicy.from_config(TrainConfig(num_workers=4, policy="sync")).gradients_per_update == 4
    assert UpdatePolicy.from_config(TrainConfig(num_workers=4, policy="async")).gradients_per_update == 1
    assert UpdatePolicy.from_config(
        TrainConfig(num_workers=4, policy="softsync", softsync_size=3)).gradients_per_update == 3


@pytest.mark.parametrize("policy, sizes, batch, expected", [
    ("sync", {0: 100, 1: 60}, 32, {0: 4, 1: 4}),
    ("async", {0: 100, 1: 60}, 32, {0: 4, 1: 2}),
    ("softsync", {0: 64, 1: 65}, 32, {0: 2, 1: 3}),
    ("sync", {0: 100, 1: 0}, 32, {0: 4, 1: 0}),
])
def test_steps_per_epoch(policy, sizes, batch, expected):
    assert steps_per_epoch(policy, sizes, batch) == expected


@pytest.mark.parametrize("s, batches, pushes", [
    (1, 5, [1, 1, 1, 1, 1]),
    (2, 5, [0, 2, 0, 2, 1]),     # the remainder is pushed at the end
    (3, 6, [0, 0, 3, 0, 0, 3]),
])
def test_local_steps_push_once_per_s_batches(s, batches, pushes):
    local = LocalSteps(s)
    assert [local.after_batch(last=i == batches - 1) for i in range(batches)] == pushes


def test_a_lost_sync_worker_stays_expected_and_its_round_is_dropped():
    policy = UpdatePolicy("sync", 2, 2)
    policy.on_push(0, 0)
    assert policy.on_worker_lost(1) == LossDecision(1, True)   # worker 0's gradient of the round is dropped
    assert policy.active == {0, 1} and policy.buffered == 0
    assert policy.on_push(0, 0).update is None       # the round still waits for worker 1
    policy.on_worker_joined(1)
    assert policy.on_push(1, 0).update is not None


def test_a_lost_async_worker_is_no_longer_waited_for():
    policy = UpdatePolicy("softsync", 3, 2)
    policy.on_push(0, 0)
    assert policy.on_worker_lost(2) == LossDecision(0, False) and policy.active == {0, 1} and policy.buffered == 1


def test_backup_workers_complete_a_round_with_the_first_n_minus_b():
    policy = UpdatePolicy("sync", 3, 2)                    # N = 3, b = 1
    d0, d1 = run(policy, [(0, 0), (2, 0)])
    assert d0.update is None and d1.update is not None and policy.version == 1
    late = policy.on_push(1, 0)                            # worker 1's gradient for round 0 comes too late
    assert not late.accepted and late.refusal is Refusal.LATE_FOR_ROUND and late.wait_for_version is None
    assert policy.on_push(1, 1).accepted                   # it joins round 1


def test_softsync_nodes_waits_for_n_distinct_workers():
    policy = UpdatePolicy("softsync_nodes", 4, 2)
    first = policy.on_push(0, 0)
    assert first.accepted and first.update is None and first.wait_for_version == 1
    second = policy.on_push(3, 0)                          # the second distinct worker completes the update
    assert second.update is not None and second.update.num_gradients == 2 and second.wait_for_version == 1
    # n = 1 is ASGD: every push is an update and nobody waits for anybody else
    asgd = UpdatePolicy("softsync_nodes", 4, 1)
    assert all(asgd.on_push(w, asgd.version).update is not None for w in (0, 1, 0))


def test_softsync_nodes_applies_a_buffer_a_lost_worker_no_longer_completes():
    policy = UpdatePolicy("softsync_nodes", 2, 2)
    policy.on_push(0, 0)
    decision = policy.on_worker_lost(1)
    assert decision.update is not None and decision.update.num_gradients == 1 and not decision.round_abandoned


def test_ssp_blocks_a_worker_more_than_the_bound_ahead_of_the_slowest():
    policy = UpdatePolicy("async", 3, 1, ssp_bound=2)
    assert not policy.ahead_of_bound(0, {0: 2, 1: 0, 2: 1})
    assert policy.ahead_of_bound(0, {0: 3, 1: 0, 2: 1})
    policy.active.discard(1)                               # a finished or lost worker no longer holds others
    assert not policy.ahead_of_bound(0, {0: 3, 1: 0, 2: 1})
    assert not UpdatePolicy("async", 3, 1).ahead_of_bound(0, {0: 100, 1: 0, 2: 0})


def test_softsync_nodes_never_counts_one_worker_twice_across_a_retry():
    """N=3, n=2: a lost worker's buffered gradient stays; its retried attempt's push may not complete the update."""
    policy = UpdatePolicy("softsync_nodes", 3, 2)
    assert policy.on_push(0, 0).accepted
    assert policy.on_worker_lost(0).update is None          # workers 1 and 2 can still complete it
    policy.on_worker_joined(0)
    again = policy.on_push(0, 0)
    assert not again.accepted and again.refusal is Refusal.DUPLICATE and again.update is None
    assert "distinct" in again.detail and again.wait_for_version == 1   # waits for the update, as pushers do
    completed = policy.on_push(1, 0)                        # a second distinct worker completes the update
    assert completed.update is not None and completed.update.num_gradients == 2
    assert policy.on_push(0, 1).accepted                    # worker 0 takes part in the next update


def test_backup_workers_set_in_the_config_close_a_sync_round_early():
    """N=3, b=1 (Chen et al.): the config's round size is N - b, so two gradients make the update."""
    policy = UpdatePolicy.from_config(TrainConfig(num_workers=3, policy="sync", backup_workers=1))
    assert policy.on_push(2, 0).update is None
    update = policy.on_push(0, 0).update
    assert update is not None and update.num_gradients == 2
    late = policy.on_push(1, 0)
    assert not late.accepted and late.refusal is Refusal.LATE_FOR_ROUND
