"""pyspark.ml API: TorchEstimator / TorchModel on real data through local[2]."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.functions import array_to_vector
from pyspark.ml.linalg import DenseVector, Vectors
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.models import mlp

from ..conftest import ASYNC_ACCURACY, DIGITS_MLP, array_frame


def accuracy(frame) -> float:
    return frame.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]


@pytest.fixture(scope="module")
def digits_frames(spark, digits):
    x_train, x_test, y_train, y_test = digits
    return array_frame(spark, x_train, y_train).cache(), array_frame(spark, x_test, y_test).cache()


def estimator(**params) -> TorchEstimator:
    settings = dict(model=DIGITS_MLP, optimizer="sgd", learningRate=0.05, momentum=0.9, batchSize=16, epochs=10,
                    numWorkers=2)
    settings.update(params)
    return TorchEstimator(**settings)


@pytest.mark.parametrize("features", ["array", "vector"])
@pytest.mark.parametrize("policy", ["sync", "async", "softsync"])
def test_fit_transform_digits(digits_frames, policy, features):
    train, test = digits_frames
    if features == "vector":
        train = train.withColumn("features", array_to_vector("features"))
        test = test.withColumn("features", array_to_vector("features"))
    model = estimator(updatePolicy=policy, softsyncSize=2 if policy == "softsync" else 1).fit(train)
    scored = model.transform(test)
    assert scored.columns == ["features", "label", "prediction", "probability"]
    assert accuracy(scored) >= (0.93 if policy == "sync" else ASYNC_ACCURACY)
    first = scored.select("probability").first().probability
    assert isinstance(first, DenseVector) and len(first) == 10 and abs(first.toArray().sum() - 1) < 1e-5
    history = model.history
    assert {"version", "epoch", "loss", "samples", "staleness_mean", "samples_per_s"} <= set(history.columns)
    assert len(history) == model.summary["updates"] > 0
    assert model.summary["policy"] == policy and model.summary["task"] == "multiclass"


def test_a_fit_with_max_workers_trains_every_work_unit_of_the_frame_each_epoch_and_validates_them(digits_frames):
    train, test = digits_frames
    model = estimator(updatePolicy="async", elastic=True, numWorkers=1, maxWorkers=2, epochs=4,
                      validationFraction=0.1).fit(train)
    summary, count = model.summary, train.count()
    assert summary["work_units"] == 8 and summary["attempts"] == 1
    # the frame's rows, shuffled once into 8 units: every epoch each unit's pass, less its held-out rows
    validation = summary["validation"]
    assert [row["epoch"] for row in validation] == [0, 1, 2, 3]
    held_out = validation[0]["samples"]
    assert all(row["samples"] == held_out for row in validation) and 0 < held_out < count // 5
    assert summary["samples_consumed"] == summary["sample_budget"] == 4 * (count - held_out)
    assert accuracy(model.transform(test)) >= ASYNC_ACCURACY


def test_sparse_vectors_and_several_numeric_columns(spark, digits):
    x_train, x_test, y_train, y_test = digits
    sparse_rows = [(Vectors.sparse(64, {i: float(v) for i, v in enumerate(row) if v}), int(label))
                   for row, label in zip(x_train, y_train)]
    train = spark.createDataFrame(sparse_rows, ["features", "label"])
    model = estimator(updatePolicy="async").fit(train)
    test = spark.createDataFrame([(Vectors.dense(row.tolist()), int(label)) for row, label in zip(x_test, y_test)],
                                 ["features", "label"])
    assert accuracy(model.transform(test)) >= ASYNC_ACCURACY

    names = [f"p{i}" for i in range(64)]
    wide = spark.createDataFrame([tuple(map(float, row)) + (int(label),) for row, label in zip(x_train, y_train)],
                                 names + ["label"])
    wide_test = spark.createDataFrame([tuple(map(float, row)) + (int(label),) for row, label in zip(x_test, y_test)],
                                      names + ["label"])
    model = estimator(updatePolicy="async", featuresCols=names).fit(wide)
    assert accuracy(model.transform(wide_test)) >= ASYNC_ACCURACY


def test_features_shape_feeds_a_convolutional_model(digits_frames):
    def cnn():
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(8 * 4 * 4, 10))

    train, test = digits_frames
    model = estimator(model=cnn, featuresShape=[1, 8, 8], updatePolicy="async", epochs=12).fit(train)
    assert accuracy(model.transform(test)) >= ASYNC_ACCURACY


def test_pipeline_on_breast_cancer_saves_and_reloads_identically(spark, tmp_path):
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    data = load_breast_cancer()
    names = [f"f{i}" for i in range(data.data.shape[1])]
    x_train, x_test, y_train, y_test = train_test_split(data.data, data.target, test_size=0.25, random_state=0,
                                                        stratify=data.target)
    def frame(x, y):
        return spark.createDataFrame([tuple(map(float, row)) + (int(label),) for row, label in zip(x, y)],
                                     names + ["label"])
    train, test = frame(x_train, y_train), frame(x_test, y_test)
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=names, outputCol="raw"),
        StandardScaler(inputCol="raw", outputCol="features", withMean=True, withStd=True),
        TorchEstimator(model=functools.partial(mlp, len(names), (32,), 2), optimizer="adam", learningRate=1e-2,
                       batchSize=16, epochs=15, numWorkers=2, updatePolicy="async"),
    ])
    fitted = pipeline.fit(train)
    scored = fitted.transform(test)
    # async: 10 fits over seeds 0-8 here (half with both cores busy) 0.951-0.965 on these 143 rows, whose
    # majority class is 0.63; async digits runs reached 0.034 below their spread here in loaded CI runs
    assert accuracy(scored) >= 0.90
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    assert isinstance(reloaded.stages[-1], TorchModel)
    before = [(r.prediction, r.probability.toArray().tolist()) for r in scored.select("prediction", "probability").collect()]
    after = [(r.prediction, r.probability.toArray().tolist())
             for r in reloaded.transform(test).select("prediction", "probability").collect()]
    assert before == after
    unfitted_path = str(tmp_path / "unfitted")
    pipeline.write().overwrite().save(unfitted_path)
    loaded_estimator = Pipeline.load(unfitted_path).getStages()[-1]
    assert isinstance(loaded_estimator, TorchEstimator)
    assert loaded_estimator.getEpochs() == 15 and loaded_estimator.getOptimizer() == "adam"
    assert loaded_estimator.getModel()().state_dict().keys() == pipeline.getStages()[-1].getModel()().state_dict().keys()


def test_model_saved_with_a_local_factory_uses_cloudpickle(digits_frames, tmp_path):
    def local_net():
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    train, test = digits_frames
    model = estimator(model=local_net, updatePolicy="async", epochs=3).fit(train)
    model.write().overwrite().save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"))
    assert loaded.uid == model.uid
    assert loaded.summary["updates"] == model.summary["updates"]
    assert len(loaded.history) == len(model.history)
    first = [r.prediction for r in model.transform(test).select("prediction").collect()]
    second = [r.prediction for r in loaded.transform(test).select("prediction").collect()]
    assert first == second


def test_cross_validator_picks_the_better_learning_rate(digits_frames):
    train, _ = digits_frames
    est = estimator(epochs=4)
    grid = (ParamGridBuilder().addGrid(est.learningRate, [1e-5, 0.05])
            .addGrid(est.updatePolicy, ["sync", "async"]).build())
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
    fitted = cv.fit(train)
    best = grid[int(np.argmax(fitted.avgMetrics))]
    assert best[est.learningRate] == 0.05
    assert max(fitted.avgMetrics) > 0.9 > min(fitted.avgMetrics)
    assert isinstance(fitted.bestModel, TorchModel)


def test_params_behave_like_pyspark_ml():
    est = TorchEstimator(model=DIGITS_MLP, learningRate=0.1)
    assert est.getLearningRate() == 0.1 and est.getUpdatePolicy() == "sync" and est.getBatchSize() == 32
    copy = est.copy({est.epochs: 7})
    assert copy.getEpochs() == 7 and est.getEpochs() == 5
    est.setUpdatePolicy("async").setMaxStaleness(3)
    config = est.train_config()
    assert (config.policy, config.max_staleness, config.learning_rate) == ("async", 3, 0.1)
    text = est.explainParams()
    for name in ("model", "loss", "optimizer", "learningRate", "momentum", "weightDecay", "batchSize", "epochs",
                 "numWorkers", "updatePolicy", "softsyncSize", "localSteps", "stalenessLr", "maxStaleness",
                 "seed", "featuresCol", "labelCol", "predictionCol", "probabilityCol", "checkpointDir", "device"):
        assert f"{name}:" in text
    with pytest.raises(ValueError, match="policy must be one of"):
        est.setUpdatePolicy("hogwild").train_config()


def test_transform_handles_rows_with_null_or_nan_features_as_asked(spark, digits):
    """keep gives them no prediction; skip leaves them out; error (the default) names the first one."""
    import torch

    _, x_test, _, y_test = digits
    torch.manual_seed(0)
    model = TorchModel._from_saved(DIGITS_MLP().state_dict(), [], {"task": "multiclass", "output_width": 10})
    model._set(model=DIGITS_MLP)
    rows = [(i, row.tolist(), int(label)) for i, (row, label) in enumerate(zip(x_test[:40], y_test[:40]))]
    rows[3] = (3, None, rows[3][2])                                   # a null row
    rows[7] = (7, [float("nan")] + rows[7][1][1:], rows[7][2])       # NaN
    rows[11] = (11, [float("inf")] * 64, rows[11][2])                  # infinite
    rows[20] = (20, [None] + rows[20][1][1:], rows[20][2])           # a null element (a null vector below)
    frame = spark.createDataFrame(rows, "id long, features array<double>, label long").coalesce(1)
    clean = F.when(~F.exists("features", lambda v: v.isNull()), array_to_vector("features"))
    frame = frame.withColumn("vector", clean)
    bad = [3, 7, 11, 20]
    valid = [i for i in range(40) if i not in bad]
    for column in ("features", "vector"):
        scorer = model.copy().setFeaturesCol(column).setHandleInvalid("keep")
        kept = {r.id: r for r in scorer.transform(frame).collect()}
        assert sorted(kept) == list(range(40))
        assert [i for i, r in kept.items() if np.isnan(r.prediction)] == bad
        assert all(kept[i].probability is None for i in bad)
        assert all(isinstance(kept[i].probability, DenseVector) and 0 <= kept[i].prediction < 10 for i in valid)
    skipped = {r.id: r.prediction for r in model.setHandleInvalid("skip").transform(frame).collect()}
    assert sorted(skipped) == valid and all(skipped[i] == kept[i].prediction for i in valid)
    with pytest.raises(ValueError, match="handleInvalid must be one of 'error', 'skip', 'keep'"):
        model.setHandleInvalid("drop").transform(frame)
    with pytest.raises(Exception, match=r"row 3 of the partition has null, NaN or infinite \(as float32\) "
                                         r"features.*handleInvalid"):
        model.setHandleInvalid("error").transform(frame).collect()
