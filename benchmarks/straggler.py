"""The straggler ("bucket") effect: one worker k times slower, time to a target test accuracy.

    python benchmarks/straggler.py [--target 0.90] [--slowdowns 1 3]

Workload W (MNIST-5k MLP, 2 workers, global batch 64, 5 epochs).  Worker 1 sleeps
(k - 1) x the measured mini-batch time after each of its mini-batches.  The PS writes a
checkpoint every 25 updates with its clock; each is scored on the test split afterwards, so
"time to target" is the PS time of the first checkpoint at or above the target.  allreduce
has no PS, so only its training time and final accuracy are reported.  Times count from
the first update (task start-up excluded).
Writes benchmarks/results/straggler.json and straggler.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl._internal.ps.server.checkpoint import list_checkpoints  # noqa: E402
from sparkdl._internal.training.flat import load_flat_parameters  # noqa: E402


def slow_model_fn(delay_s: float):
    """The W network; on partition 1 every training mini-batch is followed by ``delay_s`` of sleep."""

    class Straggling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MODEL()

        def forward(self, x):
            if self.training and delay_s > 0:
                from pyspark import TaskContext

                context = TaskContext.get()
                if context is not None and context.partitionId() == 1:
                    time.sleep(delay_s)
            return self.net(x)

    return Straggling


def accuracy_of(weights: torch.Tensor, x, y) -> float:
    model = MODEL()
    load_flat_parameters(model, weights)
    with torch.inference_mode():
        return float((model.eval()(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


#: the policies compared, by the name the results give them
POLICIES = {"sync": {"policy": "sync"}, "async": {"policy": "async"},
            "softsync c=2": {"policy": "softsync", "softsync_size": 2}, "allreduce": {"policy": "allreduce"}}


def time_to_target(data, model_fn, config: sparkdl.TrainConfig, x_test, y_test, target: float) -> dict:
    """Train ``config`` on ``data``; the PS time from the first update to the first checkpoint scoring
    ``target`` on the test split (None: never, or allreduce, which has no PS), the training and fit seconds,
    the final accuracy and the samples each worker drew."""
    folder = tempfile.mkdtemp(prefix="sparkdl-straggler-")
    if config.policy != "allreduce":
        config = config.replace(checkpoint_dir=folder, checkpoint_every=25, checkpoint_keep=100_000)
    result = sparkdl.train(data, model_fn, config)
    # PS clock from the first update on: task start-up is the same for every policy
    first_update = float(result.history["time_s"].iloc[0])
    reached = None
    for path in list_checkpoints(folder):
        snapshot = torch.load(path, weights_only=False)
        if accuracy_of(snapshot["weights"], x_test, y_test) >= target:
            reached = snapshot["time_s"] - first_update
            break
    return {"time_to_target_s": reached, "total_s": float(result.history["time_s"].iloc[-1]) - first_update,
            "fit_s": result.summary["train_seconds"], "final_accuracy": result.accuracy(model_fn, x_test, y_test),
            "samples_per_worker": [w["samples"] for w in result.workers]}


def describe(name: str, row: dict, target: float) -> str:
    reached = row["time_to_target_s"]
    return (f"{name:13s} time to {target:.2f}: {'n/a' if reached is None else f'{reached:6.2f} s'}  "
            f"training {row['total_s']:6.2f} s  fit {row['fit_s']:6.2f} s  final accuracy {row['final_accuracy']:.4f}"
            f"  samples per worker {row['samples_per_worker']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--slowdowns", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    spark = sparkdl.spark_session("sparkdl-straggler", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, optimizer="sgd",
                               learning_rate=LR, momentum=MOMENTUM)
    warm = sparkdl.train(data, MODEL, base.replace(policy="async"))
    # a mini-batch's full time on a worker: compute and its push/pull
    batch_s = max((w["compute_seconds"] + w["communication_seconds"]) / max(w["batches"], 1) for w in warm.workers)
    rows = []
    for k in args.slowdowns:
        for name, settings in POLICIES.items():
            row = time_to_target(data, slow_model_fn((k - 1) * batch_s), base.replace(**settings), x_test, y_test,
                                 args.target)
            rows.append({"slowdown": k, "policy": name, **row})
            print(f"k={k} {describe(name, row, args.target)}")
    spark.stop()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "straggler.json").write_text(json.dumps({"batch_seconds": batch_s, "target": args.target, "rows": rows},
                                                   indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name in POLICIES:
        points = [(r["slowdown"], r["time_to_target_s"] if r["time_to_target_s"] is not None else r["total_s"])
                  for r in rows if r["policy"] == name]
        axis.plot(*zip(*points), marker="o", label=name + (" (total time)" if name == "allreduce" else ""))
    axis.set(xlabel="slowdown k of one worker", ylabel=f"seconds to test accuracy {args.target}",
             title="straggler effect, workload W")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "straggler.png", dpi=100)
    print(f"-> {out / 'straggler.json'}, {out / 'straggler.png'}")


if __name__ == "__main__":
    main()
