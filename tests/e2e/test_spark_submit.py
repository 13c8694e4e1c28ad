"""spark-submit jobs/train.py on local-cluster (separate executor JVMs and Python workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ASYNC_ACCURACY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def spark_submit() -> str:
    return str(Path(sys.executable).parent / "spark-submit")



SUBMIT_ENV = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def submit(script: str, *args: str, master: str = "local-cluster[2,1,1024]") -> subprocess.CompletedProcess:
    command = [spark_submit(), "--master", master, "--properties-file", str(ROOT / "conf" / "local.properties"),
               str(ROOT / "jobs" / script), *args]
    return subprocess.run(command, env=SUBMIT_ENV, capture_output=True, text=True, timeout=600)


def train_on_local_cluster(output: Path, digits: Path, policy: str, api: str, *extra: str
                           ) -> subprocess.CompletedProcess:
    return submit("train.py", "--config", str(ROOT / "conf" / "digits_async.toml"), "--api", api,
                  "--set", f"data.train='{digits / 'train.parquet'}'",
                  "--set", f"data.test='{digits / 'test.parquet'}'",
                  "--set", f"train.policy='{policy}'", "--output", str(output), *extra)


def check_trained(output: Path, done: subprocess.CompletedProcess, policy: str, api: str) -> None:
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["master"] == "local-cluster[2,1,1024]" and metrics["api"] == api
    assert metrics["policy"] == policy and metrics["num_workers"] == 2
    # the effective settings, every field of TrainConfig
    assert metrics["config"]["policy"] == policy and metrics["config"]["compression"] == "none"
    assert metrics["test_accuracy"] >= 0.93, metrics
    assert metrics["train_seconds"] > 0 and metrics["samples_per_second"] > 0
    assert (output / "model.pt").stat().st_size > 0
    assert len((output / "history.csv").read_text().splitlines()) == metrics["updates"] + 1


@pytest.fixture(scope="module")
def quiet_dataframe_run(tmp_path_factory, digits_parquet) -> tuple[Path, subprocess.CompletedProcess]:
    """sync through the DataFrame API with --quiet; its saved model is scored by predict.py below.  (The
    RDD API, async and the progress lines run on the standalone cluster: test_standalone_cluster.py.)"""
    output = tmp_path_factory.mktemp("submitted") / "run"
    return output, train_on_local_cluster(output, digits_parquet, "sync", "dataframe", "--quiet")


def test_spark_submit_train_dataframe_quietly(quiet_dataframe_run):
    output, done = quiet_dataframe_run
    check_trained(output, done, "sync", "dataframe")
    assert "samples/s=" not in done.stdout + done.stderr      # --quiet: no progress lines


def test_python_jobs_train_uses_local_properties(tmp_path, digits_parquet):
    output = tmp_path / "run"
    command = [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "conf" / "digits_async.toml"),
               "--set", f"data.train='{digits_parquet / 'train.parquet'}'",
               "--set", f"data.test='{digits_parquet / 'test.parquet'}'",
               "--set", "train.epochs=8", "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["master"] == "local[2]" and metrics["epochs"] == 8
    assert metrics["test_accuracy"] >= ASYNC_ACCURACY, metrics
    # history.csv: one row per PS update with the documented columns; history.png a real image
    import pandas as pd
    from matplotlib.image import imread

    history = pd.read_csv(output / "history.csv")
    assert list(history.columns) == ["version", "time_s", "epoch", "loss", "samples", "gradients", "staleness_mean",
                                     "staleness_max", "lr_scale", "lr", "samples_per_s"]
    assert len(history) == metrics["updates"] and list(history["version"]) == list(range(1, len(history) + 1))
    png = (output / "history.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(output / "history.png")
    assert image.shape[0] > 100 and image.shape[1] > 300 and image.std() > 0
    assert "test_accuracy=" in done.stdout


def test_spark_submit_predict_with_a_saved_model(tmp_path, digits_parquet, quiet_dataframe_run):
    import pyarrow.parquet as pq

    run, trained = quiet_dataframe_run
    assert trained.returncode == 0, trained.stderr[-5000:]
    scored_dir = tmp_path / "scored"
    done = submit("predict.py", "--model", str(run / "model"), "--input", str(digits_parquet / "test.parquet"),
                  "--output", str(scored_dir))
    assert done.returncode == 0, done.stderr[-5000:]
    scored = pq.read_table(scored_dir).to_pandas()
    assert len(scored) == 360 and {"features", "label", "prediction", "probability"} <= set(scored.columns)
    accuracy = (scored["prediction"] == scored["label"]).mean()
    assert accuracy >= 0.93
    assert abs(accuracy - json.loads((run / "metrics.json").read_text())["test_accuracy"]) < 1e-9
