"""A fitted TorchModel logged as an MLflow model: PyTorch flavor with a signature, plus the Spark model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

mlflow = pytest.importorskip("mlflow")

from sparkdl import TorchEstimator, TorchModel  # noqa: E402
from sparkdl.integrations import log_mlflow_model  # noqa: E402
from tests.conftest import DIGITS_MLP  # noqa: E402


def test_torch_model_logged_as_an_mlflow_model(spark, digits, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    x_train, x_test, y_train, _ = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train, y_train)],
                                  "features array<float>, label long")
    model = TorchEstimator(model=DIGITS_MLP, epochs=2, batchSize=32, learningRate=0.1, numWorkers=2).fit(frame)
    uri = log_mlflow_model(model, x_test[:5])
    served = mlflow.pytorch.load_model(uri)
    with torch.no_grad():
        expected = model.torch_module()(torch.from_numpy(x_test[:5])).numpy()
        assert np.allclose(served(torch.from_numpy(x_test[:5])).numpy(), expected, atol=1e-6)
    signature = mlflow.models.get_model_info(uri).signature
    assert list(signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 64]
    assert list(signature.outputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 10]
    # served as a generic python function, in the driver and as a Spark UDF: the same predictions
    pyfunc = mlflow.pyfunc.load_model(uri)
    assert np.allclose(np.asarray(pyfunc.predict(x_test[:5])), expected, atol=1e-6)
    udf = mlflow.pyfunc.spark_udf(spark, uri, result_type="array<float>", env_manager="local")
    rows = spark.createDataFrame([(row.tolist(),) for row in x_test[:5]], "features array<float>")
    served_by_spark = np.array([r[0] for r in rows.select(udf("features")).collect()])
    assert np.allclose(served_by_spark, expected, atol=1e-5)
    run_id = mlflow.last_active_run().info.run_id
    spark_model = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="model-spark")
    reloaded = TorchModel.load(spark_model)
    assert all(torch.equal(reloaded.state_dict[k], v) for k, v in model.state_dict.items())


def test_a_module_trained_elsewhere_logs_as_a_fitted_model_does(spark, digits, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    _, x_test, _, _ = digits
    torch.manual_seed(0)
    module = DIGITS_MLP().eval()
    uri = log_mlflow_model(TorchModel.from_module(module, outputKind="multiclass"), x_test[:5])
    with torch.no_grad():
        expected = module(torch.from_numpy(x_test[:5])).numpy()
        assert np.allclose(mlflow.pytorch.load_model(uri)(torch.from_numpy(x_test[:5])).numpy(), expected, atol=1e-6)
