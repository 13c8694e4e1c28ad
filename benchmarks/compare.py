"""Workload W side by side in one session: plain PyTorch, Spark's TorchDistributor, sparkdl.

    python benchmarks/compare.py            (after `make data`; about ten minutes)

W: MNIST-5k (4000 train / 1000 test), MLP 784-256-128-10, SGD lr 0.05 momentum 0.9, global
batch 64, 5 epochs, 2 workers on local[2].  For each run: training-loop samples/s, end-to-end
seconds (SparkSession start excluded), test accuracy, bytes sent per step.  Then the same
training with two larger MLPs (784-1024-1024-10, 1.9M parameters; 784-2048-2048-2048-10, 10M)
for plain PyTorch, TorchDistributor and sparkdl's sync, async and allreduce.  Writes
benchmarks/results/compare.json and compare.png.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM, plain_pytorch  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

#: the model sizes compared: hidden layers of the MLP (784 inputs, 10 classes)
SIZES = {"0.24M": (256, 128), "1.9M": (1024, 1024), "10M": (2048, 2048, 2048)}


def distributor_train(train_path: str, test_path: str, hidden: tuple[int, ...] = (256, 128)) -> dict:
    """Runs inside TorchDistributor's processes: DDP over gloo, the same workload."""
    import os
    import time

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl.models import mlp

    def load(path):
        table = pq.read_table(path)
        return (np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float32),
                table.column("label").to_numpy())

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = load(train_path)
    xs, ys = torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world])
    model = DistributedDataParallel(mlp(784, hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 64 // world
    generator = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(5):
        order = torch.randperm(len(xs), generator=generator)
        for k in range(0, len(xs), batch):
            index = order[k:k + batch]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[index]), ys[index]).backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    accuracy = None
    if rank == 0:
        x_test, y_test = load(test_path)
        with torch.inference_mode():
            accuracy = float((model.module.eval()(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())
    return {"loop_seconds": seconds, "samples": len(x) * 5, "accuracy": accuracy, "params": params,
            "pid": os.getpid()}


def run_distributor(spark, data: str, hidden: tuple[int, ...] = (256, 128)) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    start = time.perf_counter()
    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        distributor_train, f"{data}/train.parquet", f"{data}/test.parquet", hidden)
    wall = time.perf_counter() - start
    ring_bytes = 2 * (2 - 1) / 2 * out["params"] * 4     # per worker per step, ring allreduce
    return {"name": "TorchDistributor (DDP, gloo)", "samples_per_second": out["samples"] / out["loop_seconds"],
            "train_seconds": wall, "test_accuracy": out["accuracy"], "bytes_per_step": ring_bytes}


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    figure, axes = plt.subplots(1, 3, figsize=(16, 0.45 * len(rows) + 1.5), sharey=True)
    for axis, key, label in zip(axes, ("samples_per_second", "train_seconds", "test_accuracy"),
                                ("training samples/s", "end-to-end seconds", "test accuracy")):
        axis.barh(names, [r[key] or 0 for r in rows])
        axis.set_xlabel(label)
        axis.grid(axis="x", alpha=0.3)
    axes[2].set_xlim(0.8, 1.0)
    axes[0].invert_yaxis()
    figure.suptitle("workload W: MNIST-5k MLP, 2 workers, global batch 64, 5 epochs (this machine)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    plain = plain_pytorch(x, y, x_test, y_test)
    rows = [{**plain, "bytes_per_step": 0}]

    spark = sparkdl.spark_session("sparkdl-compare", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows.append(run_distributor(spark, args.data))
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, optimizer="sgd",
                               learning_rate=LR, momentum=MOMENTUM)
    variants = {"sparkdl sync": {"policy": "sync"}, "sparkdl async": {"policy": "async"},
                "sparkdl softsync c=2": {"policy": "softsync", "softsync_size": 2},
                "sparkdl allreduce": {"policy": "allreduce"},
                "sparkdl async + fp16": {"policy": "async", "compression": "fp16"},
                "sparkdl async + int8": {"policy": "async", "compression": "int8"},
                "sparkdl async + top-k 1%": {"policy": "async", "compression": "topk", "topk_ratio": 0.01}}
    sparkdl.train(data, MODEL, base.replace(epochs=1))     # start the Python workers once
    for name, settings in variants.items():
        result = sparkdl.train(data, MODEL, base.replace(**settings))
        summary = result.summary
        rows.append({"name": name, "samples_per_second": summary["samples_per_second"],
                     "train_seconds": summary["train_seconds"],
                     "test_accuracy": result.accuracy(MODEL, x_test, y_test),
                     "bytes_per_step": summary["bytes_pushed"] / max(summary["pushes"], 1)})
    sizes = []
    for size, hidden in SIZES.items():
        model_fn = functools.partial(mlp, 784, hidden, 10)
        size_rows = [{**plain_pytorch(x, y, x_test, y_test, model_fn), "name": "plain PyTorch"},
                     {**run_distributor(spark, args.data, hidden), "name": "TorchDistributor"}]
        for policy in ("sync", "async", "allreduce"):
            result = sparkdl.train(data, model_fn, base.replace(policy=policy))
            size_rows.append({"name": f"sparkdl {policy}", "samples_per_second": result.summary["samples_per_second"],
                              "train_seconds": result.summary["train_seconds"],
                              "test_accuracy": result.accuracy(model_fn, x_test, y_test)})
        reference = size_rows[0]["samples_per_second"]
        distributor = size_rows[1]["samples_per_second"]
        best = max(size_rows[2:], key=lambda row: row["samples_per_second"])
        sizes.append({"size": size, "hidden": list(hidden), "rows": size_rows,
                      "best_sparkdl": best["name"], "best_vs_pytorch": best["samples_per_second"] / reference,
                      "best_vs_distributor": best["samples_per_second"] / distributor})
    spark.stop()

    print(f"{'run':34s} {'samples/s':>10s} {'wall s':>8s} {'accuracy':>9s} {'bytes pushed/step':>18s}")
    for row in rows:
        print(f"{row['name']:34s} {row['samples_per_second']:10.0f} {row['train_seconds']:8.2f} "
              f"{row['test_accuracy']:9.4f} {row['bytes_per_step']:18,.0f}")
    print("\nsamples/s as a ratio to plain PyTorch (2 threads), by model size:")
    print(f"{'size':6s} " + " ".join(f"{row['name']:>17s}" for row in sizes[0]["rows"]))
    for entry in sizes:
        reference = entry["rows"][0]["samples_per_second"]
        print(f"{entry['size']:6s} " + " ".join(f"{row['samples_per_second'] / reference:16.2f}x"
                                                 for row in entry["rows"]) +
              f"   best sparkdl = {entry['best_vs_distributor']:.2f}x TorchDistributor")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps({"command": "python benchmarks/compare.py", "torch": torch.__version__,
                                                  "rows": rows, "sizes": sizes}, indent=2) + "\n")
    chart(rows, out / "compare.png")
    print(f"-> {out / 'compare.json'}, {out / 'compare.png'}")


if __name__ == "__main__":
    main()
