"""Several typed inputs on real data through local[2]: MovieLens ids, tweets' token ids, and what is refused."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline
from pyspark.ml.feature import RegexTokenizer, StringIndexer
from pyspark.sql import functions as F
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.ml.vocabulary import TokenIndexer
from sparkdl.models import BagOfEmbeddings, BiasedMF

ROOT = Path(__file__).resolve().parents[2]
LARGEST_INT = 2**31 - 1


def prepared(name: str, directory: Path) -> tuple[str, str]:
    """jobs/prepare_data.py's train/test split of ``name`` (written once per test session)."""
    spec = importlib.util.spec_from_file_location("sparkdl_prepare_data", ROOT / "jobs" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not (directory / name / "train.parquet").exists():
        module.main(["--output", str(directory), "--datasets", name])
    return str(directory / name / "train.parquet"), str(directory / name / "test.parquet")


@pytest.fixture(scope="module")
def real_data(tmp_path_factory):
    return tmp_path_factory.mktemp("typed-data")


def rmse(frame, label: str) -> float:
    return frame.select(F.sqrt(F.avg((F.col("prediction") - F.col(label)) ** 2))).first()[0]


class RequiresIds(BiasedMF):
    """Biased MF that refuses anything but int64 ids (a float cast would fail the fit here)."""

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        if user.dtype != torch.int64 or item.dtype != torch.int64:
            raise TypeError(f"ids arrived as {user.dtype}, {item.dtype}")
        return super().forward(user, item)


def test_movielens_ids_train_a_factorisation_model_that_beats_the_mean_and_survives_saving(spark, real_data,
                                                                                           tmp_path):
    train_path, test_path = prepared("movielens", real_data)
    train, test = spark.read.parquet(train_path).cache(), spark.read.parquet(test_path).cache()
    mean = train.select(F.avg("rating")).first()[0]
    baseline = rmse(test.withColumn("prediction", F.lit(mean)), "rating")
    estimator = TorchEstimator(model=functools.partial(RequiresIds, 672, 9066, 32, mean), inputCols=["user", "movie"],
                               labelCol="rating", loss="mse", optimizer="adam", learningRate=3e-3, batchSize=256,
                               epochs=3, numWorkers=2, updatePolicy="sync")
    model = estimator.fit(train)
    score = rmse(model.transform(test), "rating")
    # the mean's RMSE is 1.05 on this split; 3 epochs of sync Adam reach about 0.93
    assert score < baseline - 0.06, (score, baseline)
    model.write().overwrite().save(str(tmp_path / "mf"))
    loaded = TorchModel.load(str(tmp_path / "mf"))
    assert loaded.getInputCols() == ["user", "movie"]
    assert rmse(loaded.transform(test), "rating") == pytest.approx(score, abs=1e-9)
    # a null or negative id in any input: refused, left out or kept without a prediction
    bad = spark.createDataFrame([(1, 5, 4.0), (None, 5, 3.0), (2, -1, 3.0)], "user int, movie int, rating double")
    with pytest.raises(Exception, match=r"row \d of the partition has null, NaN or infinite \(as float32\) values, "
                                        r"negative ids or sequences over sequenceLength in 'user', 'movie'"):
        loaded.transform(bad).collect()
    assert loaded.setHandleInvalid("skip").transform(bad).count() == 1
    kept = loaded.setHandleInvalid("keep").transform(bad).orderBy("rating", ascending=False).collect()
    assert np.isfinite(kept[0]["prediction"]) and all(np.isnan(row["prediction"]) for row in kept[1:])


class TablesOnlyMF(BiasedMF):
    """The textbook biased factorisation with every parameter an embedding table: the global mean is a float."""

    def __init__(self, users: int, items: int, dim: int, mean: float, sparse: bool) -> None:
        super().__init__(users, items, dim, sparse=sparse)
        del self.mean
        self.mean = mean


def test_a_factorisation_made_only_of_tables_trains_as_its_dense_twin_on_movielens(spark, real_data):
    """Every parameter a sparse table: the PS holds the whole model as rows, with no dense vector at all."""
    train_path, test_path = prepared("movielens", real_data)
    train, test = spark.read.parquet(train_path).cache(), spark.read.parquet(test_path).cache()
    mean = train.select(F.avg("rating")).first()[0]
    baseline = rmse(test.withColumn("prediction", F.lit(mean)), "rating")
    scores = {}
    for sparse in (True, False):
        estimator = TorchEstimator(model=functools.partial(TablesOnlyMF, 672, 9066, 16, mean, sparse),
                                   inputCols=["user", "movie"], labelCol="rating", loss="mse", optimizer="sgd",
                                   learningRate=20.0, batchSize=256, epochs=3, numWorkers=2, updatePolicy="sync",
                                   embeddingOptimizer="sgd")
        scores[sparse] = rmse(estimator.fit(train).transform(test), "rating")
    assert abs(scores[True] - scores[False]) < 0.005, scores
    assert scores[True] < baseline - 0.01, (scores, baseline)


class IdEcho(nn.Module):
    """Predicts ``id % 1000``: exact only if the id arrives as the int64 it was (2**31 - 1 is not a float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dtype == torch.int64, ids.dtype
        return (ids % 1000).to(torch.float32) * self.scale.detach() + 0 * self.scale


def test_an_id_of_2_31_minus_1_reaches_the_model_unchanged(spark):
    ids = [LARGEST_INT, LARGEST_INT - 1, 2**40 + 7, 3]
    frame = spark.createDataFrame([(i, float(i % 1000)) for i in ids], "id long, label double")
    model = TorchEstimator(model=IdEcho, inputCols=["id"], loss="mse", epochs=1, batchSize=2, numWorkers=1).fit(frame)
    predictions = {row["id"]: row["prediction"] for row in model.transform(frame).collect()}
    assert predictions == {LARGEST_INT: 647.0, LARGEST_INT - 1: 646.0, 2**40 + 7: float((2**40 + 7) % 1000), 3: 3.0}


def tweet_pipeline(epochs: int, **params) -> Pipeline:
    vocabulary = 5002
    settings = dict(model=functools.partial(BagOfEmbeddings, vocabulary, 32, 32, 2), inputCols=["ids"],
                    inputArgs=["ids"], labelCol="iphone", loss="cross_entropy", optimizer="adam", learningRate=3e-3,
                    batchSize=64, epochs=epochs, numWorkers=2, updatePolicy="async")
    settings.update(params)
    return Pipeline(stages=[RegexTokenizer(inputCol="text", outputCol="tokens", pattern="\\s+", gaps=True),
                            TokenIndexer(inputCol="tokens", outputCol="ids", vocabSize=vocabulary - 2, minCount=2),
                            TorchEstimator(**settings)])


class MaskRecorder(BagOfEmbeddings):
    """Fails the fit unless the padding mask arrives and pads exactly the rows' ends."""

    def forward(self, ids: torch.Tensor, ids_mask: torch.Tensor | None = None) -> torch.Tensor:
        if ids_mask is None or ids_mask.shape != ids.shape or not ids_mask[:, 0].all():
            raise AssertionError("no padding mask, or one of another shape")
        lengths = ids_mask.sum(dim=1)
        if int(lengths.max()) != ids.shape[1]:      # padded to the batch's longest row, not a global bound
            raise AssertionError(f"padded to {ids.shape[1]}, the longest row has {int(lengths.max())}")
        return super().forward(ids, ids_mask)


def test_tweets_token_ids_train_a_text_classifier_through_a_pipeline(spark, real_data):
    train_path, test_path = prepared("tweets", real_data)
    train, test = spark.read.parquet(train_path).cache(), spark.read.parquet(test_path).cache()
    majority = max(test.select(F.avg("iphone")).first()[0], 1 - test.select(F.avg("iphone")).first()[0])
    fitted = tweet_pipeline(4, model=functools.partial(MaskRecorder, 5002, 32, 32, 2)).fit(train)
    scored = fitted.transform(test)
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("iphone")).cast("double"))).first()[0]
    # Android vs iPhone: 0.54 by the majority; a bag of embeddings reaches about 0.8 here
    assert accuracy > majority + 0.15, (accuracy, majority)
    vocabulary = fitted.stages[1].getVocabulary()
    assert len(vocabulary) == 5000 and scored.schema["ids"].dataType.simpleString() == "array<int>"


def test_tweets_token_ids_train_fully_sharded_in_bf16_and_the_fitted_model_scores(spark, real_data):
    """policy='fsdp' through a pyspark.ml Pipeline: ragged ids with their masks, bf16-mixed, AdamW with clipping;
    the driver assembles the workers' shards into the model that scores."""
    train_path, test_path = prepared("tweets", real_data)
    train, test = spark.read.parquet(train_path).cache(), spark.read.parquet(test_path).cache()
    majority = max(test.select(F.avg("iphone")).first()[0], 1 - test.select(F.avg("iphone")).first()[0])
    fitted = tweet_pipeline(4, model=functools.partial(MaskRecorder, 5002, 32, 32, 2), updatePolicy="fsdp",
                            precision="bf16-mixed", optimizer="adamw", weightDecay=0.01, gradClipNorm=1.0).fit(train)
    model = fitted.stages[-1]
    assert model.summary["mode"] == "fully_sharded"
    assert all(value.dtype == torch.float32 for value in model.state_dict.values())
    scored = fitted.transform(test)
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("iphone")).cast("double"))).first()[0]
    assert accuracy > majority + 0.15, (accuracy, majority)


def test_ragged_rows_spilled_to_disk_train_exactly_as_in_memory(spark, real_data):
    train_path, _ = prepared("tweets", real_data)
    frame = spark.read.parquet(train_path).limit(1500).cache()
    weights = []
    for cache in ("memory", "disk"):
        fitted = tweet_pipeline(1, dataCache=cache, updatePolicy="sync").fit(frame)
        model = fitted.stages[-1]
        assert model.summary["data_cache"] == cache
        weights.append(torch.cat([v.reshape(-1) for v in model.state_dict.values()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def two_input_net() -> nn.Module:
    return BiasedMF(10, 10, 2)


def test_what_the_model_cannot_take_is_refused_before_launch_with_what_to_do(spark):
    frame = spark.createDataFrame([(1, "a", 2, 1.0, 1.0), (2, "b", 3, 0.0, 2.0)],
                                  "user int, genre string, movie int, label double, w double")
    with pytest.raises(ValueError, match=r"column 'genre' holds strings.*StringIndexer\(inputCol='genre'"):
        TorchEstimator(model=two_input_net, inputCols=["user", "genre"], loss="mse").fit(frame)
    with pytest.raises(ValueError, match=r"forward\(user, item\) fails on the inputs of inputCols \['user'\], given "
                                         r"as 1 positional arguments"):
        TorchEstimator(model=two_input_net, inputCols=["user"], loss="mse").fit(frame)

    def no_weights(output, target):
        return ((output - target) ** 2).mean()

    with pytest.raises(ValueError, match="takes no weight= argument"):
        TorchEstimator(model=two_input_net, inputCols=["user", "movie"], loss=no_weights, weightCol="w").fit(frame)
    negative = spark.createDataFrame([(1, 2, 1.0), (-4, 3, 0.0)], "user int, movie int, label double")
    with pytest.raises(ValueError, match=r"column 'user' holds the id -4.*must be >= 0"):
        TorchEstimator(model=two_input_net, inputCols=["user", "movie"], loss="mse", numWorkers=1).fit(negative)
    nulls = spark.createDataFrame([(1, 2, 1.0), (None, 3, 0.0)], "user int, movie int, label double")
    with pytest.raises(ValueError, match=r"column 'user' has 1 null rows"):
        TorchEstimator(model=two_input_net, inputCols=["user", "movie"], loss="mse", numWorkers=1).fit(nulls)


def test_a_weight_column_weighs_rows_in_the_update_like_repeated_rows(spark):
    """One worker, one batch per step, SGD: weight 2 on a row gives the step that row twice gives."""
    rows = [(i % 5, (i * 3) % 7, float(i % 4)) for i in range(8)]
    weighted = spark.createDataFrame([(u, m, r, 2.0 if k == 0 else 1.0) for k, (u, m, r) in enumerate(rows)],
                                     "user int, movie int, label double, w double")
    repeated = spark.createDataFrame([rows[0]] + rows, "user int, movie int, label double")
    common = dict(model=functools.partial(BiasedMF, 5, 7, 2), inputCols=["user", "movie"], loss="mse",
                  optimizer="sgd", learningRate=0.1, epochs=1, numWorkers=1, shuffle=False)
    by_weight = TorchEstimator(weightCol="w", batchSize=8, **common).fit(weighted)
    by_repeat = TorchEstimator(batchSize=9, **common).fit(repeated)
    for name, value in by_weight.state_dict.items():
        torch.testing.assert_close(value, by_repeat.state_dict[name], rtol=1e-5, atol=1e-6)


def test_string_categories_are_indexed_inside_a_pipeline_and_scored_with_their_ids(spark):
    frame = spark.createDataFrame([(c, float(c == "x")) for c in "xyzxyzxxyy"], "carrier string, label double")
    pipeline = Pipeline(stages=[StringIndexer(inputCol="carrier", outputCol="carrier_id", handleInvalid="keep"),
                                TorchEstimator(model=functools.partial(EmbeddingLogit, 4), inputCols=["carrier_id"],
                                               loss="bce_with_logits", optimizer="adam", learningRate=0.1,
                                               epochs=30, batchSize=10, numWorkers=1)])
    scored = pipeline.fit(frame).transform(frame)
    assert scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0] == 1.0


class EmbeddingLogit(nn.Module):
    """One logit per category id (StringIndexer gives doubles: they are cast to ids here)."""

    def __init__(self, categories: int) -> None:
        super().__init__()
        self.logit = nn.Embedding(categories, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logit(ids.long())[:, 0]


@pytest.mark.parametrize("ps", [{}, {"ps_hosts": "executors", "ps_shards": 2}], ids=["driver-ps", "executor-shards"])
def test_rdd_rows_of_typed_inputs_train_with_named_arguments_and_validate(spark, ps):
    from sparkdl import train

    rng = np.random.default_rng(0)
    rows = [((int(u), int(m)), float(u % 3 + m % 2)) for u, m in zip(rng.integers(0, 20, 400), rng.integers(0, 30, 400))]
    result = train(spark.sparkContext.parallelize(rows, 2), functools.partial(BiasedMF, 20, 30, 4, 1.5),
                   input_args=("user", "item"), loss="mse", optimizer="adam", learning_rate=0.05, epochs=10,
                   batch_size=32, num_workers=2, policy="sync", validation_fraction=0.2, **ps)
    assert result.history["loss"].iloc[-1] < 0.5 * result.history["loss"].iloc[0]
    # the held-out rows are scored with the same typed inputs: the RMSE falls too
    rmse = result.validation["val_metric"].tolist()
    assert len(rmse) == 10 and rmse[-1] < 0.8 * rmse[0]


class MeanOfEmbeddings(nn.Module):
    """The token embeddings' mean over a fixed-length, zero-padded row."""

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors.mean(dim=1)


def tokens_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(40, 16), MeanOfEmbeddings(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def test_pipeline_stages_take_ragged_ids_padded_to_the_sequence_length(spark):
    rng = np.random.default_rng(1)
    ids = [[int(t) for t in rng.integers(1, 40, int(n))] for n in rng.integers(1, 9, 512)]
    frame = spark.createDataFrame([(row, int(np.mean(row) < 20)) for row in ids], "ids array<int>, label long")
    settings = dict(model=tokens_model, inputCols=["ids"], loss="cross_entropy", optimizer="adam", learningRate=0.01,
                    batchSize=32, epochs=6, numWorkers=1, pipelineStages=2, microBatches=4)
    with pytest.raises(ValueError, match="set sequenceLength"):
        TorchEstimator(**settings).fit(frame)
    model = TorchEstimator(sequenceLength=8, **settings).fit(frame)
    assert model.summary["pipeline_stages"] == 2
    scored = model.transform(frame).select(F.avg((F.col("prediction") == F.col("label")).cast("double")))
    assert scored.first()[0] > 0.8, scored.first()[0]


def test_the_flights_job_indexes_its_strings_in_a_pipeline_and_beats_the_majority_on_auc(spark, real_data, tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "jobs"))
    import train as job_module

    from sparkdl import TrainConfig

    train_path, test_path = prepared("flights", real_data)
    sample = spark.read.parquet(train_path).sample(fraction=0.1, seed=0)
    job = job_module.load_job_config(ROOT / "conf" / "flights_embeddings.toml", [f"data.test='{test_path}'"])
    settings = dict(job["model"])
    name = settings.pop("name")
    config = TrainConfig.from_mapping({**job["train"], "epochs": 2, "verbose": False})
    metrics, torch_model, _, kwargs = job_module.train_typed_table(spark, sample, job, name, settings, config,
                                                                   tmp_path)
    assert len(kwargs["cardinalities"]) == 7 and kwargs["numeric_features"] == 7
    assert torch_model.getInputCols()[0] == "carrier_id"
    # AUC 0.5 is guessing; 2 epochs on a tenth of the flights reach about 0.72
    assert metrics["test_auc"] > 0.65, metrics


def test_multi_label_targets_train_and_score_as_vectors(spark):
    """Two labels per row (has a small token, has a large one): bce_with_logits over vector labels."""
    from pyspark.ml.functions import vector_to_array

    rng = np.random.default_rng(2)
    ids = [[int(t) for t in rng.integers(1, 40, int(n))] for n in rng.integers(1, 6, 600)]
    frame = spark.createDataFrame([(row, [float(min(row) < 10), float(max(row) > 30)]) for row in ids],
                                  "ids array<int>, label array<double>")
    model = TorchEstimator(model=functools.partial(BagOfEmbeddings, 40, 16, 32, 2), inputCols=["ids"], inputArgs=["ids"],
                           loss="bce_with_logits", optimizer="adam", learningRate=0.02, batchSize=32, epochs=15,
                           numWorkers=2).fit(frame)
    scored = model.transform(frame).select(vector_to_array("prediction").alias("p"), "label",
                                           vector_to_array("probability").alias("q"))
    rows = scored.collect()
    assert all(len(r["p"]) == 2 and len(r["q"]) == 2 for r in rows)
    right = np.mean([p == y for r in rows for p, y in zip(r["p"], r["label"], strict=True)])
    assert right > 0.85, right         # each label alone is about 0.5 to 0.6 by its majority
