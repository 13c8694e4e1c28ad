"""Side by side, in one process: plain PyTorch vs sparkdl with each policy on MNIST-5k.

    python benchmarks/throughput.py            (after `make data`)

Workload: MLP 784-256-128-10, SGD lr 0.05 momentum 0.9, global batch 64, 5 epochs; sparkdl
runs 2 workers x batch 32 on local[2].  Prints training samples/s (training loop only),
end-to-end train() seconds (SparkSession start excluded) and test accuracy, and writes
benchmarks/results/throughput.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))

from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

MODEL = functools.partial(mlp, 784, (256, 128), 10)
EPOCHS, GLOBAL_BATCH, LR, MOMENTUM = 5, 64, 0.05, 0.9


def sgd_epochs(model, optimizer, xs: torch.Tensor, ys: torch.Tensor, batch: int, epochs: int,
               generator: torch.Generator) -> None:
    """The plain training loop every reference run uses: shuffled mini-batches, cross-entropy, one step each."""
    for _ in range(epochs):
        order = torch.randperm(len(xs), generator=generator)
        for k in range(0, len(xs), batch):
            index = order[k:k + batch]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[index]), ys[index]).backward()
            optimizer.step()


def plain_pytorch(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, model_fn=MODEL,
                  global_batch: int = GLOBAL_BATCH) -> dict:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    start = time.perf_counter()
    sgd_epochs(model, optimizer, xs, ys, global_batch, EPOCHS, torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    with torch.inference_mode():
        accuracy = float((model.eval()(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    return {"name": "plain PyTorch (1 process, 2 threads)", "samples_per_second": len(x) * EPOCHS / seconds,
            "train_seconds": seconds, "test_accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--repeats", type=int, default=2, help="runs per sparkdl policy (best is kept)")
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"],
                        help="the workers' forward and loss (sparkdl runs only)")
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    rows = [plain_pytorch(x, y, x_test, y_test)]

    spark = sparkdl.spark_session("sparkdl-bench", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, optimizer="sgd",
                               learning_rate=LR, momentum=MOMENTUM, precision=args.precision)
    variants = {"sparkdl sync": {"policy": "sync"},
                "sparkdl async": {"policy": "async"},
                "sparkdl async, lr/tau": {"policy": "async", "staleness_lr": "inverse"},
                "sparkdl softsync c=2": {"policy": "softsync", "softsync_size": 2}}
    cold = sparkdl.train(data, MODEL, base.replace(policy="async"))   # first run: starts the Python workers
    rows.append({"name": "sparkdl async, first run (cold workers)",
                 "samples_per_second": cold.summary["samples_per_second"],
                 "train_seconds": cold.summary["train_seconds"],
                 "test_accuracy": cold.accuracy(MODEL, x_test, y_test)})
    for name, settings in variants.items():
        best = None
        for _ in range(args.repeats):
            result = sparkdl.train(data, MODEL, base.replace(**settings))
            if best is None or result.summary["train_seconds"] < best.summary["train_seconds"]:
                best = result
        summary = best.summary
        rows.append({"name": name, "samples_per_second": summary["samples_per_second"],
                     "train_seconds": summary["train_seconds"],
                     "test_accuracy": best.accuracy(MODEL, x_test, y_test),
                     "updates": summary["updates"], "staleness_mean": summary["staleness_mean"],
                     "bytes_pushed_per_step": summary["bytes_pushed"] / max(summary["pushes"], 1)})
    spark.stop()

    print(f"{'run':40s} {'samples/s':>10s} {'train() s':>10s} {'accuracy':>9s}")
    for row in rows:
        print(f"{row['name']:40s} {row['samples_per_second']:10.0f} {row['train_seconds']:10.2f} "
              f"{row['test_accuracy']:9.4f}")
    out = ROOT / "benchmarks" / "results" / "throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "cpus": torch.get_num_threads(),
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
