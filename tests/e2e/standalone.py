"""A Spark standalone cluster on 127.0.0.1 for end-to-end tests: a master, and workers added at any time.

    with StandaloneCluster(logs) as cluster:
        cluster.add_worker("worker1", cores=1, memory="1500m")
        ... SparkSession with master=cluster.master_url ...

Every process it starts is stopped (SIGTERM, then SIGKILL) when the block ends, however it ends.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).resolve().parent


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


class StandaloneCluster:
    """A master on 127.0.0.1 (started on entry) and the workers :meth:`add_worker` starts; logs in ``logs``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.port = free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()        # workers may be added from another thread mid-run
        self._stopped = False

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOG_DIR": str(self.logs), "SPARK_NO_DAEMONIZE": "1"}
        with self._lock:      # a process started once stop() has run would outlive the cluster
            if self._stopped:
                raise RuntimeError("the standalone cluster is stopped")
            with open(self.logs / log, "w") as out:
                process = subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            self.processes.append(process)
            # for whoever must clean up after a process that ran this cluster and was killed
            with open(self.logs / "pids", "a") as pids:
                pids.write(f"{process.pid}\n")
        return process

    def __enter__(self) -> StandaloneCluster:
        try:
            self._start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.port),
                         "--webui-port", str(free_port())], "master.log")
            wait_for_port(self.port)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_worker(self, name: str, cores: int, memory: str) -> None:
        """Start a worker of ``cores`` cores and wait until the master has registered it."""
        log = self.logs / f"{name}.log"
        process = self._start(["org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                               "--cores", str(cores), "--memory", memory, "--webui-port", str(free_port()),
                               "--work-dir", str(self.logs / f"{name}-work")], log.name)
        deadline = time.monotonic() + 90
        while "Successfully registered with master" not in log.read_text():
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"standalone worker {name} did not register:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def add_worker_when(self, progress: Path, count: int, name: str, record: dict, timeout: float = 1800) -> None:
        """Start a one-core worker ``name`` once the number written in ``progress`` reaches ``count`` (run it in a
        thread beside a fit); ``record`` gets the count it started at and the wall times of its start and
        registration."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopped:   # a run that ended first needs no worker
            try:
                done = int(progress.read_text())
            except (FileNotFoundError, ValueError):
                done = 0
            if done >= count:
                record.update(started_after=done, start_wall_time=time.time())
                try:
                    self.add_worker(name, cores=1, memory="1500m")
                except RuntimeError:
                    if self._stopped:     # the run ended while the worker was starting
                        return
                    raise
                record["registered_wall_time"] = time.time()
                return
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every process, workers first."""
        with self._lock:
            self._stopped = True
            processes, self.processes = list(reversed(self.processes)), []
        for process in processes:
            kill_group(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(process.pid, signal.SIGKILL)


def kill_group(pid: int, sig: int) -> None:
    """Signal the process group ``pid`` leads (each cluster process leads its own), if it is still there."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def kill_leftovers(logs: Path) -> None:
    """Kill every process a :class:`StandaloneCluster` with these ``logs`` started (after its owner was killed)."""
    pids = logs / "pids"
    for line in pids.read_text().split() if pids.exists() else []:
        kill_group(int(line), signal.SIGKILL)
