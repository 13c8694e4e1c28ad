"""The parameter-server core driven by scripted event sequences: no sockets, no threads."""
import pytest
import torch

from sparkdl._internal.ps.server.core import PSCore, PushMeta, RoundAbandoned
from sparkdl._internal.ps.server.membership import SlotStatus
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError


def make_core(num_params=4, **settings) -> PSCore:
    config = TrainConfig(**{"num_workers": 2, "policy": "async", "learning_rate": 0.1, **settings})
    return PSCore(config, torch.zeros(num_params))


def meta(computed_on: int, samples: int = 8, loss: float = 1.0, epoch: int = 0) -> PushMeta:
    return PushMeta(computed_on, samples, loss, epoch)


def hello_all(core: PSCore, partition_rows: int = 64, task_attempt: int = 0) -> list[int]:
    return [core.hello(w, task_attempt, partition_rows) for w in range(len(core.members.slots))]


def push(core: PSCore, worker: int, token: int, value: float, computed_on: int | None = None):
    grad = torch.full((core.num_params,), value)
    return core.push(worker, token, meta(core.version if computed_on is None else computed_on), grad, True)


def test_async_applies_each_gradient_and_counts_positions():
    core = make_core()
    tokens = hello_all(core)
    assert core.members.steps_known and core.welcome(0).steps_per_epoch == 2 and core.welcome(0).weights is None
    decision = push(core, 0, tokens[0], 1.0)
    assert decision.accepted and decision.wait_for_version is None and core.version == 1
    push(core, 1, tokens[1], 3.0, computed_on=0)          # staleness 1
    assert torch.allclose(core.weights(), torch.full((4,), -0.4))
    assert core.members.positions() == [1, 1]
    assert [row.staleness for row in core.log.gradients] == [0, 1]
    assert [row.version for row in core.log.updates] == [1, 2]
    core.done(0, tokens[0], None)
    core.done(1, tokens[1], None)
    assert core.members.finished


def test_plan_waits_for_every_hello():
    core = make_core()
    core.hello(0, 0, 64)
    assert not core.members.steps_known and core.members.seen == 1
    core.hello(1, 0, 10)
    assert core.members.steps_known and core.welcome(1).steps_per_epoch == 1


def test_sync_round_completes_with_the_last_push_and_counts_then():
    core = make_core(policy="sync")
    tokens = hello_all(core)
    first = push(core, 0, tokens[0], 1.0)
    assert first.wait_for_version == 1
    generation = core.round_generation
    assert not core.round_settled(0, tokens[0], 1, generation)
    assert core.members.positions() == [0, 0]                      # nothing is final before the round is
    push(core, 1, tokens[1], 3.0)
    assert core.round_settled(0, tokens[0], 1, generation)
    core.after_round_wait(0, tokens[0], 1, generation, timed_out=False)
    assert torch.allclose(core.weights(), torch.full((4,), -0.2)) and core.members.positions() == [1, 1]


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
    assert core.version == 1 and core.members.positions() == [1, 1]


def test_sync_takeover_without_a_loss_redoes_the_round_once():
    """A retried task that says hello while its old attempt still waits in a sync round."""
    core = make_core(policy="sync")
    tokens = hello_all(core)
    push(core, 0, tokens[0], 1.0)
    push(core, 1, tokens[1], 1.0)                          # round 0 complete: version 1
    push(core, 0, tokens[0], 1.0)                          # round 1: the old attempt of worker 0 waits
    new_tokens = hello_all(core, task_attempt=1)           # no disconnect was seen before these hellos
    assert core.members.slots[0].status is SlotStatus.ACTIVE and core.welcome(0).position == 1
    redo = push(core, 0, new_tokens[0], 1.0)
    assert redo.accepted, redo.detail                      # not refused as a second push of round 1
    push(core, 1, new_tokens[1], 1.0)
    assert core.version == 2 and core.members.positions() == [2, 2]
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
    assert core.version == 1 and core.members.positions() == [1, 1, 0]
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
        assert not decision.accepted and core.members.positions() == [1, 0] and core.failure is None
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
    assert core.members.is_current(0, token)


def test_float_buffers_are_kept_with_their_samples():
    core = make_core()
    tokens = hello_all(core)
    core.done(0, tokens[0], torch.tensor([1.0, 3.0]), samples=10)
    core.done(1, tokens[1], None, samples=0)
    reported = core.members.reported_float_buffers()
    assert len(reported) == 1 and torch.equal(reported[0][0], torch.tensor([1.0, 3.0])) and reported[0][1] == 10


def test_a_stale_gradient_is_scaled_before_it_enters_the_momentum_buffer():
    """Zhang et al. 2016, per gradient: one tau = 4 gradient moves the weights by 2.5 in all, not 9.25."""
    core = make_core(num_params=1, num_workers=5, learning_rate=1.0, momentum=0.9, staleness_lr="inverse",
                     implicit_momentum="ignore", sample_budget="per_worker")
    tokens = hello_all(core, partition_rows=10**6)
    core.policy.version = 4                                  # the PS moved on four times meanwhile
    core.push(0, tokens[0], meta(0), torch.ones(1), True)   # computed on version 0: tau = 4
    for _ in range(400):                                     # fresh zero gradients let the momentum play out
        core.push(1, tokens[1], meta(core.version), torch.zeros(1), True)
    assert core.log.updates[0].lr_scale == 0.25
    assert core.weights().item() == pytest.approx(-2.5, abs=1e-3)   # 0.25 / (1 - 0.9); unscaled: -9.25


def test_averages_weight_gradients_by_their_samples():
    core = make_core(num_params=1, policy="softsync", softsync_size=2, learning_rate=1.0)
    tokens = hello_all(core)
    core.push(0, tokens[0], PushMeta(0, 32, 1.0, 0), torch.full((1,), 1.0), True)
    core.push(1, tokens[1], PushMeta(0, 8, 3.0, 0), torch.full((1,), 6.0), True)   # a short last batch
    assert core.weights().item() == pytest.approx(-(32 * 1.0 + 8 * 6.0) / 40)
    assert core.log.updates[0].loss == pytest.approx((32 * 1.0 + 8 * 3.0) / 40)


def test_with_row_weights_the_average_weighs_each_gradient_by_its_rows_weights_not_its_samples():
    core = make_core(num_params=1, policy="sync", learning_rate=1.0)
    tokens = hello_all(core)
    core.push(0, tokens[0], PushMeta(0, 32, 1.0, 0, weight=4.0), torch.full((1,), 1.0), True)
    core.push(1, tokens[1], PushMeta(0, 32, 3.0, 0, weight=12.0), torch.full((1,), 6.0), True)
    assert core.weights().item() == pytest.approx(-(4.0 * 1.0 + 12.0 * 6.0) / 16)
    assert core.log.updates[0].samples == 64          # the sample count stays the rows'


def test_a_global_budget_lets_fast_workers_take_over_and_stops_everyone():
    core = make_core(epochs=1, batch_size=32)              # 2 workers x 64 rows: budget 128 samples
    tokens = hello_all(core, partition_rows=64)
    assert core.members.sample_budget == 128 and core.members.planned_pushes() == 4
    for _ in range(4):                                      # the fast worker 0 takes the whole budget
        assert core.push(0, tokens[0], PushMeta(core.version, 32, 1.0, 0), torch.ones(4), True).accepted
    assert core.members.budget_spent
    late = core.push(1, tokens[1], PushMeta(0, 32, 1.0, 0), torch.ones(4), True)
    assert not late.accepted and late.refusal.name == "TRAINING_OVER"
    assert core.members.positions() == [4, 0] and core.members.samples_consumed == 128 and core.stats.applied_gradients == 4


def test_an_elastic_run_starts_with_min_workers_and_a_late_worker_adds_its_partition_to_the_budget():
    core = make_core(epochs=1, batch_size=32, elastic=True, min_workers=1)
    first = core.hello(0, 0, 64)
    assert core.members.steps_known and core.members.sample_budget == 64      # worker 1's task has no slot yet
    for _ in range(2):
        assert core.push(0, first, PushMeta(core.version, 32, 1.0, 0), torch.ones(4), True).accepted
    assert core.members.budget_spent                                 # worker 0's share is trained
    core.done(0, first, None)
    late = core.hello(1, 0, 96)                              # its task got a slot: it trains its own rows
    assert core.welcome(1).steps_per_epoch == 3 and core.members.sample_budget == 160 and not core.members.budget_spent
    for _ in range(3):
        assert core.push(1, late, PushMeta(core.version, 32, 1.0, 0), torch.ones(4), True).accepted
    assert core.members.budget_spent and core.members.positions() == [2, 3] and core.members.samples_consumed == 160
    assert core.stats.late_joins == 1 and core.stats.rejoins == 0
    assert [(e["event"], e["worker"], e["rows"]) for e in core.log.events if e["event"] == "joined"] == [("joined", 1, 96)]


def test_a_late_worker_holds_back_no_epoch_the_others_had_begun():
    core = make_core(epochs=4, batch_size=32, elastic=True, min_workers=1)
    first = core.hello(0, 0, 64)
    core.push(0, first, PushMeta(core.version, 32, 1.0, 1), torch.ones(4), True)   # worker 0 is in epoch 1
    core.epoch_end(0, first, 0, 64, {"loss": 64.0})
    late = core.hello(1, 0, 64)
    core.epoch_end(0, first, 1, 64, {"loss": 32.0})         # epoch 1 closes without the joiner
    assert [row.epoch for row in core.log.epochs] == [0, 1]
    core.epoch_end(0, first, 2, 64, {"loss": 16.0})         # from epoch 2 on, the joiner's report is awaited
    assert [row.epoch for row in core.log.epochs] == [0, 1]
    core.epoch_end(1, late, 2, 64, {"loss": 64.0})
    assert [row.epoch for row in core.log.epochs] == [0, 1, 2] and core.log.epochs[-1].metrics["loss"] == 0.625


def test_work_units_each_epoch_of_a_unit_is_a_slot_the_budget_counts_a_unit_once_and_an_epoch_waits_for_every_unit():
    # max_workers=1: 4 units x 2 epochs; slot e x 4 + u trains epoch e of unit u
    core = make_core(num_workers=1, max_workers=1, epochs=2, batch_size=32, elastic=True)
    assert len(core.members.slots) == 8 and core.members.units == 4
    tokens = {0: core.hello(0, 0, 64)}
    assert core.members.steps_known and core.members.sample_budget == 128 and core.welcome(0).steps_per_epoch == 2
    assert core.members.planned_pushes() == 4 * 128 // 32            # a cosine horizon counts the 3 units not seen yet
    assert not core.may_start(1)                             # one worker trains at a time
    for _ in range(2):
        assert core.push(0, tokens[0], PushMeta(core.version, 32, 1.0, 0), torch.ones(4), True).accepted
    core.epoch_end(0, tokens[0], 0, 64, {"loss": 64.0})
    core.done(0, tokens[0], torch.full((1,), 1.0), 64)
    assert core.may_start(1) and not core.log.epochs        # epoch 0 waits for units 1-3, not started yet
    for unit, rows in ((1, 32), (2, 32), (3, 0)):
        tokens[unit] = core.hello(unit, 0, rows)
        assert core.welcome(unit).position == 0
        if rows:
            core.push(unit, tokens[unit], PushMeta(core.version, rows, 1.0, 0), torch.ones(4), True)
            core.epoch_end(unit, tokens[unit], 0, rows, {"loss": 0.0})
        core.done(unit, tokens[unit], None)
    assert core.members.sample_budget == 2 * 128 and [row.epoch for row in core.log.epochs] == [0]
    assert core.members.planned_pushes() == 256 // 32                # every unit seen: the budget itself
    assert core.log.epochs[0].samples == 128 and core.log.epochs[0].metrics["loss"] == 0.5
    tokens[4] = core.hello(4, 0, 64)                         # epoch 1 of unit 0: its rows are in the budget already
    assert core.members.sample_budget == 256 and core.welcome(4).position == 0
    core.push(4, tokens[4], PushMeta(core.version, 32, 1.0, 1), torch.ones(4), True)
    core.lost(4, tokens[4], "executor lost")
    tokens[5] = core.hello(5, 0, 32)                         # another unit's task took the free place
    assert not core.may_start(4)                             # so the lost task's re-run waits as any other
    core.done(5, tokens[5], None)
    assert core.may_start(4)
    tokens[4] = core.hello(4, 1, 64)                         # Spark's re-run resumes after its consumed batch
    assert core.welcome(4).position == 1 and core.stats.rejoins == 1 and core.stats.late_joins == 0
    core.push(4, tokens[4], PushMeta(core.version, 32, 1.0, 1), torch.ones(4), True)
    core.done(4, tokens[4], torch.full((1,), 3.0), 32)
    # the newest epoch's statistics, not those of every task the run had (unit 0's of epoch 0 are let go)
    assert [(b.item(), n) for b, n in core.members.reported_float_buffers()] == [(3.0, 32)]
    assert core.members.slots[0].float_buffers is None
    assert core.members.peak_workers == 1 and core.members.samples_consumed == 192


def test_reports_of_an_epoch_after_an_early_stop_close_no_epoch():
    core = make_core(epochs=5, validation_fraction=0.1, early_stopping_patience=1)
    tokens = hello_all(core)
    for worker in (0, 1):
        core.validation(worker, tokens[worker], 0, 10, 10.0, 5.0)
    core.validation(0, tokens[0], 1, 10, 20.0, 5.0)
    core.validation(0, tokens[0], 2, 10, 30.0, 5.0)       # worker 0 is an epoch ahead
    assert not core.epochs.stopped_early
    core.validation(1, tokens[1], 1, 10, 20.0, 5.0)       # epoch 1 is worse: training stops on it
    assert core.epochs.stopped_early
    core.validation(1, tokens[1], 2, 5, 15.0, 2.0)        # its part of the epoch it was stopped in
    for worker in (0, 1):
        core.done(worker, tokens[worker], None)
    assert [row.epoch for row in core.log.validation] == [0, 1]


def test_ssp_holds_a_worker_that_runs_ahead_until_the_slowest_catches_up():
    core = make_core(ssp_bound=1, sample_budget="per_worker")
    tokens = hello_all(core)
    push(core, 0, tokens[0], 0.1)
    assert core.ssp_released(0, tokens[0])                  # one ahead: within the bound
    push(core, 0, tokens[0], 0.1)
    assert not core.ssp_released(0, tokens[0])             # two ahead of worker 1: wait
    push(core, 1, tokens[1], 0.1)
    assert core.ssp_released(0, tokens[0])
    core.lost(1, tokens[1], "gone")                        # nobody waits for a lost worker
    push(core, 0, tokens[0], 0.1)
    push(core, 0, tokens[0], 0.1)
    assert core.ssp_released(0, tokens[0])


def test_local_sgd_deltas_are_applied_as_they_are():
    core = make_core(num_params=3, num_workers=1, local_update="sgd", momentum=0.9, learning_rate=0.5)
    token = core.hello(0, 0, 64)
    delta = torch.tensor([0.25, -1.0, 3.0])
    core.push(0, token, meta(0), delta.clone(), True)
    assert torch.equal(core.weights(), -delta)              # no PS optimizer, no learning rate
    assert core.log.updates[0].lr == 0.0


def test_learning_rate_schedule_and_warm_up_are_per_version():
    core = make_core(num_params=1, num_workers=1, learning_rate=1.0, lr_warmup_updates=4, lr_schedule="step",
                     lr_step_every=4, lr_step_gamma=0.5, sample_budget="per_worker")
    token = core.hello(0, 0, 32 * 100)
    for _ in range(10):
        core.push(0, token, meta(core.version), torch.zeros(1), True)
    assert [row.lr for row in core.log.updates] == [0.25, 0.5, 0.75, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25]


def test_the_first_failure_of_a_worker_is_kept_and_the_earliest_worker_explains_the_stage():
    """A pipelined replica's stages share its id: the cause is reported first, its partners after."""
    from sparkdl._internal.spark.failures import barrier_stage_failure
    from sparkdl.errors import WorkerError

    core = make_core()
    core.failed_before_hello(1, b"Traceback ...\nValueError: stage 1 could not build", part_attempt=0)
    core.failed_before_hello(1, b"Traceback ...\nRuntimeError: peer closed", part_attempt=0)
    core.failed_before_hello(0, b"Traceback ...\nRuntimeError: peer closed", part_attempt=0)
    assert "could not build" in core.worker_failures[1]
    error = barrier_stage_failure(RuntimeError("barrier stage failed"), core.worker_failures)
    assert isinstance(error, WorkerError) and error.worker_id == 1 and "could not build" in str(error)


def test_a_data_error_whose_message_spans_lines_is_still_a_data_error():
    """numpy wraps long array reprs: the exception line, not the traceback's last line, says what it was."""
    from sparkdl._internal.spark.failures import barrier_stage_failure
    from sparkdl.errors import DataError

    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    check()\n"
             "sparkdl.errors.DataError: row 3 of the partition has NaN values ([ 1.2345677e+03 nan\n"
             "  1.0000000e+01]); drop them\n")
    error = barrier_stage_failure(RuntimeError("stage failed"), {0: trace})
    assert isinstance(error, DataError) and "row 3 of the partition has NaN" in str(error)


def test_softsync_nodes_silences_an_older_attempt_whose_gradient_waits_without_losing_the_worker():
    """N=3, n=2: worker 0's old attempt has a gradient buffered when its new attempt says hello.  The gradient
    stays (it was accepted), the worker is not counted lost, and the new attempt's first push waits
    for the update that holds the old gradient instead of filling it a second time."""
    core = make_core(num_workers=3, policy="softsync_nodes", softsync_size=2)
    tokens = hello_all(core)
    assert push(core, 0, tokens[0], 1.0).accepted
    retried = core.hello(0, 1, 64)
    assert core.stats.workers_lost == 0 and core.policy.buffered == 1
    duplicate = push(core, 0, retried, 1.0)
    assert not duplicate.accepted and duplicate.wait_for_version == 1
    assert push(core, 1, tokens[1], 1.0).update is not None and core.version == 1


def test_an_epochs_metrics_are_row_weighted_over_every_worker_and_a_lost_one_is_not_waited_for():
    core = make_core(num_workers=3)
    tokens = hello_all(core)
    core.epoch_end(0, tokens[0], 0, 10, {"loss": 10.0, "accuracy": 9.0})
    core.epoch_end(1, tokens[1], 0, 30, {"loss": 90.0, "accuracy": 3.0})
    assert core.log.epochs == [] and core.epochs.take_completed() == []     # worker 2 has not reported
    core.epoch_end(1, tokens[1], 1, 30, {"loss": 30.0, "accuracy": 30.0})   # an epoch ahead: waits its turn
    core.lost(2, tokens[2], "executor lost")
    completed = core.epochs.take_completed()
    assert [row.epoch for row in completed] == [0]                          # epoch 1 still waits for worker 0
    assert completed[0].samples == 40
    assert completed[0].metrics == pytest.approx({"loss": 100.0 / 40, "accuracy": 12.0 / 40})
    core.done(0, tokens[0], None)
    assert [row.epoch for row in core.epochs.take_completed()] == [1] and len(core.log.epochs) == 2
    assert core.epochs.take_completed() == []


def test_a_retried_workers_report_of_an_epoch_recorded_without_it_holds_back_no_later_epoch():
    """Elastic runs: worker 1 is lost, epoch 0 is recorded from worker 0 alone; Spark's re-run of worker 1
    resumes inside epoch 0 and reports it again.  Epoch 1 must still complete once both report it."""
    core = make_core(validation_fraction=0.2)
    tokens = hello_all(core)
    core.lost(1, tokens[1], "executor lost")
    core.epoch_end(0, tokens[0], 0, 10, {"loss": 10.0})
    core.validation(0, tokens[0], 0, 4, 4.0, 3.0)
    assert [row.epoch for row in core.epochs.take_completed()] == [0] and len(core.log.validation) == 1
    retried = core.hello(1, 1, 64)
    core.epoch_end(1, retried, 0, 5, {"loss": 50.0})           # the rest of its epoch 0: recorded already
    core.validation(1, retried, 0, 2, 2.0, 1.0)
    for worker, token in ((0, tokens[0]), (1, retried)):
        core.epoch_end(worker, token, 1, 10, {"loss": 5.0})
        core.validation(worker, token, 1, 4, 2.0, 3.0)
    assert [row.epoch for row in core.epochs.take_completed()] == [1]
    assert [row.epoch for row in core.log.epochs] == [0, 1] and core.log.epochs[0].metrics == {"loss": 1.0}
    assert [row.epoch for row in core.log.validation] == [0, 1]


def test_a_callbacks_stop_ends_training_like_early_stopping():
    core = make_core()
    tokens = hello_all(core)
    assert not core.epoch_end(0, tokens[0], 0, 8, {"loss": 8.0})
    core.epochs.stop_by_callback(0, "on_epoch_end")
    assert core.training_over and core.epoch_end(1, tokens[1], 0, 8, {"loss": 8.0})
    assert not push(core, 0, tokens[0], 1.0).accepted
    assert [e["event"] for e in core.log.events][-1] == "stopped_by_callback"


def test_an_early_stop_under_sync_drops_the_next_epochs_partial_round_instead_of_applying_it():
    """Worker 0 validated first and pushed into epoch 1; worker 1's report stops the run.  Its done()
    must not apply worker 0's gradient as a round of one: the run ends with the weights it was judged on."""
    core = make_core(policy="sync", validation_fraction=0.2, early_stopping_patience=1, restore_best_weights=False)
    tokens = hello_all(core)
    for epoch, loss in enumerate((1.0, 2.0)):      # epoch 1 validates worse than epoch 0: patience 1 stops
        push(core, 0, tokens[0], 1.0)
        push(core, 1, tokens[1], 1.0)
        assert not core.validation(0, tokens[0], epoch, 8, 8 * loss, 8.0)
        if epoch == 0:
            assert not core.validation(1, tokens[1], epoch, 8, 8 * loss, 8.0)
    judged = core.weights()
    waiting = push(core, 0, tokens[0], 5.0)        # worker 0 is already in epoch 2
    generation = core.round_generation
    assert core.validation(1, tokens[1], 1, 8, 16.0, 8.0) and core.epochs.stopped_early
    assert core.round_settled(0, tokens[0], waiting.wait_for_version, generation)
    core.after_round_wait(0, tokens[0], waiting.wait_for_version, generation, timed_out=False)   # no RoundAbandoned
    core.done(1, tokens[1], None)
    core.done(0, tokens[0], None)
    assert torch.equal(core.final_weights(), judged) and core.version == 2 and core.stats.past_end == 1
