"""PS shards hosted by the barrier tasks (ps_hosts='executors'), on local[2]."""
from __future__ import annotations

import functools

import pytest
import torch

from sparkdl import TorchEstimator, TrainConfig, train
from sparkdl._internal.ps.server.checkpoint import load_latest_checkpoint
from sparkdl._internal.ps.shards.ranges import clip_tensor_sizes, shard_spans
from sparkdl._internal.ps.wire import protocol
from sparkdl.models import mlp

from ..conftest import ASYNC_ACCURACY, DIGITS_MLP, array_frame

# 64-256-10: 19k parameters, enough for two shards of real size
WIDE_MLP = functools.partial(mlp, 64, (256,), 10)
BASE = TrainConfig(num_workers=2, epochs=4, batch_size=16, learning_rate=0.05, momentum=0.9, seed=5, timeout_s=60)
SHARDED = {"ps_shards": 2, "ps_hosts": "executors"}


@pytest.fixture(scope="module")
def central(digits_rdd):
    """The reference: one PS in the driver, sync."""
    return train(digits_rdd, WIDE_MLP, BASE.replace(shard_snapshot_every=20))


@pytest.mark.parametrize("shards", [1, 2])
def test_sync_shards_on_executors_equal_the_driver_ps_and_spare_the_driver(digits_rdd, central, shards):
    sharded = train(digits_rdd, WIDE_MLP, BASE.replace(ps_shards=shards, ps_hosts="executors", shard_snapshot_every=20))
    for name, value in central.state_dict.items():
        assert torch.allclose(sharded.state_dict[name], value, atol=1e-5), name
    summary = sharded.summary
    assert summary["ps_hosts"] == "executors" and summary["ps_shards"] == shards
    assert summary["updates"] == central.summary["updates"] and summary["shard_versions"] == [summary["version"]] * shards
    assert sorted(w.get("ps_shard") for w in sharded.workers if "ps_shard" in w) == list(range(shards))
    # the history is the run's (shard 0 records every push), as a driver PS's is
    assert len(sharded.history) == len(central.history) == summary["updates"]
    assert sharded.history["loss"].iloc[-1] == pytest.approx(central.history["loss"].iloc[-1], abs=1e-5)
    # every pushed and pulled byte crosses a driver PS; with shards the driver gets snapshots and reports
    assert central.summary["driver_bytes"] >= central.summary["bytes_pushed"] + central.summary["bytes_pulled"]
    assert summary["bytes_pushed"] == pytest.approx(central.summary["bytes_pushed"], rel=0.01)
    assert summary["driver_bytes"] < 0.15 * central.summary["driver_bytes"], summary
    assert summary["shard_snapshots"] >= shards * (summary["updates"] // 20)


def test_adamw_shards_leave_the_same_1d_parameters_out_of_the_decay_as_the_driver_ps(digits_rdd):
    """The shards' ranges meet inside the first weight matrix: shard 1 holds decayed and excluded tensors."""
    config = BASE.replace(optimizer="adamw", learning_rate=0.01, weight_decay=0.5, epochs=2)
    central = train(digits_rdd, WIDE_MLP, config)
    sharded = train(digits_rdd, WIDE_MLP, config.replace(**SHARDED))
    for name, value in central.state_dict.items():
        assert torch.allclose(sharded.state_dict[name], value, atol=1e-5), name


def test_async_shards_learn_digits(digits_rdd, digits):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, WIDE_MLP, BASE.replace(policy="async", epochs=6, **SHARDED))
    assert result.accuracy(WIDE_MLP, x_test, y_test) >= ASYNC_ACCURACY, result.summary
    assert result.summary["applied_gradients"] == result.summary["updates"]


def test_shards_compress_their_ranges_and_pool_batchnorm_statistics(spark, digits):
    x_train, x_test, y_train, y_test = digits

    def bn_mlp():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 10))

    rdd = spark.sparkContext.parallelize(list(zip(x_train, y_train.tolist())), 2)
    result = train(rdd, bn_mlp, BASE.replace(compression="int8", **SHARDED))
    assert result.accuracy(bn_mlp, x_test, y_test) >= 0.9
    assert result.state_dict["1.num_batches_tracked"] > 0            # the workers' statistics came back
    sizes = [p.numel() for p in bn_mlp().parameters()]
    pieces = [clip_tensor_sizes(sizes, span) for span in shard_spans(sum(sizes), 2)]
    assert [len(p) for p in pieces] == [1, 6]          # the first weight matrix is cut by the shard boundary
    # int8 per range: one byte per value plus a scale per tensor piece, and a header per shard
    per_push = result.summary["bytes_pushed"] / result.summary["pushes"]
    assert per_push == pytest.approx(sum(sizes) + 4 * 7 + 2 * protocol.HEADER.size, abs=1)


def test_sharded_checkpoints_are_whole_model_checkpoints_and_resume_exactly(digits_rdd, tmp_path):
    import shutil

    from sparkdl._internal.ps.server.checkpoint import checkpoint_path

    config = BASE.replace(epochs=2, checkpoint_dir=str(tmp_path / "all"), checkpoint_every=10, checkpoint_keep=100,
                          shard_snapshot_every=5, **SHARDED)
    full = train(digits_rdd, WIDE_MLP, config)
    updates = full.summary["updates"]
    assert full.summary["checkpoints_written"] == updates // 10 + 1
    last = load_latest_checkpoint(str(tmp_path / "all"))
    assert last["version"] == updates and last["num_params"] == sum(v.numel() for v in full.state_dict.values())
    (tmp_path / "mid").mkdir()
    shutil.copy(checkpoint_path(tmp_path / "all", 40), checkpoint_path(tmp_path / "mid", 40))
    for topology in (SHARDED, {"ps_shards": 1, "ps_hosts": "driver"}):   # either PS continues a sharded run
        resumed = train(digits_rdd, WIDE_MLP, config.replace(checkpoint_dir=None, resume_from=str(tmp_path / "mid"),
                                                             **topology))
        assert resumed.summary["resumed_from_version"] == 40 and resumed.summary["version"] == updates
        for name, value in full.state_dict.items():    # the weights and the momentum carried over exactly
            assert torch.allclose(resumed.state_dict[name], value, atol=1e-5), (topology, name)


def test_validation_and_early_stopping_with_shards(digits_rdd):
    config = BASE.replace(epochs=30, validation_fraction=0.2, early_stopping_patience=2, restore_best_weights=True,
                          learning_rate=0.5, **SHARDED)
    result = train(digits_rdd, DIGITS_MLP, config)
    summary = result.summary
    assert summary["stopped_early"] and summary["best_epoch"] < 29
    assert len(result.validation) == summary["best_epoch"] + 3    # patience 2 after the best epoch
    assert summary["restored_best_weights"]


def test_shard_settings_reach_the_estimator(spark, digits):
    x_train, x_test, y_train, y_test = digits
    df = array_frame(spark, x_train, y_train)
    estimator = TorchEstimator(model=WIDE_MLP, numWorkers=2, epochs=4, batchSize=16, learningRate=0.05,
                               momentum=0.9, psShards=2, psHosts="executors")
    model = estimator.fit(df)
    assert model.summary["ps_shards"] == 2 and model.summary["ps_hosts"] == "executors"
    test = array_frame(spark, x_test, y_test)
    scored = model.transform(test).toPandas()
    assert (scored["prediction"] == scored["label"]).mean() >= 0.9


def test_a_pipeline_keeps_each_stage_parameters_on_its_own_shard(spark, digits, tmp_path):
    """pipeline_stages=2 with ps_hosts='executors': shard p is stage p's range, hosted by stage p's task."""
    import shutil

    from sparkdl._internal.ps.server.checkpoint import checkpoint_path

    x_train, _, y_train, _ = digits
    rdd = spark.sparkContext.parallelize(list(zip(x_train, y_train.tolist())), 1)

    def bn_mlp():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    config = TrainConfig(num_workers=1, pipeline_stages=2, micro_batches=2, epochs=2, batch_size=32,
                         learning_rate=0.1, momentum=0.9, seed=3, timeout_s=60)
    central = train(rdd, bn_mlp, config)
    sharded = train(rdd, bn_mlp, config.replace(ps_shards=2, ps_hosts="executors", checkpoint_dir=str(tmp_path / "all"),
                                                checkpoint_every=20, checkpoint_keep=100))
    for name, value in central.state_dict.items():   # weights and BatchNorm statistics
        assert torch.allclose(sharded.state_dict[name].float(), value.float(), atol=1e-5), name
    stage_bytes = sorted((w["pipeline_stage"], w["parameter_bytes"]) for w in sharded.workers)
    assert sharded.summary["shard_sizes"] == [b // 4 for _, b in stage_bytes]
    assert [w.get("ps_shard") for w in sorted(sharded.workers, key=lambda w: w["pipeline_stage"])] == [0, 1]
    assert len(sharded.history) == sharded.summary["updates"]
    assert sharded.history["loss"].iloc[-1] > 0     # the last stage's shard keeps the run's log: it sees the loss
    assert sharded.history["loss"].iloc[-1] == pytest.approx(central.history["loss"].iloc[-1], abs=1e-5)
    assert sharded.summary["driver_bytes"] < 0.1 * central.summary["driver_bytes"]
    # a stage shard restarts from a cut (here a checkpoint): its weights come from the cut, not from the spec
    (tmp_path / "mid").mkdir()
    shutil.copy(checkpoint_path(tmp_path / "all", 40), checkpoint_path(tmp_path / "mid", 40))
    resumed = train(rdd, bn_mlp, config.replace(ps_shards=2, ps_hosts="executors", resume_from=str(tmp_path / "mid")))
    assert resumed.summary["resumed_from_version"] == 40 and resumed.summary["version"] == sharded.summary["version"]
    assert len(resumed.history) == sharded.summary["updates"] - 40     # this run's own log starts empty
    for name, value in sharded.state_dict.items():
        if "running" not in name and "num_batches" not in name:   # BatchNorm statistics restart with the run
            assert torch.allclose(resumed.state_dict[name], value, atol=1e-5), name
    with pytest.raises(ValueError, match="set ps_shards=2"):
        train(rdd, bn_mlp, config.replace(ps_shards=1, ps_hosts="executors"))
