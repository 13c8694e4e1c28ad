"""Saving and loading a TorchModel read and write its files from the driver (no Spark job); older saved models still load."""
from __future__ import annotations

import functools
import json
import time
import uuid
from contextlib import contextmanager

import pytest
import torch
from pyspark.ml.util import DefaultParamsWriter

import sparkdl
from sparkdl import TorchEstimator, TorchModel
from sparkdl.ml._persistence import OBJECT_PARAMS, encode_object, object_params, state_to_bytes
from sparkdl.models import mlp

# ~1.2 MB of weights: as a one-row DataFrame this was a task Spark warns about ("very large size")
BIG_MLP = functools.partial(mlp, 784, (384,), 10)


def trained_looking_model() -> TorchModel:
    torch.manual_seed(0)
    state = BIG_MLP().state_dict()
    history = [{"version": v, "loss": 2.0 / v, "epoch": 0, "time_s": 0.1 * v} for v in range(1, 4)]
    gradients = [{"worker": w, "staleness": w, "accepted": True} for w in range(2)]
    model = TorchModel._from_saved(state, history, {"updates": 3, "task": "multiclass", "output_width": 10}, gradients)
    return model._set(model=BIG_MLP, featuresCol="pixels", predictionCol="digit")


def assert_same_model(loaded: TorchModel, model: TorchModel) -> None:
    assert loaded.uid == model.uid
    assert loaded.state_dict.keys() == model.state_dict.keys()
    assert all(torch.equal(loaded.state_dict[k], model.state_dict[k]) for k in model.state_dict)
    assert loaded._history_records == model._history_records and loaded._gradient_records == model._gradient_records
    assert loaded.summary == model.summary
    assert loaded.getFeaturesCol() == "pixels" and loaded.getPredictionCol() == "digit"
    assert loaded.getModel()().state_dict().keys() == model.state_dict.keys()


@contextmanager
def job_group(sc, group: str):
    sc.setJobGroup(group, group)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)


def test_save_and_load_run_no_spark_job_and_load_back_equal(spark, tmp_path):
    sc, model, path = spark.sparkContext, trained_looking_model(), str(tmp_path / "model")
    saving, loading, probe = (f"{what}-{uuid.uuid4().hex}" for what in ("save", "load", "probe"))
    with job_group(sc, saving):
        model.write().overwrite().save(path)
    with job_group(sc, loading):
        loaded = TorchModel.load(path)
    with job_group(sc, probe):
        sc.parallelize([1], 1).count()
    # the status tracker learns of jobs asynchronously but in order: once the probe's job is
    # visible, any job of the save or the load would be too
    deadline = time.monotonic() + 30
    while not sc.statusTracker().getJobIdsForGroup(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sc.statusTracker().getJobIdsForGroup(probe), "the probe saw no job at all"
    assert sc.statusTracker().getJobIdsForGroup(saving) == []
    assert sc.statusTracker().getJobIdsForGroup(loading) == []
    assert_same_model(loaded, model)
    # (the local Hadoop file system adds .crc checksum files)
    assert sorted(p.name for p in (tmp_path / "model").iterdir() if not p.name.startswith(".")) == [
        "metadata", "objects.json", "weights.pt"]
    metadata = json.loads((tmp_path / "model" / "metadata" / "part-00000").read_text())
    assert metadata["sparkdlFormat"] == 2 and metadata["class"] == "sparkdl.ml.model.TorchModel"


def test_an_existing_path_needs_overwrite(spark, tmp_path):
    model, path = trained_looking_model(), str(tmp_path / "model")
    model.write().save(path)
    with pytest.raises(FileExistsError, match=r"already exists; use write\(\)\.overwrite\(\)\.save\(path\)"):
        model.write().save(path)
    model.write().overwrite().save(path)
    assert_same_model(TorchModel.load(path), model)


def test_an_estimator_without_weights_round_trips(spark, tmp_path):
    estimator = TorchEstimator(model=BIG_MLP, epochs=7, loss=torch.nn.functional.l1_loss)
    estimator.write().save(str(tmp_path / "estimator"))
    loaded = TorchEstimator.load(str(tmp_path / "estimator"))
    assert loaded.getEpochs() == 7 and loaded.getLoss() is torch.nn.functional.l1_loss
    assert not (tmp_path / "estimator" / "weights.pt").exists()


def save_in_format_1(instance, path: str, spark) -> None:
    """How models were saved before: metadata, then one Parquet row holding everything else."""
    json_params = {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
    extra = {"sparkdlVersion": sparkdl.__version__, "torchVersion": torch.__version__}
    # a SparkContext: what every pyspark from 3.5 on takes there (4.x also takes a session)
    DefaultParamsWriter.saveMetadata(instance, path, spark.sparkContext, extraMetadata=extra, paramMap=json_params)
    row = {}
    for name, value in object_params(instance):
        row[f"{name}_kind"], row[name] = encode_object(value)
    row["state"] = state_to_bytes(instance.state_dict) if instance.state_dict is not None else None
    row["history"] = json.dumps(instance._history_records) if instance._history_records is not None else None
    row["summary"] = json.dumps(instance._summary, default=float)
    row["gradients"] = (json.dumps(instance._gradient_records, default=float)
                        if instance._gradient_records is not None else None)
    columns = ("model_kind", "model", "loss_kind", "loss", "state", "history", "summary", "gradients")
    schema = ("model_kind string, model binary, loss_kind string, loss binary, state binary, "
              "history string, summary string, gradients string")
    spark.createDataFrame([tuple(row[c] for c in columns)], schema).coalesce(1).write.parquet(f"{path}/data")


def test_a_model_saved_in_the_parquet_layout_still_loads(spark, tmp_path):
    model, path = trained_looking_model(), str(tmp_path / "old")
    save_in_format_1(model, path, spark)
    assert (tmp_path / "old" / "data").is_dir() and not (tmp_path / "old" / "weights.pt").exists()
    assert_same_model(TorchModel.load(path), model)
