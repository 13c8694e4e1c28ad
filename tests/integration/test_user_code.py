"""The user's own training code on real Spark (local[2]): TorchDistributor, sparkdl.run, PS optimizers."""
from __future__ import annotations

import inspect
import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sparkdl
from sparkdl import ClusterConfigError, TrainConfig, WorkerError, train

from ..conftest import ASYNC_ACCURACY, DIGITS_MLP

SYNC = TrainConfig(num_workers=2, epochs=3, batch_size=16, optimizer="sgd", learning_rate=0.05, momentum=0.9,
                   policy="sync", shuffle=True, seed=3)


def ddp_sum(scale: float) -> dict:
    """A torchrun-style function: the process group forms from the environment alone."""
    import torch.distributed as dist

    dist.init_process_group()
    try:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": value.item() * scale,
                "local_rank": int(os.environ["LOCAL_RANK"]), "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
    finally:
        dist.destroy_process_group()


def tutorial_order_sessions(sessions: int, store_dir: str) -> int:
    """DDP as tutorials write it, several times in one task: ``destroy_process_group()`` while the DDP model
    is alive, freed at the return right after its last backward; the last session leaves its group.
    (Each session rendezvouses through a file of its own: one port reused at once can join two sessions.)"""
    import torch.distributed as dist
    from torch import nn

    def session(number: int, destroy: bool) -> None:
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/session-{number}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
        for _ in range(3):
            F.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
        if destroy:
            dist.destroy_process_group()

    for number in range(sessions):
        session(number, destroy=number < sessions - 1)
    return sessions


def test_ddp_torn_down_in_the_tutorials_order_returns_and_the_next_run_can_form_its_group(spark, tmp_path):
    """In that order gloo's destructor can deadlock on the GIL in a Python worker that lives on (runs of 8 such
    sessions did, every time tried on this machine, without the guard); a group left alive would refuse the
    next run's init ("trying to initialize the default process group twice")."""
    sc, config, results = spark.sparkContext, TrainConfig(num_workers=2, timeout_s=60), []

    def two_runs() -> None:
        sc.setJobGroup("tutorial-order", "DDP in the tutorials' order")
        for run in range(2):   # the second run reuses the Python workers of the first, which left its group
            (tmp_path / str(run)).mkdir()
            results.append(list(sparkdl.run(tutorial_order_sessions, args=(8, str(tmp_path / str(run))),
                                            num_workers=2, config=config)))

    runs = threading.Thread(target=two_runs, daemon=True)
    runs.start()
    runs.join(timeout=300)            # a deadlocked worker holds the GIL: no timeout inside it can fire
    if runs.is_alive():
        sc.cancelJobGroup("tutorial-order")
        runs.join(timeout=60)
        pytest.fail("a rank's Python worker deadlocked when its DDP session returned")
    assert results == [[8, 8], [8, 8]]


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc, against the uptime)."""
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
        return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


def test_a_run_without_data_leaves_its_python_workers_to_the_next_run(spark):
    """PySpark reuses a Python worker only when its task read its input to the end: a function run reads
    none, and each run after it would fork fresh workers that import torch again (5 s a run here, not 1.3)."""
    sparkdl.run(process_age_s, num_workers=2)
    started = time.monotonic()
    ages = sparkdl.run(process_age_s, num_workers=2)
    assert min(ages) > time.monotonic() - started, ages    # every rank ran in a worker older than its run


def test_torch_distributor_is_a_drop_in_and_run_returns_every_rank(spark):
    from pyspark.ml.torch.distributor import TorchDistributor as SparksDistributor

    # the constructor and run() take what Spark's take, by the same names and defaults
    for name in ("__init__", "run"):
        ours = inspect.signature(getattr(sparkdl.TorchDistributor, name)).parameters
        theirs = inspect.signature(getattr(SparksDistributor, name)).parameters
        assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()], name

    first = sparkdl.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_sum, 10.0)
    assert first == {"rank": 0, "world": 2, "sum": 30.0, "local_rank": 0, "local_world": 2}
    every = sparkdl.run(ddp_sum, args=(1.0,), num_workers=2)
    assert [v["rank"] for v in every] == [0, 1]
    assert all(v["sum"] == 3.0 and v["world"] == 2 for v in every)
    assert sorted(v["local_rank"] for v in every) == [0, 1]


def test_a_script_runs_on_every_rank_with_the_environment_and_its_failure_names_the_rank(spark, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, sys\n"
                      "rank = os.environ['RANK']\n"
                      "open(os.path.join(sys.argv[1], 'rank-' + rank), 'w').write(os.environ['WORLD_SIZE'])\n"
                      "if len(sys.argv) > 2 and rank == '1':\n"
                      "    raise SystemExit('rank one refuses: ' + sys.argv[2])\n")
    assert sparkdl.TorchDistributor(num_processes=2, use_gpu=False).run(str(script), str(tmp_path)) is None
    assert sorted(p.name for p in tmp_path.glob("rank-*")) == ["rank-0", "rank-1"]
    assert (tmp_path / "rank-1").read_text() == "2"
    with pytest.raises(WorkerError, match="rank 1.*exited with status 1") as info:
        sparkdl.run(str(script), args=(str(tmp_path), "bad input"), num_workers=2,
                    config=TrainConfig(max_attempts=1))
    assert "rank one refuses: bad input" in info.value.worker_traceback


def failing(message: str) -> None:
    if sparkdl.context().rank == 1:
        raise ValueError(message)


def test_a_failing_function_surfaces_the_ranks_traceback(spark):
    with pytest.raises(WorkerError, match="training worker 1 failed: ValueError: the batch was bad") as info:
        sparkdl.run(failing, args=("the batch was bad",), num_workers=2, config=TrainConfig(max_attempts=1))
    assert "in failing" in info.value.worker_traceback


def test_gpus_are_refused_before_launch_when_spark_assigns_none(spark):
    with pytest.raises(ClusterConfigError, match="spark.task.resource.gpu.amount"):
        sparkdl.TorchDistributor(num_processes=2).run(ddp_sum, 1.0)   # Spark's default: use_gpu=True


def test_context_outside_a_function_run_says_where_it_works():
    with pytest.raises(RuntimeError, match="only available inside a function launched by sparkdl.run"):
        sparkdl.context()


def sync_loop(epochs: int) -> int:
    """The estimator's loop, written by hand: forward, loss, backward, a PS optimizer's step."""
    ctx = sparkdl.context()
    torch.manual_seed(ctx.config.seed)   # the driver's template is built under this seed
    model = DIGITS_MLP()
    optimizer = ctx.ps_optimizer(model)
    for epoch in range(epochs):
        for batch in ctx.batches(epoch):
            loss = F.cross_entropy(model(*batch.inputs), batch.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step(loss=loss.item())
        ctx.report(epoch=epoch, loss=loss.item())
    return optimizer.version


def test_a_hand_written_loop_with_the_ps_optimizer_equals_the_estimators_sync_run(digits_rdd):
    """Same data order, same initial weights, same policy: the same weights, update for update."""
    reference = train(digits_rdd, DIGITS_MLP, SYNC)
    result = sparkdl.run(sync_loop, args=(SYNC.epochs,), config=SYNC, data=digits_rdd)
    assert list(result) == [reference.summary["updates"]] * 2
    mine = result.load_weights(DIGITS_MLP())
    for name, value in mine.state_dict().items():
        assert torch.allclose(value, reference.state_dict[name], atol=1e-5), name
    assert result.spaces[0].summary["updates"] == reference.summary["updates"]
    assert result.spaces[0].summary["staleness_max"] == 0
    # every rank reported each epoch; the losses fall
    metrics = result.metrics
    assert sorted(metrics["rank"].tolist()) == [0] * SYNC.epochs + [1] * SYNC.epochs
    assert metrics.sort_values("seconds").groupby("rank")["loss"].last().max() < metrics["loss"].max()


def fully_sharded_loop(epochs: int) -> dict:
    """A hand-written loop over a model built on the meta device and sharded by the context: each rank holds half
    of it; rank 0 returns the gathered final weights."""
    import torch.distributed as dist

    ctx = sparkdl.context()
    with torch.device("meta"):
        model = DIGITS_MLP()
    model = ctx.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=ctx.config.learning_rate, momentum=ctx.config.momentum)
    for epoch in range(epochs):
        for batch in ctx.batches(epoch):
            optimizer.zero_grad()
            F.cross_entropy(model(*batch.inputs), batch.labels).backward()
            optimizer.step()
    held = sum(p.to_local().numel() for p in model.parameters())
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"held": held, "state": state if ctx.rank == 0 else None}


def test_a_hand_written_loop_over_a_model_the_context_shards_equals_the_estimators_fsdp_run(digits_rdd):
    """Built on the meta device and initialised shard by shard, then the same steps: the same weights."""
    config = SYNC.replace(policy="fsdp")
    reference = train(digits_rdd, DIGITS_MLP, config)
    ranks = list(sparkdl.run(fully_sharded_loop, args=(config.epochs,), config=config, data=digits_rdd))
    total = sum(p.numel() for p in DIGITS_MLP().parameters())
    assert sum(r["held"] for r in ranks) == total and max(r["held"] for r in ranks) < total
    for name, value in ranks[0]["state"].items():
        assert torch.allclose(value, reference.state_dict[name], atol=1e-5), name


def two_models(steps: int) -> dict:
    """A GAN's shape: two PS optimizers, stepped at different rates, each its own key space."""
    ctx = sparkdl.context()
    torch.manual_seed(0)
    often, rarely = torch.nn.Linear(4, 1), torch.nn.Linear(3, 2)
    first, second = ctx.ps_optimizer(often), ctx.ps_optimizer(rarely.parameters())
    for step in range(steps):
        often(torch.ones(2, 4)).sum().backward()
        first.step(samples=2)
        if step % 2:
            rarely(torch.ones(2, 3)).sum().backward()
            second.step(samples=2)
    return {"first": first.version, "second": second.version, "attempt": ctx.attempt}


def test_several_ps_optimizers_have_their_own_key_spaces_versions_and_rounds(spark):
    result = sparkdl.run(two_models, args=(6,), num_workers=2, config=TrainConfig(policy="sync", learning_rate=0.1, momentum=0.0))
    assert [s.summary["parameters"] for s in result.spaces] == [5, 8]
    # under sync one update per round of the two ranks: 6 rounds of the first, 3 of the second
    assert result[0] == result[1] == {"first": 6, "second": 3, "attempt": 0}
    # SGD on a constant gradient: each update moves the bias by lr x the mean gradient (2 rows of 1)
    torch.manual_seed(0)
    often, rarely = torch.nn.Linear(4, 1), torch.nn.Linear(3, 2)
    assert torch.allclose(result.spaces[0].weights[-1], often.bias.detach()[0] - 6 * 0.1 * 2, atol=1e-5)
    assert torch.allclose(result.spaces[1].weights[-2:], rarely.bias.detach() - 3 * 0.1 * 2, atol=1e-5)


def fails_once(steps: int) -> dict:
    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = ctx.ps_optimizer(model)
    start = optimizer.version
    for step in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step(samples=2)
        if ctx.attempt == 0 and ctx.rank == 1 and step == 2:
            raise RuntimeError("executor lost")
    return {"attempt": ctx.attempt, "started_at": start, "version": optimizer.version}


def test_a_retried_function_continues_from_its_ps_optimizers_state(spark):
    result = sparkdl.run(fails_once, args=(5,), num_workers=2,
                         config=TrainConfig(policy="async", learning_rate=0.1, max_attempts=2))
    assert len(result.attempts) == 2 and result.attempts[0]["error"]
    assert all(v["attempt"] == 1 for v in result)
    # the retry starts from the PS's weights and version, not from rank 0's initial model
    assert result[0]["started_at"] >= 3 and result[1]["started_at"] >= 3
    assert result.spaces[0].version == result.spaces[0].summary["updates"] >= 3 + 2 * 5


def async_digits(epochs: int) -> float:
    ctx = sparkdl.context()
    model = DIGITS_MLP()
    optimizer = ctx.ps_optimizer(model)
    for epoch in range(epochs):
        for batch in ctx.batches(epoch):
            F.cross_entropy(model(*batch.inputs), batch.labels).backward()
            optimizer.step()
    return float(optimizer.accepted)


def test_async_custom_loop_learns_digits_from_a_dataframe(spark, digits):
    x_train, x_test, y_train, y_test = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train, y_train)],
                                  "pixels array<float>, label long")
    config = SYNC.replace(policy="async", epochs=10)
    result = sparkdl.run(async_digits, args=(config.epochs,), config=config, data=frame)
    model = result.load_weights(DIGITS_MLP())
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    # measured 0.94-0.96 here; chance is 0.1
    assert accuracy >= ASYNC_ACCURACY, accuracy
    assert sum(result) == result.spaces[0].summary["applied_gradients"] > 0
    assert all(w["ps_optimizers"][0]["transport"] == "shared_memory" for w in result.workers), result.workers


# ----------------------------------------------------------------- the estimator's trainStep and callbacks
def step_with_metrics(model, inputs, label, weight):
    """The default step by hand, with a metric whose epoch mean is known: the rows of a (full) batch."""
    loss = F.cross_entropy(model(*inputs), label)
    return {"loss": loss, "rows": torch.tensor(float(len(label))), "half": 0.5}


@pytest.mark.parametrize("policy", ["sync", "allreduce"])
def test_a_train_steps_metrics_are_averaged_per_epoch_on_the_driver(digits_rdd, policy):
    config = SYNC.replace(policy=policy, train_step=step_with_metrics)
    result = train(digits_rdd, DIGITS_MLP, config)
    epochs = result.epochs
    # every batch is full under sync and allreduce (small partitions wrap): the row-weighted mean is the batch size
    assert epochs["epoch"].tolist() == list(range(SYNC.epochs))
    assert epochs["rows"].tolist() == [float(SYNC.batch_size)] * SYNC.epochs
    assert epochs["half"].tolist() == [0.5] * SYNC.epochs
    reported = result.summary["epoch_metrics"]
    assert [row["epoch"] for row in reported] == list(range(SYNC.epochs))
    # the workers' epoch loss is the mean of the same batches' losses the updates carry
    assert np.allclose([row["loss"] for row in reported], epochs["loss"], rtol=1e-4)


def frozen_step(model, inputs, label, weight):
    """A step whose loss has no slope: nothing may move."""
    return F.cross_entropy(model(*inputs), label) * 0.0


class Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[int, dict]] = []
        self.stop_after = stop_after

    def on_epoch_end(self, epoch: int, metrics: dict) -> bool:
        self.calls.append((epoch, metrics))
        return self.stop_after is not None and epoch >= self.stop_after


def test_the_estimators_train_step_is_what_trains_and_callbacks_see_every_epoch(spark, digits):
    from sparkdl import TorchEstimator

    x_train, _, y_train, _ = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train, y_train)],
                                  "features array<float>, label long")
    recorder = Recorder()
    estimator = TorchEstimator(model=DIGITS_MLP, trainStep=frozen_step, callbacks=[recorder], numWorkers=2,
                               epochs=2, batchSize=16, learningRate=0.05, momentum=0.9, updatePolicy="sync",
                               validationFraction=0.1)
    model = estimator.fit(frame)
    torch.manual_seed(estimator.train_config().seed)
    initial = DIGITS_MLP().state_dict()
    for name, value in model.state_dict.items():
        assert torch.equal(value, initial[name]), name        # the step's zero loss, not cross-entropy, trained
    assert [epoch for epoch, _ in recorder.calls] == [0, 1]
    assert all({"loss", "val_loss", "val_metric"} <= set(metrics) for _, metrics in recorder.calls)
    assert estimator.getTrainStep() is frozen_step


def test_a_callback_returning_true_stops_training_after_that_epoch(digits_rdd):
    recorder = Recorder(stop_after=1)
    result = train(digits_rdd, DIGITS_MLP, SYNC.replace(epochs=5, callbacks=(recorder,)))
    steps = result.workers[0]["steps_per_epoch"]
    assert [epoch for epoch, _ in recorder.calls] == [0, 1]
    # sync: the two epochs' rounds, and at most the one round a worker already pushed into its third epoch
    # before the other's report completed the second (the stopped worker's done flushes it)
    assert 2 * steps <= result.summary["updates"] <= 2 * steps + 1
    assert any(e["event"] == "stopped_by_callback" for e in result.events)


def steps_of_one_model(steps: int) -> int:
    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = ctx.ps_optimizer(model)
    start = optimizer.version
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step(samples=2)
    return start


def test_ps_optimizers_checkpoint_per_key_space_and_a_new_run_resumes_from_them(spark, tmp_path):
    config = TrainConfig(num_workers=2, policy="sync", learning_rate=0.1, momentum=0.0,
                         checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    first = sparkdl.run(steps_of_one_model, args=(4,), config=config)
    assert first.spaces[0].summary["checkpoints_written"] >= 2
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["space-0"]
    resumed = sparkdl.run(steps_of_one_model, args=(3,), config=config.replace(
        checkpoint_dir=None, resume_from=str(tmp_path / "ck")))
    assert list(resumed) == [4, 4]                      # both ranks start where the first run ended
    assert resumed.spaces[0].version == 7
    # a constant gradient: the bias moved by lr x 2 per update, over 4 + 3 updates
    torch.manual_seed(0)
    bias = torch.nn.Linear(4, 1).bias.detach()[0]
    assert torch.allclose(resumed.spaces[0].weights[-1], bias - 7 * 0.1 * 2, atol=1e-5)
