"""A real Spark standalone cluster (master + worker processes) runs spark-submit jobs/train.py (the RDD API)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ASYNC_ACCURACY
from .standalone import StandaloneCluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory):
    """Master and one worker (2 cores) on 127.0.0.1, stopped by their PIDs afterwards."""
    with StandaloneCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        cluster.add_worker("worker", cores=2, memory="3g")
        yield cluster.master_url


def test_spark_submit_to_a_standalone_cluster(standalone_cluster, digits_parquet, tmp_path):
    output = tmp_path / "run"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    command = [str(Path(sys.executable).parent / "spark-submit"), "--master", standalone_cluster,
               "--properties-file", str(ROOT / "conf" / "standalone.properties"),
               "--conf", "spark.driver.host=127.0.0.1",
               str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "conf" / "digits_async.toml"),
               "--set", f"data.train='{digits_parquet / 'train.parquet'}'",
               "--set", f"data.test='{digits_parquet / 'test.parquet'}'", "--api", "rdd", "--output", str(output)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["master"] == standalone_cluster and metrics["api"] == "rdd" and metrics["policy"] == "async"
    assert metrics["test_accuracy"] >= ASYNC_ACCURACY, metrics
    assert (output / "model.pt").stat().st_size > 0
    assert len((output / "history.csv").read_text().splitlines()) == metrics["updates"] + 1
    # the live progress line reached the terminal, with the sample rate (spark-submit merges the
    # Python driver's stderr into its own stdout); not a terminal: plain lines, not a bar redrawn
    # with carriage returns
    output_text = done.stdout + done.stderr
    assert "sparkdl async x2" in output_text and "samples/s=" in output_text
    progress = [line for line in output_text.split("\n") if "sparkdl async x2" in line]
    assert progress and not any("\r" in line for line in progress), progress[:3]
    # async trains to a global sample budget: the last line counts it spent
    assert re.match(r"sparkdl async x2: ([\d,]+)/\1 samples \(100%\) epoch=", progress[-1]), progress[-1]
