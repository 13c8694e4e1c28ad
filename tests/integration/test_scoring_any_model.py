"""Scoring modules trained anywhere on real data: predictions equal calling the module directly."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchModel
from sparkdl._internal.spark.backend import ClassicBackend
from tests.conftest import array_frame


def plain_pytorch_digits_classifier(x_train: np.ndarray, y_train: np.ndarray) -> nn.Module:
    """Trained by PyTorch alone: a few epochs of Adam on the digits."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
    for _ in range(60):
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    return module.eval()


@pytest.fixture(scope="module")
def trained(digits):
    x_train, x_test, y_train, y_test = digits
    return plain_pytorch_digits_classifier(x_train, y_train), x_test, y_test


@pytest.fixture(scope="module")
def test_frame(spark, trained):
    _, x_test, y_test = trained
    return array_frame(spark, x_test, y_test).repartition(2).cache()


def direct(module: nn.Module, features: list) -> torch.Tensor:
    with torch.inference_mode():
        return module(torch.tensor(features, dtype=torch.float32))


def test_a_module_trained_by_plain_pytorch_scores_as_calling_it(trained, test_frame):
    module, _, y_test = trained
    model = TorchModel.from_module(module, outputKind="multiclass", rawPredictionCol="raw", topK=3)
    rows = model.transform(test_frame).select("features", "label", "prediction", "probability", "raw",
                                              "topK").collect()
    logits = direct(module, [r.features for r in rows])
    assert [r.prediction for r in rows] == logits.argmax(dim=1).double().tolist()
    assert np.allclose([r.probability.toArray() for r in rows], torch.softmax(logits.double(), 1).numpy())
    assert np.allclose([r.raw.toArray() for r in rows], logits.double().numpy())
    assert [r.topK for r in rows] == logits.topk(3, dim=1).indices.tolist()
    accuracy = np.mean([r.prediction == r.label for r in rows])
    assert accuracy > 0.9 and len(rows) == len(y_test)


def test_a_factory_with_a_saved_state_dict_and_an_embedding_output(trained, test_frame, tmp_path):
    module, _, _ = trained
    torch.save(module.state_dict(), tmp_path / "weights.pt")

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    model = TorchModel.from_module(factory, state_dict=str(tmp_path / "weights.pt"), outputKind="embedding",
                                   predictionCol="embedding")
    rows = model.transform(test_frame).select("features", "embedding").collect()
    assert np.array_equal(np.array([r.embedding for r in rows], dtype=np.float32),
                          direct(module, [r.features for r in rows]).numpy())
    with pytest.raises(ValueError, match="the state dict does not fit the module the factory builds"):
        TorchModel.from_module(lambda: nn.Linear(64, 3), state_dict=str(tmp_path / "weights.pt"),
                               outputKind="embedding")


@pytest.mark.parametrize("kind", ["torchscript", "export"])
def test_torchscript_and_export_files_score_as_the_module_and_survive_save_and_load(kind, trained, test_frame,
                                                                                    tmp_path):
    module, x_test, _ = trained
    path = tmp_path / f"model.{kind}"
    if kind == "torchscript":
        torch.jit.save(torch.jit.script(module), str(path))
    else:
        example = torch.from_numpy(x_test[:4])
        torch.export.save(torch.export.export(module, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},)),
                          str(path))
    model = TorchModel.load_torch(path, outputKind="multiclass", rawPredictionCol="raw")
    rows = model.transform(test_frame).select("features", "raw").collect()
    expected = direct(module, [r.features for r in rows]).double().numpy()
    assert np.allclose([r.raw.toArray() for r in rows], expected, atol=1e-6)
    model.write().overwrite().save(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "program.pt").read_bytes() == path.read_bytes()
    loaded = TorchModel.load(str(tmp_path / "saved"))
    again = loaded.transform(test_frame).select("features", "raw").collect()
    assert [r.raw for r in again] == [r.raw for r in rows]
    assert torch.allclose(loaded.torch_module()(torch.from_numpy(x_test)), module(torch.from_numpy(x_test)),
                          atol=1e-6)


class CountingFactory:
    """Builds the digits classifier, and writes a line to ``log`` each time (one per Python worker that builds)."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __call__(self) -> nn.Module:
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()}\n")
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_later_transforms_of_the_same_model_reuse_the_workers_built_model(trained, test_frame, tmp_path,
                                                                        monkeypatch):
    module, _, _ = trained
    log = tmp_path / "builds.txt"
    model = TorchModel.from_module(CountingFactory(log), state_dict=module.state_dict(), outputKind="multiclass")
    log.unlink()                                                    # the driver's check of the state dict
    shipped = []
    share = ClassicBackend.share
    monkeypatch.setattr(ClassicBackend, "share", lambda self, data: shipped.append(len(data)) or share(self, data))
    predictions = []
    for call in range(6):           # 12 tasks over the session's few workers: transforms and the SQL function
        top = model.copy({model.topK: call})     # other output settings: the same model and weights
        scored = (top.transform(test_frame) if call % 2 else
                  test_frame.select(top.udf()("features").alias("out")).select("out.prediction"))
        predictions.append([r.prediction for r in scored.select("prediction").collect()])
    builders = log.read_text().splitlines()
    assert all(p == predictions[0] for p in predictions)
    assert len(builders) == len(set(builders))                      # no worker built it twice
    assert len(shipped) == 1                                        # nor did the driver ship it twice
    # weights changed in place are shipped anew, and score as they are now
    with torch.no_grad():
        model.state_dict["2.bias"].data[3] += 100.0
    changed = [r.prediction for r in model.transform(test_frame).select("prediction").collect()]
    assert len(shipped) == 2 and changed == [3.0] * len(changed)


def test_the_model_as_a_sql_function_gives_what_transform_adds(spark, trained, test_frame, tmp_path):
    module, _, _ = trained
    model = TorchModel.from_module(module, outputKind="multiclass", topK=2)
    expected = model.transform(test_frame).select("features", "prediction", "probability", "topK").collect()
    scored = test_frame.select("features", model.udf()("features").alias("out")).collect()
    assert [r.features for r in scored] == [r.features for r in expected]
    assert [r.out.prediction for r in scored] == [r.prediction for r in expected]
    assert [r.out.probability for r in scored] == [r.probability.toArray().tolist() for r in expected]
    assert [r.out.topK for r in scored] == [r.topK for r in expected]
    # over a columnar (Parquet) source, whose Arrow evaluation takes no Vector result: arrays
    test_frame.write.parquet(str(tmp_path / "test.parquet"))
    from_parquet = spark.read.parquet(str(tmp_path / "test.parquet"))
    assert sorted(r.out.probability for r in from_parquet.select(model.udf()("features").alias("out")).collect()) \
        == sorted(r.probability.toArray().tolist() for r in expected)
    # one output: the value itself, from Spark SQL after registration
    spark.udf.register("digit", model.copy({model.probabilityCol: "", model.topK: 0}).udf())
    test_frame.createOrReplaceTempView("digits_to_score")
    by_sql = spark.sql("SELECT digit(features) AS prediction FROM digits_to_score").collect()
    assert [r.prediction for r in by_sql] == [r.prediction for r in expected]


def test_the_sql_function_gives_invalid_rows_null_or_fails_and_refuses_to_skip(spark, trained):
    module, _, _ = trained
    rows = [([0.5] * 64,), (None,), ([float("nan")] + [0.5] * 63,), ([0.25] * 64,)]
    frame = spark.createDataFrame(rows, "features array<float>")
    kept = TorchModel.from_module(module, outputKind="regression", handleInvalid="keep")
    values = [r.out for r in frame.select(kept.udf()("features").alias("out")).collect()]
    assert values[1] is None and values[2] is None
    assert values[0] == pytest.approx(float(direct(module, [[0.5] * 64])[0, 0]), abs=1e-6)
    failing = TorchModel.from_module(module, outputKind="regression")
    with pytest.raises(Exception, match="row 1 of the partition has null"):
        frame.coalesce(1).select(failing.udf()("features")).collect()
    with pytest.raises(ValueError, match="a column function cannot drop rows"):
        TorchModel.from_module(module, outputKind="regression", handleInvalid="skip").udf()


def test_each_scoring_task_reports_its_rows_and_where_its_time_went(spark, trained, test_frame):
    from sparkdl import ClusterConfigError, scoring_report
    from sparkdl.ml._scoring_report import WORKER_LOGGING

    module, _, y_test = trained
    model = TorchModel.from_module(module, outputKind="multiclass")
    spark.conf.set(WORKER_LOGGING, "true")
    try:
        before = scoring_report(spark)
        model.transform(test_frame).write.format("noop").mode("overwrite").save()
        test_frame.select(model.udf()("features")).write.format("noop").mode("overwrite").save()
        after = scoring_report(spark)
    finally:
        spark.conf.unset(WORKER_LOGGING)
    partitions = test_frame.rdd.getNumPartitions()
    assert (after.rows - before.rows, after.tasks - before.tasks) == (2 * len(y_test), 2 * partitions)
    assert after.model_seconds > before.model_seconds and after.convert_seconds > before.convert_seconds
    assert after.seconds - before.seconds >= after.model_seconds - before.model_seconds
    with pytest.raises(ClusterConfigError, match=WORKER_LOGGING):
        scoring_report(spark)
