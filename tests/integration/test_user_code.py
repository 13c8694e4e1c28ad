"""The user's own training code on real Spark (local[2]): TorchDistributor, sparkdl.run, PS optimizers."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

import sparkdl
from sparkdl import ClusterConfigError, TrainConfig, WorkerError, train

from ..conftest import DIGITS_MLP

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
    assert accuracy >= 0.88, accuracy
    assert sum(result) == result.spaces[0].summary["applied_gradients"] > 0
    assert all(w["ps_optimizers"][0]["transport"] == "shared_memory" for w in result.workers), result.workers
