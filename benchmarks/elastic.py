"""An executor lost mid-run, elastic against barrier: time to the undisturbed run's accuracy.

    python benchmarks/elastic.py [--epochs 40] [--fractions 0.25 0.5 0.75]

Workload W (MNIST-5k MLP, global batch 64) with 4 async workers on ``local-cluster[4,1,1024]``,
40 epochs so that a run lasts long enough to lose a worker in, and the learning rate divided by
the staleness (Zhang et al.; four async workers with W's rate and momentum diverge: 0.10 test
accuracy after 5 epochs, against 0.917 with it).  Worker 1's executor JVM is
SIGKILLed once worker 1 has trained a fraction of its undisturbed mini-batches; the run is
once ``elastic=True`` (Spark re-runs that task alone) and once a barrier stage (every task
restarts from the PS's state).  The PS writes a checkpoint every 25 updates with its clock;
each is scored on the test split afterwards, so "time to target" is the PS time of the first
checkpoint at or above the target: the undisturbed run's final accuracy less half a point
(async runs differ by about that much with how the workers interleave).
Writes benchmarks/results/elastic.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from straggler import accuracy_of  # noqa: E402
from throughput import GLOBAL_BATCH, LR, MODEL, MOMENTUM  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl._internal.ps.server.checkpoint import list_checkpoints  # noqa: E402

WORKERS = 4


def executor_jvm(pid: int) -> int | None:
    """The executor JVM that (through pyspark's daemon) started process ``pid``; None once it is gone."""
    while pid > 1:
        if b"CoarseGrainedExecutorBackend" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def reporting_model_fn(marker_dir: str):
    """The W network; on partition 1 it writes its executor JVM's pid and its mini-batch count."""

    class Reporting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MODEL()
            self.calls = 0

        def forward(self, x):
            if self.training:
                from pyspark import TaskContext

                context = TaskContext.get()
                if context is not None and context.partitionId() == 1:
                    self.calls += 1
                    jvm = executor_jvm(os.getpid()) if self.calls % 5 == 1 else None
                    if jvm:
                        path = Path(marker_dir) / f"{context.taskAttemptId()}.progress"
                        path.with_suffix(".tmp").write_text(f"{jvm} {self.calls}")
                        os.replace(path.with_suffix(".tmp"), path)
            return self.net(x)

    return Reporting


def kill_at(marker_dir: Path, batches: int, record: dict, stop: threading.Event) -> None:
    """SIGKILL worker 1's executor JVM once it has trained ``batches`` mini-batches."""
    while not stop.wait(0.01):
        for path in marker_dir.glob("*.progress"):
            try:
                pid, done = map(int, path.read_text().split())
            except (ValueError, FileNotFoundError):
                continue
            if done >= batches:
                os.kill(pid, signal.SIGKILL)
                record.update(killed_after_batches=done)
                return


def run(data, config: sparkdl.TrainConfig, x_test, y_test, kill_batches: int | None, target: float | None) -> dict:
    marker = Path(tempfile.mkdtemp(prefix="sparkdl-elastic-marker-"))
    folder = tempfile.mkdtemp(prefix="sparkdl-elastic-")
    record: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=kill_at, args=(marker, kill_batches, record, stop), daemon=True)
    if kill_batches is not None:
        killer.start()
    model_fn = reporting_model_fn(str(marker))
    started = time.perf_counter()
    result = sparkdl.train(data, model_fn, config.replace(checkpoint_dir=folder, checkpoint_every=25,
                                                          checkpoint_keep=100_000))
    wall = time.perf_counter() - started
    stop.set()
    first_update = float(result.history["time_s"].iloc[0])
    reached = None
    if target is not None:
        for path in list_checkpoints(folder):
            snapshot = torch.load(path, weights_only=False)
            if accuracy_of(snapshot["weights"], x_test, y_test) >= target:
                reached = snapshot["time_s"] - first_update
                break
    lost = sorted({e["worker"] for e in result.events if e["event"] == "lost"})
    return {"elastic": config.elastic, "killed_after_batches": record.get("killed_after_batches"),
            "time_to_target_s": reached, "training_s": float(result.history["time_s"].iloc[-1]) - first_update,
            "wall_s": wall, "final_accuracy": result.accuracy(model_fn, x_test, y_test),
            "stage_attempts": len(result.attempts), "workers_lost": lost,
            "worker1_batches": next(w["batches"] for w in result.workers if w["worker"] == 1),
            "samples": result.summary["samples_consumed"], "sample_budget": result.summary["sample_budget"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=LR,
                        help="lower than W's, the accuracy climbs through the whole run (the kills fall before the target)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    spark = sparkdl.spark_session("sparkdl-elastic", master=f"local-cluster[{WORKERS},1,1024]",
                                  conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), WORKERS)
    base = sparkdl.TrainConfig(num_workers=WORKERS, policy="async", epochs=args.epochs,
                               batch_size=GLOBAL_BATCH // WORKERS, optimizer="sgd", learning_rate=args.learning_rate,
                               momentum=MOMENTUM, staleness_lr="inverse", timeout_s=60, max_attempts=3)
    undisturbed = run(data, base.replace(elastic=True), x_test, y_test, None, None)
    target = undisturbed["final_accuracy"] - 0.005
    undisturbed = run(data, base.replace(elastic=True), x_test, y_test, None, target)   # timed against the target
    print(f"undisturbed: to {target:.4f} in {undisturbed['time_to_target_s']:.2f} s, training "
          f"{undisturbed['training_s']:.2f} s, accuracy {undisturbed['final_accuracy']:.4f}", flush=True)
    rows = [{"fraction": 0.0, **undisturbed}]
    for fraction in args.fractions:
        for elastic in (True, False):
            kill = max(1, int(fraction * undisturbed["worker1_batches"]))
            row = {"fraction": fraction, **run(data, base.replace(elastic=elastic), x_test, y_test, kill, target)}
            rows.append(row)
            ratio = (row["time_to_target_s"] / undisturbed["time_to_target_s"]
                     if row["time_to_target_s"] is not None else None)
            reached = "n/a" if ratio is None else f"{row['time_to_target_s']:6.2f} s ({ratio:.2f}x)"
            print(f"killed at {fraction:.0%} {'elastic' if elastic else 'barrier':8s}: to target {reached}, training "
                  f"{row['training_s']:6.2f} s ({row['training_s'] / undisturbed['training_s']:.2f}x), "
                  f"stage attempts {row['stage_attempts']}, lost {row['workers_lost']}, "
                  f"accuracy {row['final_accuracy']:.4f}", flush=True)
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "elastic.json"
    out.write_text(json.dumps({"command": "python benchmarks/elastic.py " + " ".join(sys.argv[1:]),
                               "workers": WORKERS, "epochs": args.epochs, "learning_rate": args.learning_rate,
                               "target": target, "rows": rows},
                              indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
