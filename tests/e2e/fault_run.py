"""Train digits twice on local-cluster: undisturbed, then with one worker's Python process
SIGKILLed mid-training.  Each RUN (its own flags, quoted) trains in the same session, one after
another; each prints one ``RESULT {json}`` line with both outcomes (or the error it raised).
Used by test_faults.py, which runs all of its runs in one process: one cluster start for all.

    python tests/e2e/fault_run.py --marker-dir DIR "--policy sync [--data-cache disk] [--ps-shards 2]" ...
    python tests/e2e/fault_run.py --marker-dir DIR "--policy async --elastic --kill executor [--table]"

With ``--ps-shards`` the PS is sharded over the barrier tasks: the killed task also hosts shard 1.
With ``--kill executor`` the worker's whole executor JVM is killed, not only its Python process
(the cluster's worker starts another executor in its place, for the runs after it).
With ``--table`` the model also looks up an embedding table (``sparse=True``: held by the PS as rows)
and each run writes checkpoints under the marker directory; the result gives the final checkpoint's
updates and the table's row updates.
"""
from __future__ import annotations

import argparse
import functools
import os
import shlex
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from script_results import report_each  # this directory: the script runs from it
from torch import nn

import sparkdl
from sparkdl import TrainConfig, train
from sparkdl.models import mlp


def executor_jvm(pid: int) -> int | None:
    """The executor JVM that (through pyspark's daemon) started process ``pid``; None once it is gone
    (a Python worker outlives its killed JVM for a moment)."""
    while pid > 1:
        if b"CoarseGrainedExecutorBackend" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


#: the table's ids: 8 pixels of the 8x8 digit, each quantised to 17 levels, a range of ids per pixel
TABLE_PIXELS, LEVELS, TABLE_DIM = tuple(range(18, 26)), 17, 4


def make_model_fn(marker_dir: str, kill: str = "python", table: bool = False, partition: int = 1):
    """An MLP whose replica on ``partition`` reports the process to kill (its own, or with ``kill="executor"``
    its executor's JVM) and its progress to ``marker_dir``; with ``table`` it also embeds 8 quantised
    pixels through a table of 8 x 17 rows held by the PS."""

    class Reporting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width = len(TABLE_PIXELS) * TABLE_DIM if table else 0
            self.net = mlp(64 + width, (64,), 10)
            self.table = nn.Embedding(len(TABLE_PIXELS) * LEVELS, TABLE_DIM, sparse=True) if table else None
            self.calls = 0

        def forward(self, x):
            if self.table is not None:
                levels = (x[:, list(TABLE_PIXELS)] * (LEVELS - 1)).round().long()
                ids = levels + LEVELS * torch.arange(len(TABLE_PIXELS))
                x = torch.cat([x, self.table(ids).flatten(1)], 1)
            if self.training:
                from pyspark import TaskContext

                context = TaskContext.get()
                if context is not None and context.partitionId() == partition:
                    self.calls += 1
                    victim = None
                    if partition != 1:   # a unit's pass takes 12 mini-batches: slow enough to be killed mid-pass
                        time.sleep(0.1)
                    if self.calls % 10 == 1 or partition != 1:
                        victim = executor_jvm(os.getpid()) if kill == "executor" else os.getpid()
                    if victim:   # written whole (temp + rename): the reader never sees half
                        path = Path(marker_dir) / f"{context.taskAttemptId()}.progress"
                        temporary = path.with_suffix(".tmp")
                        temporary.write_text(f"{victim} {self.calls}")
                        os.replace(temporary, path)
            return self.net(x)

    return Reporting


def kill_when(marker_dir: Path, calls: int, record: dict) -> None:
    """SIGKILL the first reporting worker once it has trained ``calls`` mini-batches."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for path in sorted(marker_dir.glob("*.progress")):
            try:
                pid, done = map(int, path.read_text().split())
            except (ValueError, FileNotFoundError):
                continue
            if done >= calls:
                os.kill(pid, signal.SIGKILL)
                record.update(killed_pid=pid, killed_after_batches=done, kill_wall_time=time.time())
                return
        time.sleep(0.02)


def run_parser() -> argparse.ArgumentParser:
    """The flags of one run."""
    parser = argparse.ArgumentParser(prog="RUN")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--data-cache", default="auto", choices=["auto", "memory", "disk"])
    parser.add_argument("--ps-shards", type=int, default=0, help="executor-hosted PS shards (0: the driver PS)")
    parser.add_argument("--elastic", action="store_true", help="a plain stage: Spark re-runs the lost task alone")
    parser.add_argument("--kill", default="python", choices=["python", "executor"], help="what is SIGKILLed")
    parser.add_argument("--shuffled", action="store_true", help="three input partitions: repartitioned into two")
    parser.add_argument("--table", action="store_true", help="an embedding table held by the PS as rows")
    parser.add_argument("--faulty-only", action="store_true",
                        help="no undisturbed run first (for a test that compares nothing with one)")
    parser.add_argument("--work-units", action="store_true",
                        help="max_workers=2: 8 work units (the input in 8 partitions, no shuffle); the task of epoch "
                             "3's unit 5 is killed after 5 mini-batches")
    return parser


def clean_and_faulty(spark, args: argparse.Namespace, marker_dir: Path, digits: tuple) -> dict:
    """One run: train undisturbed (unless ``--faulty-only``), then with worker 1 killed after 150 mini-batches."""
    x_train, x_test, y_train, y_test = digits
    units = TrainConfig(max_workers=2).work_units if args.work_units else 0
    rdd = spark.sparkContext.parallelize(list(zip(x_train, y_train.tolist())),
                                         units or (3 if args.shuffled else 2))
    config = TrainConfig(num_workers=2, policy=args.policy, epochs=10, batch_size=16, learning_rate=0.05,
                         momentum=0.9, timeout_s=30, max_attempts=3, data_cache=args.data_cache, elastic=args.elastic,
                         max_workers=2 if units else None)
    # the reporting task: worker 1, or (work units) the task of epoch 3's unit 5, killed after 5 mini-batches
    partition, kill_after = (3 * units + 5, 5) if units else (1, 150)
    if args.ps_shards:
        config = config.replace(ps_shards=args.ps_shards, ps_hosts="executors", shard_snapshot_every=20)
    clean_dir, faulty_dir = marker_dir / "clean", marker_dir / "faulty"
    clean_dir.mkdir(parents=True)
    faulty_dir.mkdir(parents=True)

    def config_for(folder: Path) -> TrainConfig:
        return config.replace(checkpoint_dir=str(folder / "checkpoints"), checkpoint_every=50) if args.table else config

    clean_fn = make_model_fn(str(clean_dir), args.kill, args.table, partition)
    clean = None if args.faulty_only else train(rdd, clean_fn, config_for(clean_dir))
    record: dict = {}
    killer = threading.Thread(target=kill_when, args=(faulty_dir, kill_after, record), daemon=True)
    killer.start()
    faulty_fn = make_model_fn(str(faulty_dir), args.kill, args.table, partition)
    faulty = train(rdd, faulty_fn, config_for(faulty_dir))
    killer.join(timeout=1)
    if not record:
        raise RuntimeError("the worker was never killed: the faulty run finished first")
    rejoined = [e for e in faulty.events if e["event"] == "rejoined"]
    runs = ([] if clean is None else [("clean", clean_dir, clean, clean_fn)]) + [
        ("faulty", faulty_dir, faulty, faulty_fn)]
    out = {
        "policy": args.policy,
        **{name: {"accuracy": run.accuracy(fn, x_test, y_test), **run.summary} for name, _, run, fn in runs},
        "events": faulty.events,
        # per parameter tensor: sum and norm, to compare the two runs' final weights
        "weights": {name: [[float(t.double().sum()), float(t.double().norm())] for t in run.state_dict.values()]
                    for name, _, run, _ in runs},
        "workers": faulty.workers,
        "kill": record,
        "seconds_kill_to_rejoin": (rejoined[0]["wall_time"] - record["kill_wall_time"]) if rejoined and record else None,
    }
    out["faulty"]["stage_attempts"] = len(faulty.attempts)
    if units:
        out["unit_reads"] = unit_reads(spark, config)
    if args.table:
        from sparkdl._internal.ps.server.checkpoint import list_checkpoints

        for name, folder, run, _ in runs:
            final = torch.load(list_checkpoints(str(folder / "checkpoints"))[-1], weights_only=False)
            torch.manual_seed(config.seed)     # the driver builds the model's initial rows under the run's seed
            initial = make_model_fn(str(folder), args.kill, True, partition)().table.weight.detach()
            out[name]["table"] = {"checkpoint_updates": final["updates"], "row_updates": final["tables"][0]["steps"],
                                  "rows_moved": int((final["tables"][0]["weight"] != initial).any(1).sum()),
                                  "equals_result": bool(torch.equal(final["tables"][0]["weight"],
                                                                    run.state_dict["table.weight"]))}
    return out


def unit_reads(spark, config: TrainConfig) -> dict:
    """Per input kind (an RDD, a DataFrame, each behind the units' shuffle over two executors): how many of the
    later epochs' unit partitions hold the rows of epoch 0's, and how many in the same order, of how many."""
    from sparkdl._internal.modes.parameter_server.work_units import unit_dataframe, unit_rdd

    units, epochs = config.work_units, config.epochs
    copies = {"rdd": unit_rdd(spark.sparkContext.parallelize(range(20_000), 4), config),
              "dataframe": unit_dataframe(spark.range(20_000).repartition(4), config).rdd.map(lambda row: row.id)}
    out = {}
    for kind, data in copies.items():
        parts = data.glom().collect()
        later = [(parts[e * units + u], parts[u]) for e in range(1, epochs) for u in range(units)]
        out[kind] = {"same_rows": sum(sorted(a) == sorted(b) for a, b in later),
                     "same_order": sum(a == b for a, b in later), "of": len(later)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker-dir", required=True, type=Path)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="one run's flags, quoted (see run_parser)")
    args = parser.parse_args()
    runs = [run_parser().parse_args(shlex.split(flags)) for flags in args.runs]   # every run's flags, checked first
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    digits = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    spark = sparkdl.spark_session("sparkdl-faults", master="local-cluster[2,1,1024]",
                                  conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    report_each({flags: functools.partial(clean_and_faulty, spark, run, args.marker_dir / f"run{number}", digits)
                 for number, (flags, run) in enumerate(zip(args.runs, runs))})
    spark.stop()


if __name__ == "__main__":
    main()
