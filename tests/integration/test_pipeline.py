"""Pipeline (model) parallelism through real Spark (local[2]): a model cut into two stage tasks.

Runs with more replicas than local[2]'s two slots hold (P = 2, D = 2) are in
tests/e2e/test_pipeline_cluster.py.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F
from torch import nn

from sparkdl import TorchEstimator, TrainConfig, WorkerError, train
from sparkdl.models import AsImages

from ..conftest import DIGITS_MLP, array_frame
from ..reference import largest_difference, single_process_sgd


def deep_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_single_process_sgd(spark, digits, schedule):
    x_train, _, y_train, _ = digits
    batch, steps = 16, 12
    x, y = x_train[:batch * steps], y_train[:batch * steps]
    rdd = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, micro_batches=4, pipeline_schedule=schedule,
                         policy="sync", epochs=2, batch_size=batch, learning_rate=0.1, shuffle=False, seed=5)
    result = train(rdd, deep_mlp, config)
    initial, expected = single_process_sgd(deep_mlp, [(x, y)], batch, steps, config.epochs, config.learning_rate,
                                           config.seed)
    assert largest_difference(result.state_dict, expected) < 1e-5
    assert largest_difference(result.state_dict, initial) > 1e-2   # it trained
    summary = result.summary
    assert summary["updates"] == steps * config.epochs and summary["pipeline_schedule"] == schedule
    assert summary["samples"] == batch * steps * config.epochs      # counted once per replica, not per stage
    # each task holds only its stage: 64*48+48 parameters on stage 0, the other two layers on stage 1
    stages = {w["pipeline_stage"]: w for w in result.workers}
    assert stages[0]["parameter_bytes"] == 4 * (64 * 48 + 48)
    assert stages[1]["parameter_bytes"] == 4 * (48 * 32 + 32 + 32 * 10 + 10)
    assert stages[0]["samples"] == batch * steps * config.epochs and stages[1]["samples"] == 0
    # stage 0 sends its 48 activations per sample forward; their gradients come back: 2 x 4 bytes each
    assert summary["activation_bytes_per_step"] == 2 * 4 * 48 * batch
    assert 0.0 <= summary["bubble"] <= 1.0 and summary["ideal_bubble"] == pytest.approx(1 / 5)


class Compute(nn.Module):
    """Simulated accelerator work: each micro-batch's forward takes ``seconds`` (no CPU), so the schedule's
    idle time, not the CPU's communication overhead, decides the bubble."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def timed_mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(Compute(0.08), nn.Linear(64, 32), nn.ReLU(), Compute(0.08), nn.Linear(32, 10))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_schedule_bounds_live_micro_batches_and_its_bubble_is_the_ideal(spark, digits, schedule):
    """P=2, m=4: GPipe holds all 4 micro-batches' activations on stage 0, 1F1B at most P=2 (the last
    stage 1); the idle fraction measured on 80 ms of compute per micro-batch is GPipe's (P-1)/(m+P-1), plus
    what the CPU's communication adds (0.05-0.10 measured here): never below it, and well under m=1's 0.5."""
    x_train, _, y_train, _ = digits
    batch, steps = 16, 4
    rdd = spark.sparkContext.parallelize(list(zip(x_train[:batch * steps], y_train[:batch * steps].tolist())), 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, pipeline_cuts="3", micro_batches=4,
                         pipeline_schedule=schedule, policy="sync", epochs=1, batch_size=batch, shuffle=False)
    result = train(rdd, timed_mlp, config)
    stages = {w["pipeline_stage"]: w for w in result.workers}
    if schedule == "gpipe":
        assert [stages[s]["peak_live_micro_batches"] for s in (0, 1)] == [4, 4]
    else:
        assert [stages[s]["peak_live_micro_batches"] for s in (0, 1)] == [2, 1]
    ideal = result.summary["ideal_bubble"]
    assert ideal == pytest.approx(1 / 5)
    assert ideal - 0.05 <= result.summary["bubble"] <= ideal + 0.2, result.summary["bubble"]


def bn_cnn() -> nn.Sequential:
    return nn.Sequential(AsImages(1, 8, 8), nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))


def test_dataframe_fit_transform_with_two_stages_and_batchnorm(spark, digits, tmp_path):
    x_train, x_test, y_train, y_test = digits

    estimator = TorchEstimator(model=bn_cnn, pipelineStages=2, microBatches=2, numWorkers=1, batchSize=16,
                               epochs=6, optimizer="sgd", learningRate=0.05, momentum=0.9)
    model = estimator.fit(array_frame(spark, x_train, y_train))
    scored = model.transform(array_frame(spark, x_test, y_test))
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
    assert accuracy >= 0.93
    assert model.summary["pipeline_stages"] == 2
    # the BatchNorm statistics trained on stage 0 came back through the PS into the whole model
    state = model.state_dict
    assert state["2.running_mean"].abs().sum() > 0 and (state["2.running_var"] - 1).abs().sum() > 0
    steps = -(-len(x_train) // 16) * 6
    assert int(state["2.num_batches_tracked"]) == steps * 2     # one BatchNorm step per micro-batch
    # saved and loaded like any TorchModel; it scores the whole model unsplit, identically
    from sparkdl import TorchModel

    model.write().overwrite().save(str(tmp_path / "model"))
    reloaded = TorchModel.load(str(tmp_path / "model"))
    test = array_frame(spark, x_test[:50], y_test[:50])
    assert ([r.prediction for r in model.transform(test).collect()]
            == [r.prediction for r in reloaded.transform(test).collect()])


def test_a_list_of_stage_factories_is_the_model(spark, digits):
    x_train, x_test, y_train, y_test = digits
    rdd = spark.sparkContext.parallelize(list(zip(x_train, y_train.tolist())), 1)
    stages = [lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU()), lambda: nn.Linear(64, 10)]
    config = TrainConfig(num_workers=1, pipeline_stages=2, micro_batches=2, policy="sync", epochs=8,
                         batch_size=16, learning_rate=0.05, momentum=0.9)
    result = train(rdd, lambda: stages, config)
    assert set(result.state_dict) == {"0.0.weight", "0.0.bias", "1.weight", "1.bias"}
    assert result.accuracy(lambda: stages, x_test, y_test) >= 0.93


@pytest.mark.parametrize("settings, message", [
    ({"policy": "async"}, "policy='sync'"),
    ({"compression": "int8"}, "compression='none'"),
    ({"batch_size": 30, "micro_batches": 4}, "multiple of micro_batches"),
    ({"micro_batches": 1, "pipeline_schedule": "1f1b"}, "micro_batches >= pipeline_stages"),
    ({"validation_fraction": 0.1}, "validation_fraction"),
])
def test_settings_a_pipeline_cannot_take_are_refused_before_launch(spark, settings, message):
    rdd = spark.sparkContext.parallelize([(np.zeros(64, np.float32), 0)] * 8, 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, batch_size=32, micro_batches=4).replace(**settings)
    with pytest.raises(ValueError, match=message):
        train(rdd, DIGITS_MLP, config)


def test_a_model_that_cannot_be_cut_is_refused(spark):
    rdd = spark.sparkContext.parallelize([(np.zeros(64, np.float32), 0)] * 8, 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, batch_size=8, micro_batches=2)
    with pytest.raises(ValueError, match="nn.Sequential"):
        train(rdd, lambda: nn.Bilinear(64, 64, 10), config)
    with pytest.raises(ValueError, match="pipeline_cuts"):
        train(rdd, DIGITS_MLP, config.replace(pipeline_cuts="7"))


class _FailingHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the last stage cannot score this batch")


@pytest.mark.parametrize("shards", [False, True], ids=["driver-ps", "executor-shards"])
def test_a_failing_stage_is_the_error_not_its_partner_losing_the_peer(spark, shards):
    """Stage 1 fails; stage 0 then fails too (its peer closed).  The user sees stage 1's cause."""
    rdd = spark.sparkContext.parallelize([(np.ones(8, np.float32), 0)] * 32, 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, batch_size=8, micro_batches=2, epochs=1, max_attempts=1,
                         timeout_s=30, **({"ps_hosts": "executors", "ps_shards": 2} if shards else {}))
    with pytest.raises(WorkerError, match="the last stage cannot score this batch"):
        train(rdd, lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), _FailingHead()), config)


def test_a_pipeline_resumes_from_a_mid_run_checkpoint_exactly(spark, digits, tmp_path):
    import shutil

    from sparkdl._internal.ps.server.checkpoint import checkpoint_path

    x_train, _, y_train, _ = digits
    rdd = spark.sparkContext.parallelize(list(zip(x_train[:320], y_train[:320].tolist())), 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, micro_batches=2, policy="sync", epochs=2, batch_size=16,
                         learning_rate=0.05, momentum=0.9, checkpoint_dir=str(tmp_path / "all"), checkpoint_every=8,
                         checkpoint_keep=100)
    full = train(rdd, deep_mlp, config)
    assert full.summary["updates"] == 40
    (tmp_path / "mid").mkdir()
    shutil.copy(checkpoint_path(tmp_path / "all", 24), checkpoint_path(tmp_path / "mid", 24))
    resumed = train(rdd, deep_mlp, config.replace(checkpoint_dir=None, resume_from=str(tmp_path / "mid")))
    assert resumed.summary["resumed_from_version"] == 24 and resumed.summary["version"] == 40
    assert resumed.summary["updates"] == 40 and resumed.summary["samples"] == 16 * 16   # 16 steps left
    for name, value in full.state_dict.items():    # the weights and the momentum carried over exactly
        assert torch.allclose(resumed.state_dict[name], value, atol=1e-6), name


def test_dataframe_rows_reach_only_the_first_stage_of_each_replica(spark, digits):
    from sparkdl._internal.modes.pipeline.launch import place_dataframe

    x_train, _, y_train, _ = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train, y_train)],
                                  "features array<float>, label long")
    for replicas, stages in ((2, 2), (3, 2), (2, 3)):
        placed = place_dataframe(frame, replicas, stages)
        counts = dict(placed.groupBy(F.spark_partition_id().alias("p")).count().collect())
        assert placed.rdd.getNumPartitions() == replicas * stages
        assert set(counts) == {d * stages for d in range(replicas)}      # only first stages hold rows
        assert sum(counts.values()) == len(x_train)
        assert max(counts.values()) - min(counts.values()) <= replicas   # dealt round-robin
