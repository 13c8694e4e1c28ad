"""An executor that arrives mid-run: an elastic run that gains a second executor, against one executor throughout.

    python benchmarks/elastic_join.py [--epochs 120] [--batch-size 256] [--join-at 0.1]   (about 4 minutes)
    python benchmarks/elastic_join.py --work-units --epochs 30 --batch-size 64

LeNet on MNIST-5k (``sparkdl.models.lenet``: convolutions, so a worker's compute, not the PS, bounds a
step on two cores; W's MLP is PS-bound here, and a second worker does not speed it up), 2 async
workers x batch 256 (so that compute, not the exchange, fills a step), SGD lr 0.05 momentum 0.9, with ``elastic=True``,
``num_workers=2`` and ``min_workers=1``, on a Spark standalone master on 127.0.0.1 whose workers have
one core each (tests/e2e/standalone.py), a fresh cluster per run:

- "one executor": one worker throughout, so worker 1's task runs once worker 0's has ended: the two
  partitions are trained one after the other;
- "joins": one worker at the start and a second one started once worker 0 has trained ``--join-at``
  of the run's mini-batches; Spark launches worker 1's waiting task there and it joins the PS;
- "two executors": both workers from the start (the reference).

With ``--work-units`` the run has ``num_workers=1, max_workers=2`` instead: the input in 8 work units,
one task per unit and epoch (docs/guides/reliability.md, "work units"); "joins" starts the second worker
once ``--join-at`` of the run's tasks have begun, and the new executor takes the next units.

Each row gives the fit's seconds (``train()``, from its preflight to the result) and the test accuracy.
Writes benchmarks/results/elastic_join.json (elastic_join_units.json with ``--work-units``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import LR, MOMENTUM  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import lenet  # noqa: E402
from tests.e2e.standalone import StandaloneCluster  # noqa: E402

MODES = ("one executor", "joins", "two executors")


def reporting_model_fn(marker_dir: str, work_units: bool = False):
    """LeNet; on partition 0 it writes its mini-batch count every 10 mini-batches (work units: each task writes
    its number plus one as it begins)."""

    class Reporting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = lenet()
            self.calls = 0

        def forward(self, x):
            if self.training:
                from pyspark import TaskContext

                context = TaskContext.get()
                if context is not None and work_units and self.calls == 0:
                    self.calls = 1
                    progress = Path(marker_dir) / "progress"
                    temporary = progress.with_suffix(f".{context.partitionId()}")
                    temporary.write_text(str(context.partitionId() + 1))
                    os.replace(temporary, progress)
                elif context is not None and not work_units and context.partitionId() == 0:
                    self.calls += 1
                    if self.calls % 10 == 0:
                        progress = Path(marker_dir) / "progress"
                        progress.with_suffix(".tmp").write_text(str(self.calls))
                        os.replace(progress.with_suffix(".tmp"), progress)
            return self.net(x)

    return Reporting


def measure(mode: str, epochs: int, batch: int, join_at: float, data: tuple, work_units: bool = False) -> dict:
    x, y, x_test, y_test = data
    with tempfile.TemporaryDirectory(prefix="sparkdl-join-") as folder, StandaloneCluster(Path(folder)) as cluster:
        cluster.add_worker("worker1", cores=1, memory="1500m")
        if mode == "two executors":
            cluster.add_worker("worker2", cores=1, memory="1500m")
        spark = sparkdl.spark_session("sparkdl-elastic-join", master=cluster.master_url, conf={
            "spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1", "spark.executor.cores": "1",
            "spark.executor.memory": "1g", "spark.cores.max": "2"})
        spark.sparkContext.setLogLevel("ERROR")
        rdd = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2)
        record: dict = {}
        workers = {"num_workers": 1, "max_workers": 2} if work_units else {"num_workers": 2, "min_workers": 1}
        units = sparkdl.TrainConfig(**workers).work_units
        if mode == "joins":
            trigger = int(join_at * epochs * units) if work_units else int(join_at * epochs * len(x) / batch)
            threading.Thread(target=cluster.add_worker_when, args=(Path(folder) / "progress", trigger, "worker2", record),
                             daemon=True).start()
        model_fn = reporting_model_fn(folder, work_units)
        config = sparkdl.TrainConfig(**workers, elastic=True, policy="async", epochs=epochs,
                                     batch_size=batch, learning_rate=LR, momentum=MOMENTUM, timeout_s=120)
        started = time.perf_counter()
        result = sparkdl.train(rdd, model_fn, config)
        seconds = time.perf_counter() - started
        row = {"mode": mode, "fit_s": seconds, "test_accuracy": result.accuracy(model_fn, x_test, y_test),
               "late_joins": result.summary["late_joins"], "samples_consumed": result.summary["samples_consumed"],
               "samples_per_worker": [] if work_units else [w["samples"] for w in result.workers],
               "work_units": units, "peak_workers": result.summary["peak_workers"],
               "joined_at_version": next((e["version"] for e in result.events if e["event"] == "joined"), None),
               "updates": result.summary["updates"], **record}
        spark.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=256, help="per worker")
    parser.add_argument("--join-at", type=float, default=0.1, help="share of the run's mini-batches before the join")
    parser.add_argument("--work-units", action="store_true", help="num_workers=1, max_workers=2: work units")
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    rows = []
    for mode in MODES:
        row = measure(mode, args.epochs, args.batch_size, args.join_at, (x, y, x_test, y_test), args.work_units)
        rows.append(row)
        print(f"{mode:14s} fit {row['fit_s']:6.1f} s  test accuracy {row['test_accuracy']:.4f}  "
              f"samples per worker {row['samples_per_worker']}  joined at version {row['joined_at_version']}  "
              f"peak workers {row['peak_workers']}",
              flush=True)
    one = next(r for r in rows if r["mode"] == "one executor")
    for row in rows:
        row["speed_up_over_one_executor"] = one["fit_s"] / row["fit_s"]
    out = ROOT / "benchmarks" / "results" / ("elastic_join_units.json" if args.work_units else "elastic_join.json")
    out.write_text(json.dumps({"command": f"python benchmarks/elastic_join.py --epochs {args.epochs} --batch-size "
                                          f"{args.batch_size} --join-at {args.join_at}"
                                          + (" --work-units" if args.work_units else ""), "rows": rows},
                              indent=2) + "\n")
    print(json.dumps({r["mode"]: round(r["speed_up_over_one_executor"], 2) for r in rows}), f"-> {out}")


if __name__ == "__main__":
    main()
