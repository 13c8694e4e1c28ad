"""Encoded image columns on real Spark: MNIST-5k as PNG bytes, decoded and augmented on the workers."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from sparkdl import TorchEstimator, TorchModel
from sparkdl.models import lenet
from sparkdl.transforms import Compose, DecodeImages, RandomCrop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mnist_png(spark, tmp_path_factory):
    """MNIST-5k's train and test splits as DataFrames of (PNG bytes, label), written by the data job."""
    spec = importlib.util.spec_from_file_location("sparkdl_prepare_data", ROOT / "jobs" / "prepare_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    output = tmp_path_factory.mktemp("data")
    job.main(["--output", str(output), "--datasets", "mnist_png"])
    return (spark.read.parquet(str(output / "mnist_png" / "train.parquet")),
            spark.read.parquet(str(output / "mnist_png" / "test.parquet")))


def accuracy(scored) -> float:
    return scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]


def test_cnn_on_png_bytes_with_augmentation_from_disk(mnist_png, tmp_path):
    train, test = mnist_png
    assert dict(train.dtypes)["features"] == "binary"
    augment = Compose(DecodeImages("L"), RandomCrop(padding=2))
    model = TorchEstimator(model=lenet, numWorkers=2, updatePolicy="sync", epochs=8, batchSize=32,
                           learningRate=0.05, momentum=0.9, batchTransform=augment, dataCache="disk").fit(train)
    assert model.summary["data_cache"] == "disk"
    scored = model.transform(test)        # decoded by the same transform, without its random shift
    assert accuracy(scored) >= 0.93
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert accuracy(loaded.transform(test)) == accuracy(scored)


def test_encoded_bytes_without_a_transform_are_refused(mnist_png):
    train, _ = mnist_png
    with pytest.raises(ValueError, match="holds encoded bytes; set batchTransform"):
        TorchEstimator(model=lenet, numWorkers=2, epochs=1).fit(train)


def test_a_transform_that_fails_is_reported_before_training(mnist_png):
    train, _ = mnist_png
    with pytest.raises(ValueError, match="batchTransform fails on the first rows"):
        TorchEstimator(model=lenet, numWorkers=2, epochs=1, batchTransform=DecodeImages("no-such-mode")).fit(train)
