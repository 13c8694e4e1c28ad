"""An elastic async run that starts on a one-worker standalone cluster and gains a second worker mid-run.

Starts a Spark master and one worker (one core) on 127.0.0.1, trains digits with ``elastic=True``,
``num_workers=2``, ``min_workers=1`` (so worker 0 trains alone, worker 1's task waits for a slot), starts
a second worker once worker 0 has trained ``--join-after`` mini-batches, and prints one ``RESULT {json}``
line: the summary, the workers' summaries, the events and when the second worker was started.  So that
the two train side by side whatever the machine's speed, worker 0 then waits (at most 120 s) for
worker 1's first mini-batch before its next one.  Used by test_elastic_join.py.

    python tests/e2e/join_run.py --marker-dir DIR [--dynamic-allocation] [--work-units]

With ``--dynamic-allocation`` the application starts with no executor and asks for them as its stage
needs (``spark.dynamicAllocation.*``, shuffle tracking instead of an external shuffle service).
With ``--work-units`` the run has ``num_workers=1, max_workers=2``: its input is cut into work units,
one task per unit and epoch; task ``--join-after`` waits at its first mini-batch (at most 120 s) for a
later task to begin, which only the new executor can run while it holds the first one's only slot.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sparkdl  # noqa: E402
from sparkdl import TrainConfig, train  # noqa: E402
from sparkdl.models import mlp  # noqa: E402
from tests.e2e.standalone import StandaloneCluster  # noqa: E402


def report_progress(markers: Path, count: int, temporary: str) -> None:
    """Write ``count`` to ``markers/progress`` whole (a temporary file, renamed): its reader never sees half."""
    (markers / temporary).write_text(str(count))
    os.replace(markers / temporary, markers / "progress")


def wait_for_join(markers: Path) -> None:
    """Hold this mini-batch until the new executor's task has begun (``markers/joined``), at most 120 s."""
    deadline = time.monotonic() + 120
    while not (markers / "joined").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def make_model_fn(marker_dir: str, join_after: int):
    """The digits MLP.  On partition 0 each training mini-batch reports its count, and the one after
    ``join_after`` waits for partition 1's first; partition 1's first mini-batch says it has started."""

    class Reporting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(64, (64,), 10)
            self.calls = 0

        def forward(self, x):
            if self.training:
                from pyspark import TaskContext

                context = TaskContext.get()
                markers = Path(marker_dir)
                if context is not None and context.partitionId() == 0:
                    self.calls += 1
                    if self.calls % 10 == 0:
                        report_progress(markers, self.calls, "progress.tmp")
                    if self.calls == join_after + 1:
                        wait_for_join(markers)
                elif context is not None and context.partitionId() == 1 and self.calls == 0:
                    self.calls = 1
                    (markers / "joined").write_text("")
            return self.net(x)

    return Reporting


def make_unit_model_fn(marker_dir: str, join_after: int):
    """The digits MLP.  Each task writes its number plus one to ``progress`` at its first mini-batch; task
    ``join_after`` then waits for a later one's first mini-batch."""

    class ReportingUnits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(64, (64,), 10)
            self.started = False

        def forward(self, x):
            if self.training and not self.started:
                from pyspark import TaskContext

                self.started = True
                task, markers = TaskContext.get().partitionId(), Path(marker_dir)
                report_progress(markers, task + 1, f"progress.{task}")
                if task > join_after:
                    (markers / "joined").write_text("")
                elif task == join_after:
                    wait_for_join(markers)
            return self.net(x)

    return ReportingUnits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--marker-dir", required=True, type=Path)
    parser.add_argument("--join-after", type=int, default=50, help="worker 0's mini-batches before the new worker")
    parser.add_argument("--dynamic-allocation", action="store_true", help="executors as the stage needs them")
    parser.add_argument("--work-units", action="store_true", help="num_workers=1, max_workers=2: work units")
    args = parser.parse_args()
    logs = args.marker_dir / "logs"
    logs.mkdir(parents=True)
    with StandaloneCluster(logs) as cluster:
        cluster.add_worker("worker1", cores=1, memory="1500m")
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        conf = {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1", "spark.executor.cores": "1",
                "spark.executor.memory": "1g", "spark.cores.max": "2"}
        if args.dynamic_allocation:
            conf.update({"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.minExecutors": "0",
                         "spark.dynamicAllocation.maxExecutors": "2",
                         "spark.dynamicAllocation.shuffleTracking.enabled": "true"})
        spark = sparkdl.spark_session("sparkdl-join", master=cluster.master_url, conf=conf)
        spark.sparkContext.setLogLevel("ERROR")
        record: dict = {}
        joiner = threading.Thread(target=cluster.add_worker_when, daemon=True,
                                  args=(args.marker_dir / "progress", args.join_after, "worker2", record))
        joiner.start()
        model_fn = (make_unit_model_fn if args.work_units else make_model_fn)(str(args.marker_dir), args.join_after)
        workers = {"num_workers": 1, "max_workers": 2} if args.work_units else {"num_workers": 2, "min_workers": 1}
        result = train(spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2), model_fn,
                       TrainConfig(**workers, elastic=True, policy="async", epochs=5,
                                   batch_size=16, learning_rate=0.05, momentum=0.9,
                                   timeout_s=180))     # a worker may wait up to 120 s for the other: not silent
        joiner.join(timeout=1)
        print("RESULT " + json.dumps({"summary": result.summary, "workers": result.workers, "events": result.events,
                                      "attempts": len(result.attempts), "join": record,
                                      "accuracy": result.accuracy(model_fn, x, y)}, default=float), flush=True)
        spark.stop()


if __name__ == "__main__":
    main()
