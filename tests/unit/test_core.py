"""The parameter-server core driven by scripted event sequences: no sockets, no threads."""
import pytest
import torch

from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError
from sparkdl.ps.core import PSCore, PushMeta, RoundAbandoned, WorkerStatus


def make_core(num_params=4, **settings) -> PSCore:
    config = TrainConfig(**{"num_workers": 2, "policy": "async", "learning_rate": 0.1, **settings})
    return PSCore(config, torch.zeros(num_params))


def meta(computed_on: int, samples: int = 8, loss: float = 1.0, epoch: int = 0) -> PushMeta:
    return PushMeta(computed_on, samples, loss, epoch)


def hello_all(core: PSCore, shard_size: int = 64, task_attempt: int = 0) -> list[int]:
    return [core.hello(w, task_attempt, shard_size) for w in range(len(core.slots))]


def push(core: PSCore, worker: int, token: int, value: float, computed_on: int | None = None):
    grad = torch.full((core.num_params,), value)
    return core.push(worker, token, meta(core.version if computed_on is None else computed_on), grad, True)


def test_async_applies_each_gradient_and_counts_positions():
    core = make_core()
    tokens = hello_all(core)
    assert core.plan_ready and core.welcome(0).steps_per_epoch == 2 and core.welcome(0).weights is None
    decision = push(core, 0, tokens[0], 1.0)
    assert decision.accepted and decision.wait_for_version is None and core.version == 1
    push(core, 1, tokens[1], 3.0, computed_on=0)          # staleness 1
    assert torch.allclose(core.weights(), torch.full((4,), -0.4))
    assert core.positions() == [1, 1]
    assert [row.staleness for row in core.log.gradients] == [0, 1]
    assert [row.version for row in core.log.updates] == [1, 2]
    core.done(0, tokens[0], None)
    core.done(1, tokens[1], None)
    assert core.finished


def test_plan_waits_for_every_hello():
    core = make_core()
    core.hello(0, 0, 64)
    assert not core.plan_ready and core.workers_seen == 1
    core.hello(1, 0, 10)
    assert core.plan_ready and core.welcome(1).steps_per_epoch == 1


def test_sync_round_completes_with_the_last_push_and_counts_then():
    core = make_core(policy="sync")
    tokens = hello_all(core)
    first = push(core, 0, tokens[0], 1.0)
    assert first.wait_for_version == 1
    generation = core.round_generation
    assert not core.round_settled(0, tokens[0], 1, generation)
    assert core.positions() == [0, 0]                      # nothing is final before the round is
    push(core, 1, tokens[1], 3.0)
    assert core.round_settled(0, tokens[0], 1, generation)
    core.after_round_wait(0, tokens[0], 1, generation, timed_out=False)
    assert torch.allclose(core.weights(), torch.full((4,), -0.2)) and core.positions() == [1, 1]


def test_sync_loss_abandons_the_round_and_a_retry_redoes_it():
    core = make_core(policy="sync")
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    generation = core.round_generation
    core.lost(1, tokens[1], "disconnected")
    assert core.round_settled(0, tokens[0], 1, generation)
    with pytest.raises(RoundAbandoned):
        core.after_round_wait(0, tokens[0], 1, generation, timed_out=False)
    assert core.stats.discarded_on_loss == 1 and core.version == 0
    assert torch.equal(core.weights(), torch.zeros(4))
    push(core, 0, tokens[0], 1.0)                          # an old attempt still alive pushes again ...
    tokens = hello_all(core, task_attempt=1)               # ... until the retried stage takes over
    assert core.stats.rejoins == 2 and core.welcome(0).position == 0
    push(core, 0, tokens[0], 1.0)
    push(core, 1, tokens[1], 3.0)
    assert core.version == 1 and core.positions() == [1, 1]


def test_sync_takeover_without_a_loss_redoes_the_round_once():
    """A retried task that says hello while its old attempt still waits in a sync round."""
    core = make_core(policy="sync")
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    push(core, 1, tokens[1], 1.0)                          # round 0 complete: version 1
    push(core, 0, tokens[0], 1.0)                          # round 1: the old attempt of worker 0 waits
    new_tokens = hello_all(core, task_attempt=1)           # no disconnect was seen before these hellos
    assert core.slots[0].status is WorkerStatus.ACTIVE and core.welcome(0).position == 1
    redo = push(core, 0, new_tokens[0], 1.0)
    assert redo.accepted, redo.detail                      # not refused as a second push of round 1
    push(core, 1, new_tokens[1], 1.0)
    assert core.version == 2 and core.positions() == [2, 2]
    assert core.stats.updates == 2 and core.stats.applied_gradients == 4


def test_a_superseded_connection_gets_no_weights():
    core = make_core()
    old = hello_all(core)
    core.hello(0, 5, 64)                                   # a newer attempt of worker 0
    assert push(core, 0, old[0], 1.0) is None
    assert core.reply_weights(0, old[0], torch.empty(4)) is None
    with pytest.raises(ProtocolError, match="already connected"):
        core.hello(0, 5, 64)                               # the same attempt twice


def test_async_loss_keeps_buffered_gradients_and_stops_waiting():
    core = make_core(num_workers=3, policy="softsync", softsync_size=2)
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    core.lost(2, tokens[2], "disconnected")
    assert core.policy.buffered == 1 and core.stats.discarded_on_loss == 0
    push(core, 1, tokens[1], 1.0)                          # c=2 reached with workers 0 and 1
    assert core.version == 1 and core.positions() == [1, 1, 0]
    rejoined = core.hello(2, 1, 64)
    assert core.welcome(2).weights is not None and 2 in core.policy.active
    push(core, 2, rejoined, 1.0)
    assert core.policy.buffered == 1


def test_softsync_takes_c_gradients_from_any_workers():
    core = make_core(num_workers=3, policy="softsync", softsync_size=2)
    tokens = hello_all(core)
    for worker in (0, 0, 1, 2):
        push(core, worker, tokens[worker], 1.0, computed_on=0)
    assert core.version == 2 and [row.gradients for row in core.log.updates] == [2, 2]


def test_done_flushes_a_partial_softsync_buffer():
    core = make_core(num_workers=3, policy="softsync", softsync_size=3)
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    push(core, 1, tokens[1], 1.0)
    core.done(2, tokens[2], None)
    assert core.version == 1 and core.log.updates[0].gradients == 2


@pytest.mark.parametrize("nonfinite", ["skip", "fail"])
def test_nonfinite_gradients(nonfinite):
    core = make_core(nonfinite=nonfinite)
    tokens = hello_all(core)
    grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    decision = core.push(0, tokens[0], meta(0), grad, finite=False)
    assert core.stats.rejected_nonfinite == 1 and torch.equal(core.weights(), torch.zeros(4))
    if nonfinite == "skip":
        assert not decision.accepted and core.positions() == [1, 0] and core.failure is None
    else:
        assert decision is None and isinstance(core.failure, ParameterServerError)


def test_a_sync_wait_that_times_out_fails_the_run_naming_the_missing_worker():
    core = make_core(policy="sync", timeout_s=1)
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    core.after_round_wait(0, tokens[0], 1, core.round_generation, timed_out=True)
    assert "workers [1]" in str(core.failure)


def test_failure_before_hello_is_recorded_and_refused_while_connected():
    core = make_core()
    core.failed_before_hello(1, b"Traceback ...\nValueError: bad row")
    assert "bad row" in core.worker_failures[1] and core.log.events[-1]["event"] == "failed"
    token = core.hello(0, 0, 64)
    with pytest.raises(ProtocolError, match="connected on another connection"):
        core.failed_before_hello(0, b"x")
    assert core.is_current(0, token)


def test_float_buffers_are_averaged_over_workers_that_trained():
    core = make_core()
    tokens = hello_all(core)
    core.done(0, tokens[0], torch.tensor([1.0, 3.0]))
    core.done(1, tokens[1], torch.tensor([3.0, 5.0]))
    assert torch.equal(core.averaged_float_buffers(), torch.tensor([2.0, 4.0]))
