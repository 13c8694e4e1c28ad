"""A real Spark standalone cluster (master + worker processes) runs spark-submit jobs/train.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark
import pytest

ROOT = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).resolve().parent
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory):
    """Master and one worker (2 cores) on 127.0.0.1, stopped by their PIDs afterwards."""
    logs = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOG_DIR": str(logs), "SPARK_NO_DAEMONIZE": "1"}
    port, ui, worker_ui = free_port(), free_port(), free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    processes = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                   "--port", str(port), "--webui-port", str(ui)], env=env,
                                  stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)]
    try:
        wait_for_port(port)
        processes.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}", "--host", "127.0.0.1",
             "--cores", "2", "--memory", "3g", "--webui-port", str(worker_ui), "--work-dir", str(logs / "work")],
            env=env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 90
        while "Successfully registered with master" not in (logs / "worker.log").read_text():
            assert time.monotonic() < deadline, (logs / "worker.log").read_text()[-3000:]
            assert processes[-1].poll() is None, (logs / "worker.log").read_text()[-3000:]
            time.sleep(0.3)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for process in reversed(processes):
            os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)



def test_spark_submit_to_a_standalone_cluster(standalone_cluster, digits_parquet, tmp_path):
    output = tmp_path / "run"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    command = [str(Path(sys.executable).parent / "spark-submit"), "--master", standalone_cluster,
               "--properties-file", str(ROOT / "conf" / "standalone.properties"),
               "--conf", "spark.driver.host=127.0.0.1",
               str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "conf" / "digits_async.toml"),
               "--set", f"data.train='{digits_parquet / 'train.parquet'}'",
               "--set", f"data.test='{digits_parquet / 'test.parquet'}'", "--output", str(output)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["master"] == standalone_cluster
    assert metrics["test_accuracy"] >= 0.93
    # the live progress line reached the terminal, with the sample rate (spark-submit merges the
    # Python driver's stderr into its own stdout)
    output_text = done.stdout + done.stderr
    assert "sparkdl async x2" in output_text and "samples/s=" in output_text
