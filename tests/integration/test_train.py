"""Training through real Spark (local[2]) on real data."""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch
from torch import nn

import sparkdl
from sparkdl import ClusterConfigError, SparkDLError, TrainConfig, WorkerError, train
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.spark.backend import backend_for
from sparkdl._internal.spark.preflight import check_executor_python
from sparkdl.models import mlp

from ..conftest import ASYNC_ACCURACY, DIGITS_MLP

BASE = TrainConfig(num_workers=2, epochs=10, batch_size=16, optimizer="sgd", learning_rate=0.05, momentum=0.9)


@pytest.mark.parametrize("settings", [
    {"policy": "sync"},
    {"policy": "async"},
    {"policy": "async", "staleness_lr": "inverse"},
    {"policy": "softsync", "softsync_size": 2},
    {"policy": "softsync", "softsync_size": 1, "local_steps": 2},
    {"policy": "allreduce"},
    {"policy": "fsdp"},
    {"policy": "softsync_nodes", "softsync_size": 2, "elastic": True},
], ids=["sync", "async", "async-inverse-lr", "softsync-c2", "softsync-s2", "allreduce", "fsdp",
         "softsync-nodes-elastic"])
def test_each_policy_learns_digits(digits_rdd, digits, settings):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, DIGITS_MLP, BASE.replace(**settings))
    accuracy = result.accuracy(DIGITS_MLP, x_test, y_test)
    # stale policies' accuracy varies with how the workers interleave on a busy machine (async with
    # the inverse staleness rate once measured 0.908 in a run of the suite): well above chance (0.1)
    assert accuracy >= (0.93 if settings["policy"] in ("sync", "allreduce", "fsdp") else ASYNC_ACCURACY), (
        settings, accuracy, result.summary)
    summary = result.summary
    # an elastic run's tasks ran as a plain stage (Spark re-runs a lost one alone), the others as a barrier stage
    assert [w["barrier_stage"] for w in result.workers] == [not settings.get("elastic", False)] * 2
    # every push is applied, except those that arrive once the global sample budget is spent
    assert summary["applied_gradients"] + summary.get("pushes_past_end", 0) == summary["pushes"]
    assert summary["samples"] >= len(digits[0]) * BASE.epochs
    pushes = sum(w["pushes"] for w in result.workers)
    assert pushes == summary["pushes"]
    # each push averages local_steps batches
    assert sum(w["batches"] for w in result.workers) == pytest.approx(pushes * settings.get("local_steps", 1), abs=2)
    assert len(result.history) == summary["updates"] > 0
    # a fast worker may start further passes over its shard before the global budget is spent
    assert set(range(BASE.epochs)) <= set(result.epochs["epoch"])
    assert result.epochs["loss"].iloc[-1] < result.epochs["loss"].iloc[0]
    if settings["policy"] == "sync":
        assert summary["staleness_max"] == 0
        assert summary["updates"] * 2 == summary["pushes"]
    if settings["policy"] in ("allreduce", "fsdp"):
        assert summary["staleness_max"] == 0 and summary["applied_gradients"] == 2 * summary["updates"]


@pytest.mark.parametrize("policy", ["sync", "allreduce", "fsdp"])
def test_sync_equals_single_process_big_batch_sgd(spark, digits, policy):
    """2 workers x batch b under sync (PS, allreduce or fsdp) == one process with batch 2b, same samples."""
    x_train, _, y_train, _ = digits
    batch, steps = 8, 20
    n = 2 * batch * steps
    x, y = x_train[:n], y_train[:n]
    rdd = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2)   # contiguous halves
    config = TrainConfig(num_workers=2, policy=policy, epochs=2, batch_size=batch, optimizer="sgd",
                         learning_rate=0.1, momentum=0.0, shuffle=False, seed=3)
    result = train(rdd, DIGITS_MLP, config)
    assert result.summary["updates"] == 2 * steps

    torch.manual_seed(config.seed)
    reference = DIGITS_MLP()
    optimizer = torch.optim.SGD(reference.parameters(), lr=config.learning_rate)
    halves = [(torch.from_numpy(x[:n // 2]), torch.from_numpy(y[:n // 2])),
              (torch.from_numpy(x[n // 2:]), torch.from_numpy(y[n // 2:]))]
    for _ in range(config.epochs):
        for k in range(steps):
            xb = torch.cat([h[0][k * batch:(k + 1) * batch] for h in halves])
            yb = torch.cat([h[1][k * batch:(k + 1) * batch] for h in halves])
            optimizer.zero_grad()
            nn.functional.cross_entropy(reference(xb), yb).backward()
            optimizer.step()
    for name, value in reference.state_dict().items():
        assert torch.allclose(result.state_dict[name], value, atol=1e-5), name
    # and it really moved: the weights are far from the initial ones
    torch.manual_seed(config.seed)
    initial = DIGITS_MLP().state_dict()
    assert max((result.state_dict[k] - initial[k]).abs().max() for k in initial) > 1e-2


def test_sync_with_unequal_partitions_finishes(spark, digits):
    x_train, x_test, y_train, y_test = digits
    rows = list(zip(x_train, y_train.tolist()))
    # 300 rows and the rest; the small shard wraps around so both take the same steps.
    # (A union cannot run in a barrier stage as is: train() must cut the lineage itself.)
    lopsided = spark.sparkContext.parallelize(rows[:300], 1).union(spark.sparkContext.parallelize(rows[300:], 1))
    assert lopsided.glom().map(len).collect() == [300, len(rows) - 300]
    result = train(lopsided, DIGITS_MLP, BASE.replace(policy="sync", epochs=3, timeout_s=60))
    steps = {w["worker"]: w["steps_per_epoch"] for w in result.workers}
    assert steps[0] == steps[1] == -(-(len(rows) - 300) // BASE.batch_size)
    assert result.summary["updates"] == steps[0] * 3
    assert result.accuracy(DIGITS_MLP, x_test, y_test) > 0.8


def test_async_really_learns_with_many_updates(digits_rdd, digits):
    """The async workers zero their gradients between pushes: the loss falls, not explodes."""
    result = train(digits_rdd, DIGITS_MLP, BASE.replace(policy="async", epochs=3))
    losses = result.history["loss"].to_numpy()
    assert np.isfinite(losses).all()
    assert losses[-20:].mean() < 0.5 * losses[:20].mean()
    assert result.summary["staleness_mean"] > 0    # two workers really interleave


def test_max_staleness_bound_drops_gradients(digits_rdd):
    result = train(digits_rdd, DIGITS_MLP, BASE.replace(policy="async", max_staleness=0, epochs=2))
    summary = result.summary
    assert summary["dropped_stale"] > 0
    assert summary["applied_gradients"] + summary["dropped_stale"] + summary["pushes_past_end"] == summary["pushes"]
    assert summary["staleness_max"] >= 1
    applied = result.gradients[result.gradients["accepted"]]
    assert applied["staleness"].max() == 0


class SteadyDigits(nn.Module):
    """The digits MLP, whose forward takes at least 20 ms: a unit's pass lasts long next to the gaps between two
    tasks of a slot, so two slots' passes overlap whatever the machine's load."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DIGITS_MLP()

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


@pytest.mark.parametrize("max_workers", [1, 2])
def test_work_units_train_each_unit_once_per_epoch_with_at_most_max_workers_at_once(digits_rdd, digits, max_workers):
    """max_workers: the input in 4 x max_workers work units, one task per unit and epoch, on local[2]'s two slots.
    With max_workers=1 the second slot's task waits at its hello until the first one's pass ends."""
    _, x_test, _, y_test = digits
    config = BASE.replace(policy="async", elastic=True, num_workers=1, max_workers=max_workers, epochs=4)
    result = train(digits_rdd, SteadyDigits, config)
    summary, units = result.summary, 4 * max_workers
    assert summary["work_units"] == units and summary["attempts"] == 1
    assert sorted((w["unit_epoch"], w["unit"]) for w in result.workers) == [(e, u) for e in range(4) for u in range(units)]
    rows = {w["unit"]: w["partition_rows"] for w in result.workers if w["unit_epoch"] == 0}
    assert all(w["samples"] == w["partition_rows"] == rows[w["unit"]] for w in result.workers)
    assert summary["samples_consumed"] == summary["sample_budget"] == 4 * sum(rows.values()) == 4 * digits_rdd.count()
    # 16 tasks or more over two slots: both slots train at once unless max_workers=1 holds one back
    assert summary["peak_workers"] == max_workers
    # every epoch trained every row once
    assert list(result.epochs["samples"]) == [sum(rows.values())] * 4
    assert result.accuracy(SteadyDigits, x_test, y_test) >= ASYNC_ACCURACY


def test_each_work_unit_of_an_rdd_mixes_rows_of_every_input_partition(spark):
    """Numbered i x partitions + partition, the rows are hashed into the units, so no unit is made of whole
    input partitions (rows grouped by label or time upstream stay grouped otherwise)."""
    from sparkdl._internal.modes.parameter_server.work_units import unit_rdd

    config = TrainConfig(policy="async", elastic=True, max_workers=2, epochs=2)
    units = unit_rdd(spark.sparkContext.parallelize(range(800), 2), config).glom().collect()
    assert len(units) == 2 * 8 and units[:8] == units[8:]                 # the same units in each epoch
    assert sorted(row for unit in units[:8] for row in unit) == list(range(800))
    assert all(min(unit) < 400 <= max(unit) for unit in units[:8]), [len(unit) for unit in units[:8]]


def test_an_elastic_run_refuses_speculative_execution_and_sparkdl_run_refuses_elastic(spark, digits_rdd):
    conf = spark.sparkContext._conf     # what the preflight reads: the application's settings
    conf.set("spark.speculation", "true")
    try:
        with pytest.raises(ClusterConfigError, match="elastic run cannot use speculative execution"):
            train(digits_rdd, DIGITS_MLP, BASE.replace(policy="async", elastic=True))
    finally:
        conf.set("spark.speculation", "false")
    with pytest.raises(ValueError, match="elastic cannot be used with sparkdl.run"):
        sparkdl.run(lambda: 1, config=TrainConfig(elastic=True, policy="async"), spark=spark)


def test_too_few_slots_is_refused_before_launch(digits_rdd):
    with pytest.raises(ClusterConfigError, match=r"num_workers=3 needs 3 free task slots .* has 2"):
        train(digits_rdd, DIGITS_MLP, BASE.replace(num_workers=3))


def test_bad_rows_surface_as_worker_error_with_traceback(spark):
    rows = [(np.ones(4, dtype=np.float32), 0)] * 10 + [(np.ones(5, dtype=np.float32), 1)]
    rdd = spark.sparkContext.parallelize(rows, 2)
    with pytest.raises(WorkerError) as info:
        train(rdd, functools.partial(mlp, 4, (8,), 2), BASE.replace(epochs=1, max_attempts=1))
    assert "same shape" in str(info.value)
    assert "rows_to_arrays" in info.value.worker_traceback
    assert info.value.worker_id == 1


def test_nan_features_surface_as_worker_error_naming_the_row(spark):
    # a NaN row would otherwise train "successfully" on gradients the PS skips
    rows = [(np.ones(4, dtype=np.float32), 0)] * 10 + [(np.array([1, np.nan, 1, 1], dtype=np.float32), 1)]
    rdd = spark.sparkContext.parallelize(rows, 2)
    with pytest.raises(WorkerError, match=r"row 5 of the partition has NaN or infinite feature values") as info:
        train(rdd, functools.partial(mlp, 4, (8,), 2), BASE.replace(epochs=1, max_attempts=1))
    assert info.value.worker_id == 1


def exploding_model() -> type[nn.Module]:
    """A model class whose forward pass raises (defined in a function: shipped by value)."""
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 10)

        def forward(self, x):
            raise RuntimeError("exploding forward pass")

    return Exploding


def test_exception_in_the_model_surfaces_with_worker_traceback(digits_rdd):
    with pytest.raises(WorkerError, match="exploding forward pass") as info:
        train(digits_rdd, exploding_model(), BASE.replace(epochs=1, timeout_s=30, max_attempts=1))
    assert "in forward" in info.value.worker_traceback


def test_interpreter_without_sparkdl_is_refused():
    with pytest.raises(ClusterConfigError, match="PYSPARK_PYTHON"):
        check_executor_python("local[2]", "/usr/bin/python3")


@pytest.mark.parametrize("settings", [{}, {"elastic": True, "num_workers": 1, "max_workers": 2}],
                         ids=["workers", "work-units"])
def test_batchnorm_statistics_are_averaged_into_the_result(digits_rdd, digits, settings):
    def model_fn():
        return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    _, x_test, _, y_test = digits
    result = train(digits_rdd, model_fn, BASE.replace(policy="async", epochs=5, **settings))
    running_mean = result.state_dict["1.running_mean"]
    assert running_mean.abs().sum() > 0         # not the initial zeros
    if not settings:
        assert result.accuracy(model_fn, x_test, y_test) >= ASYNC_ACCURACY
        return
    # a unit's task goes on from the statistics its Python worker's previous unit ended with: every task but the
    # first of each Python worker (Spark reuses them by default; with reuse off, each task has its own and none
    # carries). Begun from the initial ones, 12 mini-batches would leave them near those. Measured: 0.903-0.964
    # carried (10 runs), 0.830-0.897 not (3 runs): the accuracy bound is below both
    processes = {w["python_worker"] for w in result.workers}
    assert sum(w["buffers_carried"] for w in result.workers) == len(result.workers) - len(processes)
    # the pooled count is the sum of the last epoch's tasks': one pass's mini-batches each when begun from the
    # initial statistics, more when one went on from earlier passes (936 against 91 in one run)
    last_epoch = [w for w in result.workers if w["unit_epoch"] == 4]
    if any(w["buffers_carried"] for w in last_epoch):
        assert result.state_dict["1.num_batches_tracked"] > sum(w["steps_per_epoch"] for w in last_epoch)
    assert result.accuracy(model_fn, x_test, y_test) >= 0.80


def test_a_hung_worker_cannot_hang_the_driver(digits_rdd):
    """One replica blocks forever: its silence is detected within timeout_s and train() fails."""
    class Hanging(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = DIGITS_MLP()

        def forward(self, x):
            from pyspark import TaskContext

            context = TaskContext.get()
            if self.training and context is not None and context.partitionId() == 1:
                time.sleep(3600)
            return self.net(x)

    started = time.monotonic()
    with pytest.raises(SparkDLError) as info:
        train(digits_rdd, Hanging, BASE.replace(policy="sync", timeout_s=3, max_attempts=1))
    assert time.monotonic() - started < 60
    assert "abandoned" in str(info.value) or "sent nothing" in str(info.value) or "waited" in str(info.value)


def test_a_failing_stage_is_retried_then_reported(digits_rdd):
    with pytest.raises(WorkerError, match=r"exploding forward pass \(failed in all 2 stage attempts\)") as info:
        train(digits_rdd, exploding_model(), BASE.replace(epochs=1, max_attempts=2))
    assert "in forward" in info.value.worker_traceback


@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "topk"])
@pytest.mark.parametrize("policy", ["sync", "async", "softsync"])
def test_every_policy_and_codec_learns_digits(digits_rdd, digits, policy, compression):
    _, x_test, _, y_test = digits
    # top-k sends 5 % of each gradient (the rest waits in the error-feedback residual): it gets more epochs,
    # so that an unlucky async interleaving does not decide the threshold (10 epochs: 0.89-0.97 over runs)
    config = BASE.replace(policy=policy, compression=compression, topk_ratio=0.05,
                          softsync_size=2 if policy == "softsync" else 1, epochs=15 if compression == "topk" else 10)
    result = train(digits_rdd, DIGITS_MLP, config)
    # async's result follows how the two workers' pushes interleave: async with none, fp16 and int8 scored
    # 0.953-0.978 in 9 fits here, but int8 0.889 in one loaded CI run (2026-12-04); a broken codec scores
    # about chance (0.1), so its bound keeps a margin below every figure seen
    assert result.accuracy(DIGITS_MLP, x_test, y_test) >= (0.85 if policy == "async" else ASYNC_ACCURACY), (
        result.summary)
    per_push = result.summary["bytes_pushed"] / result.summary["pushes"]
    params = sum(v.numel() for v in result.state_dict.values())
    tensors = len(result.state_dict)   # the MLP has no buffers: one scale per parameter tensor
    expected = {"none": 4 * params, "fp16": 2 * params, "int8": params + 4 * tensors, "topk": 8 * -(-params * 5 // 100)}
    assert per_push == pytest.approx(expected[compression] + protocol.HEADER.size, abs=1)   # + the header


def test_local_sgd_with_one_worker_equals_plain_sgd(spark, digits):
    """local_update='sgd', s = 4: the worker's own 4 SGD steps, pushed as a delta, are plain SGD."""
    x_train, _, y_train, _ = digits
    batch, steps = 16, 24
    x, y = x_train[:batch * steps], y_train[:batch * steps]
    config = TrainConfig(num_workers=1, epochs=2, batch_size=batch, policy="sync", local_steps=4, local_update="sgd",
                         learning_rate=0.1, momentum=0.9, shuffle=False, seed=3)
    result = train(spark.sparkContext.parallelize(list(zip(x, y.tolist())), 1), DIGITS_MLP, config)
    torch.manual_seed(config.seed)
    model = DIGITS_MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(config.epochs):
        for k in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[k * batch:(k + 1) * batch]), ys[k * batch:(k + 1) * batch]).backward()
            optimizer.step()
    for name, value in model.state_dict().items():
        assert torch.allclose(result.state_dict[name], value, atol=1e-6), name
    assert result.summary["updates"] == config.epochs * steps // 4      # one push per 4 local steps


def test_nonfinite_gradients_are_caught_before_a_lossy_codec(digits_rdd):
    """A NaN gradient through int8 used to decode to zeros and pass; it is refused and counted instead."""
    class NaNOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = DIGITS_MLP()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            out = self.net(x)
            return out * float("nan") if self.calls == 5 else out

    result = train(digits_rdd, NaNOnce, BASE.replace(policy="async", compression="int8", epochs=2))
    assert result.summary["rejected_nonfinite"] == 2                     # one per worker
    assert all(torch.isfinite(v).all() for v in result.state_dict.values())
    assert np.isfinite(result.history["loss"]).all()


@pytest.mark.parametrize("settings", [
    {"policy": "softsync_nodes", "softsync_size": 2},
    {"policy": "async", "ssp_bound": 1, "sample_budget": "per_worker"},
    {"policy": "sync", "backup_workers": 1},
    # plain local steps, as local SGD is defined (Stich 2019): with momentum 0.9 the async model deltas
    # made runs land anywhere between 0.76 and 0.97 (measured over TCP and shared memory alike)
    {"policy": "async", "local_update": "sgd", "local_steps": 4, "momentum": 0.0},
], ids=["softsync-nodes", "ssp", "backup-workers", "local-sgd"])
def test_the_policy_variants_learn_digits(digits_rdd, digits, settings):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, DIGITS_MLP, BASE.replace(**settings))
    # each variant's result depends on which worker's gradient arrives first
    assert result.accuracy(DIGITS_MLP, x_test, y_test) >= ASYNC_ACCURACY, (settings, result.summary)
    summary = result.summary
    accounted = (summary["applied_gradients"] + summary["dropped_stale"] + summary["dropped_late"]
                 + summary["pushes_past_end"])
    assert accounted == summary["pushes"], summary
    if "ssp_bound" in settings:
        # nothing dropped; while one worker computes, the other (from 1 behind to 1 ahead, its last push applied
        # before it waits) applies at most 2 * bound + 1 = 3 updates
        assert summary["dropped_stale"] == 0 and summary["staleness_max"] <= 3
    if "backup_workers" in settings:
        # N - b = 1: a round takes the first gradient, and the other is late (dropped) or opens the next round; plain
        # sync would apply two gradients per update
        assert summary["applied_gradients"] == summary["updates"] > 0


class Straggler(nn.Module):
    """The digits MLP, whose forward on worker 1 (partition 1) sleeps 20 ms: a straggler next to a fast worker."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DIGITS_MLP()
        from pyspark import TaskContext

        context = TaskContext.get()
        self.slow = context is not None and context.partitionId() == 1

    def forward(self, x):
        if self.slow:
            time.sleep(0.02)
        return self.net(x)


def test_ssp_holds_the_fast_worker_within_its_bound_of_a_straggler(digits_rdd):
    """Without a bound the fast worker pushes many times per straggler step, so the straggler's gradients grow
    stale; ssp_bound=1 makes the fast one wait: its staleness stays within 2 x bound + 1 = 3."""
    config = BASE.replace(policy="async", epochs=1, sample_budget="per_worker")
    unbounded = train(digits_rdd, Straggler, config)
    bounded = train(digits_rdd, Straggler, config.replace(ssp_bound=1))
    assert unbounded.summary["staleness_max"] > 3, unbounded.summary["staleness_max"]
    assert bounded.summary["staleness_max"] <= 3 and bounded.summary["dropped_stale"] == 0


def test_workers_on_the_driver_host_use_shared_memory_and_train_the_same(digits_rdd):
    """local[2]: the PS and the workers share a host, so gradients and weights skip the socket."""
    config = TrainConfig(num_workers=2, policy="sync", epochs=2, batch_size=32, learning_rate=0.1, momentum=0.9)
    shared = train(digits_rdd, DIGITS_MLP, config)
    tcp = train(digits_rdd, DIGITS_MLP, config.replace(ps_transport="tcp"))
    assert [w["transport"] for w in shared.workers] == ["shared_memory", "shared_memory"]
    assert [w["transport"] for w in tcp.workers] == ["tcp", "tcp"]
    assert shared.summary["updates"] == tcp.summary["updates"] > 0
    for a, b in zip(shared.state_dict.values(), tcp.state_dict.values()):
        assert torch.equal(a, b)


def test_overlapped_communication_keeps_sync_exact_and_async_one_update_staler(digits_rdd, digits):
    """Streaming the gradient during backward and the reply into the next forward changes nothing under
    sync; pipelined async gradients are staler."""
    _, x_test, _, y_test = digits
    config = TrainConfig(num_workers=2, policy="sync", epochs=2, batch_size=32, learning_rate=0.1, momentum=0.9,
                         overlap_communication=True, validation_fraction=0.1)
    # on the PS's host sync exchanges through shared memory, where there is nothing to stream
    plain = train(digits_rdd, DIGITS_MLP, config)
    assert [(w["transport"], w["overlapped"]) for w in plain.workers] == [("shared_memory", False)] * 2
    streamed = train(digits_rdd, DIGITS_MLP, config.replace(ps_transport="tcp"))     # as across hosts
    assert [(w["transport"], w["overlapped"]) for w in streamed.workers] == [("tcp", True)] * 2
    assert streamed.summary["updates"] == plain.summary["updates"]
    # validation after each epoch scores the same weights
    assert len(plain.validation) == config.epochs
    assert streamed.validation["val_loss"].tolist() == pytest.approx(plain.validation["val_loss"].tolist(), abs=1e-6)
    for a, b in zip(streamed.state_dict.values(), plain.state_dict.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # no momentum: pipelining adds staleness, and staleness acts as extra momentum (Mitliagkas et al. 2016)
    asynchronous = config.replace(policy="async", epochs=8, momentum=0.0, validation_fraction=0.0)
    pipelined = train(digits_rdd, DIGITS_MLP, asynchronous)
    baseline = train(digits_rdd, DIGITS_MLP, asynchronous.replace(overlap_communication=False))
    # on the PS's host, pipelined exchanges go through double-buffered shared memory
    assert [(w["transport"], w["overlapped"]) for w in pipelined.workers] == [("shared_memory", True)] * 2
    # every pipelined gradient misses at least its own previous update
    assert pipelined.gradients["staleness"].iloc[4:].min() >= 1
    assert pipelined.summary["staleness_mean"] >= baseline.summary["staleness_mean"] + 0.9
    assert pipelined.accuracy(DIGITS_MLP, x_test, y_test) >= 0.85


def test_overlapped_communication_refuses_what_it_cannot_stream(digits_rdd):
    config = TrainConfig(num_workers=2, epochs=1, overlap_communication=True, compression="int8")
    with pytest.raises(ValueError, match="overlap_communication cannot be used here: a streamed gradient is sent "
                                         "uncompressed"):
        train(digits_rdd, DIGITS_MLP, config)


def test_bf16_mixed_precision_learns_digits_about_as_well_as_float32(digits_rdd, digits):
    _, x_test, _, y_test = digits
    config = BASE.replace(policy="sync")
    full = train(digits_rdd, DIGITS_MLP, config)
    mixed = train(digits_rdd, DIGITS_MLP, config.replace(precision="bf16-mixed"))
    assert not torch.equal(mixed.state_dict["0.weight"], full.state_dict["0.weight"])   # autocast was on
    full_accuracy = full.accuracy(DIGITS_MLP, x_test, y_test)
    mixed_accuracy = mixed.accuracy(DIGITS_MLP, x_test, y_test)
    # measured 0.969 for both (sync, 10 epochs; adamw with clipping: 0.964 float32, 0.961 bf16-mixed)
    assert mixed_accuracy >= 0.93 and mixed_accuracy >= full_accuracy - 0.03, (mixed_accuracy, full_accuracy)
    assert mixed.summary["amp_skipped_steps"] == 0
    assert all(value.dtype == torch.float32 for value in mixed.state_dict.values() if value.is_floating_point())


def test_allreduce_clips_the_averaged_gradient_before_every_step(digits_rdd):
    """SGD without momentum: each step moves the weights by lr x clip at most, so the run by updates x that."""
    lr, clip = 0.05, 1e-3
    config = TrainConfig(num_workers=2, epochs=1, batch_size=16, policy="allreduce", learning_rate=lr,
                         grad_clip_norm=clip)
    result = train(digits_rdd, DIGITS_MLP, config)
    torch.manual_seed(config.seed)                  # the launcher's initial weights
    model = DIGITS_MLP()
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    model.load_state_dict(result.state_dict)
    moved = float((torch.cat([p.detach().flatten() for p in model.parameters()]) - initial).norm())
    assert 0 < moved <= result.summary["updates"] * lr * clip + 1e-5, (moved, result.summary["updates"])


def test_the_driver_heap_that_bounds_allreduce_results_is_read_from_the_running_jvm(spark):
    # the suite's session starts its driver with spark.driver.memory=2g
    assert 1.5 * 2**30 < backend_for(spark).driver_heap_bytes() <= 2 * 2**30


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tasks must train on the CPU")
def test_16_mixed_on_a_cpu_task_is_refused_naming_the_setting(digits_rdd):
    with pytest.raises(ClusterConfigError, match="precision='16-mixed' needs a CUDA device") as refused:
        train(digits_rdd, DIGITS_MLP, BASE.replace(epochs=1, precision="16-mixed"))
    assert "bf16-mixed" in str(refused.value)
