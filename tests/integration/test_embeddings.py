"""Embedding tables held by the parameter server as rows, on MovieLens ratings: only the touched rows travel,
sync SGD equals the dense run, bad ids fail before any update, checkpoints carry the tables."""
from __future__ import annotations

import functools

import pytest
import torch
from pyspark.sql import functions as F

from sparkdl import TorchEstimator, TrainConfig, train
from sparkdl.errors import ClusterConfigError, DataError
from sparkdl.models import BiasedMF

from .test_typed_inputs import prepared, rmse

USERS, MOVIES = 672, 9066


@pytest.fixture(scope="module")
def movielens(spark, tmp_path_factory):
    train_path, test_path = prepared("movielens", tmp_path_factory.mktemp("movielens"))
    return spark.read.parquet(train_path).cache(), spark.read.parquet(test_path).cache()


def factorisation(sparse: bool, mean: float = 3.5):
    return functools.partial(BiasedMF, USERS, MOVIES, 32, mean, sparse)


def fit(train, sparse: bool, **params):
    settings = dict(model=factorisation(sparse), inputCols=["user", "movie"], labelCol="rating", loss="mse",
                    optimizer="sgd", learningRate=0.05, batchSize=256, epochs=1, numWorkers=2, updatePolicy="sync")
    settings.update(params)
    return TorchEstimator(**settings).fit(train)


def test_sync_sgd_on_tables_equals_the_dense_run_with_a_tenth_of_the_bytes(movielens):
    train, test = movielens
    sparse, dense = fit(train, sparse=True), fit(train, sparse=False)
    assert sparse.summary["updates"] == dense.summary["updates"] > 100
    for name, value in dense.state_dict.items():
        assert torch.allclose(sparse.state_dict[name], value, atol=1e-5), name
    moved = sparse.summary["bytes_pushed"] + sparse.summary["bytes_pulled"]
    dense_moved = dense.summary["bytes_pushed"] + dense.summary["bytes_pulled"]
    # a batch of 256 touches at most 512 of the 9,738 rows of each width: about 6 % of the dense exchange
    assert moved < 0.10 * dense_moved, (moved, dense_moved)
    # what a step waits on: the push, whose write also asks for the next mini-batch's rows of the four tables (ids
    # straight from the inputs), answered right after its reply; a worker's first step pulls table by table inside
    # the forward, learning which input feeds which (4 round trips), and an epoch's first step pulls its rows
    # before the forward (1): 1 + (3 + epochs) / updates for the run's one epoch
    assert dense.summary["round_trips_per_step"] == 1.0
    assert sparse.summary["round_trips_per_step"] == pytest.approx(1 + (3 + 1) / sparse.summary["updates"])
    # scored by the ordinary module (sparse=True is an nn.Embedding like any other)
    assert rmse(sparse.transform(test), "rating") == pytest.approx(rmse(dense.transform(test), "rating"), abs=1e-4)


def test_async_lazy_adam_and_adagrad_tables_learn_the_ratings(movielens):
    train, test = movielens
    mean = train.select(F.avg("rating")).first()[0]
    baseline = rmse(test.withColumn("prediction", F.lit(mean)), "rating")
    for optimizer, embedding_optimizer, shared in (("adam", "auto", False), ("adam", "adagrad", False),
                                                   ("adam", "adagrad", True)):
        model = fit(train, sparse=True, model=factorisation(True, mean), optimizer=optimizer,
                    embeddingOptimizer=embedding_optimizer, learningRate=3e-3 if embedding_optimizer == "auto" else 0.05,
                    updatePolicy="async", epochs=3, sharedTables=shared)
        score = rmse(model.transform(test), "rating")
        assert score < baseline - 0.04, (embedding_optimizer, shared, score, baseline)
        if shared:   # both workers (local mode: the PS's host) step the tables in shared memory: no row message
            assert model.summary["shared_tables_workers"] == 2 and model.summary["round_trips_per_step"] == 1.0
            continue
        # async pulls before the forward (the pull behind the push is sync's): 2 a step, and a worker's first
        # step pulls its 4 tables one by one
        assert model.summary["round_trips_per_step"] == pytest.approx(2 + 3 / model.summary["updates"], abs=0.01)


def test_an_id_beyond_a_table_fails_the_run_with_a_data_error_naming_the_table(spark):
    rows = [(1, 2, 3.0), (3, 4, 3.0), (USERS + 5, 1, 3.0), (2, 2, 3.0)] * 8
    frame = spark.createDataFrame(rows, "user long, movie long, rating double")
    with pytest.raises(DataError, match=r"table 'user' has 672 rows, but the batch holds id 677 at position \(2,\)"):
        fit(frame, sparse=True, batchSize=8, numWorkers=1, shuffle=False, maxAttempts=3)


def pairs_rdd(spark, users: int, movies: int):
    torch.manual_seed(0)
    user_ids = torch.randint(0, users, (512,))
    movie_ids = torch.randint(0, movies, (512,))
    ratings = torch.randn(512) + 3
    return spark.sparkContext.parallelize(
        [(torch.stack([u, m]).float().numpy(), float(r)) for u, m, r in zip(user_ids, movie_ids, ratings)], 2)


def test_tables_split_by_rows_over_executor_hosted_shards_train_as_on_the_driver(spark, tmp_path):
    from sparkdl._internal.ps.server.checkpoint import checkpoint_path, state_from_bytes

    rdd = pairs_rdd(spark, 500, 800)
    config = TrainConfig(num_workers=2, epochs=2, batch_size=32, loss="mse", optimizer="sgd", learning_rate=0.05,
                         embedding_optimizer="adagrad", policy="sync", seed=5, checkpoint_every=5, checkpoint_keep=100)
    model = functools.partial(Pairs, 500, 800)
    central = train(rdd, model, config.replace(checkpoint_dir=str(tmp_path / "central")))
    # snapshots every 3 updates carry the rows changed since the last; a checkpoint every 5 merges a cut
    sharded = train(rdd, model, config.replace(ps_hosts="executors", ps_shards=2, shard_snapshot_every=3,
                                               checkpoint_dir=str(tmp_path / "sharded")))
    assert sharded.summary["ps_shards"] == 2 and sharded.summary["updates"] == central.summary["updates"] == 16
    assert sharded.summary["shard_rows_sent"] == 0      # each shard built its initial rows itself
    for name, value in central.state_dict.items():
        assert torch.allclose(sharded.state_dict[name], value, atol=1e-5), name
    # a model whose tables start otherwise on an executor, or cannot be built whole there, gets the driver's
    # rows, and trains as the central PS
    for model_fn in (ExecutorShifted, TooLargeForAnExecutor):
        unlike = train(rdd, model_fn, config.replace(ps_hosts="executors", ps_shards=2))
        assert unlike.summary["shard_rows_sent"] == 2, model_fn
        for name, value in central.state_dict.items():
            assert torch.allclose(unlike.state_dict[name], value, atol=1e-5), (model_fn, name)
    # the cuts the driver assembled from changed rows, and the final checkpoint laid over the last (at 15),
    # are the whole tables and their Adagrad state
    for version in (5, 10, 16):
        whole, cut = (state_from_bytes(checkpoint_path(tmp_path / run, version).read_bytes())
                      for run in ("central", "sharded"))
        for table, merged in zip(whole["tables"], cut["tables"], strict=True):
            for key in ("weight", "state_sum"):
                assert torch.allclose(merged[key], table[key], atol=1e-5), (version, key)
    # and a run resumed from one continues as the undisturbed run did
    (tmp_path / "mid").mkdir()
    checkpoint_path(tmp_path / "mid", 10).write_bytes(checkpoint_path(tmp_path / "sharded", 10).read_bytes())
    resumed = train(rdd, model, config.replace(ps_hosts="executors", ps_shards=2, shard_snapshot_every=3,
                                               resume_from=str(tmp_path / "mid")))
    assert resumed.summary["resumed_from_version"] == 10
    for name, value in central.state_dict.items():
        assert torch.allclose(resumed.state_dict[name], value, atol=1e-5), name


def test_a_run_resumed_from_a_checkpoint_continues_the_tables_exactly(spark, tmp_path):
    rdd = pairs_rdd(spark, 50, 80)

    def model():
        return Pairs()

    config = TrainConfig(num_workers=2, epochs=4, batch_size=32, loss="mse", optimizer="adam", learning_rate=0.01,
                         embedding_optimizer="adagrad", policy="sync", seed=5)
    whole = train(rdd, model, config)
    first = train(rdd, model, config.replace(epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=1000))
    resumed = train(rdd, model, config.replace(resume_from=str(tmp_path)))
    assert resumed.summary["resumed_from_version"] == first.summary["updates"] > 0
    for name, value in whole.state_dict.items():
        assert torch.allclose(resumed.state_dict[name], value, atol=1e-6), name
    assert not torch.allclose(first.state_dict["users.weight"], whole.state_dict["users.weight"], atol=1e-3)


class Pairs(torch.nn.Module):
    """A rating from a user and a movie id carried as float features (exact below 2**24)."""

    def __init__(self, users: int = 50, movies: int = 80) -> None:
        super().__init__()
        self.users = torch.nn.Embedding(users, 4, sparse=True)
        self.movies = torch.nn.Embedding(movies, 4, sparse=True)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.users(x[:, 0].long()) * self.movies(x[:, 1].long()))[:, 0] + 3


class ExecutorShifted(Pairs):
    """``Pairs(500, 800)`` on the driver; built on an executor, its user rows are shifted by one."""

    def __init__(self) -> None:
        super().__init__(500, 800)
        from pyspark import TaskContext

        if TaskContext.get() is not None:
            with torch.no_grad():
                self.users.weight.add_(1.0)


class TooLargeForAnExecutor(Pairs):
    """``Pairs(500, 800)``; built with its rows on an executor, it runs out of memory (a replica, rowless, does not)."""

    def __init__(self) -> None:
        super().__init__(500, 800)
        from pyspark import TaskContext

        if TaskContext.get() is not None and not self.users.weight.is_meta:
            raise MemoryError("the whole table does not fit this executor")


@pytest.mark.parametrize("settings", [dict(policy="allreduce"), dict(overlap_communication=True),
                                      dict(local_update="sgd", local_steps=2), dict(grad_clip_norm=1.0)])
def test_what_tables_cannot_train_with_is_refused_before_launch(spark, settings):
    rdd = spark.sparkContext.parallelize([(torch.zeros(2).numpy(), 1.0)] * 8, 2)
    with pytest.raises(ValueError, match=r"embedding tables \['users', 'movies'\] .* cannot train here"):
        train(rdd, Pairs, TrainConfig(num_workers=2, loss="mse", **settings))


class Wide(torch.nn.Module):
    """One 64-wide table of ``rows`` rows (4M: 1 GiB of float32) and a linear read-out."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(rows, 64, sparse=True)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.table(x[:, 0].long()))[:, 0]


def test_a_replica_never_holds_its_table_and_a_table_past_the_ps_memory_is_refused(spark):
    rows = 4_000_000
    data = spark.sparkContext.parallelize([(torch.tensor([float(i % 997)]).numpy(), 1.0) for i in range(256)], 2)
    config = TrainConfig(num_workers=2, epochs=1, batch_size=32, loss="mse", policy="async")
    result = train(data, functools.partial(Wide, rows), config)
    table_bytes = rows * 64 * 4
    # a worker's Python process holds torch and the dense part (about 0.4 GB here), never the 1 GiB table
    assert max(w["peak_rss_bytes"] for w in result.workers) < 0.6 * table_bytes, result.workers
    assert result.state_dict["table.weight"].shape == (rows, 64)
    with pytest.raises(ClusterConfigError, match=r"MB for the embedding tables \['table'\] .* embedding_optimizer"):
        train(data, functools.partial(Wide, rows), config.replace(ps_memory_limit_mb=600))
