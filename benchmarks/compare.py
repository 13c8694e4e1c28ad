"""Workload W side by side in one session: plain PyTorch, Spark's TorchDistributor, sparkdl.

    python benchmarks/compare.py            (after `make data`; about fifteen minutes)
    python benchmarks/compare.py --sizes 1.9M --batches 32 --no-w --no-distributor   (two minutes)

W: MNIST-5k (4000 train / 1000 test), MLP 784-256-128-10, SGD lr 0.05 momentum 0.9, global
batch 64, 5 epochs, 2 workers on local[2].  For each run: training-loop samples/s, end-to-end
seconds (SparkSession start excluded), test accuracy, bytes sent per step.  Then the same
training with two larger MLPs (784-1024-1024-10, 1.9M parameters; 784-2048-2048-2048-10, 10M)
for plain PyTorch, TorchDistributor and sparkdl's sync, async and allreduce, at per-worker
batches of 32 and 64.  Every model size also runs **the ceiling**: the most two workers could do
on these cores with no exchange at all -- two single-thread processes, each training its half
of the data at the per-worker batch with its own optimizer, started together.  Every ratio is
given against single-process PyTorch (at the global batch) and against that ceiling.  Writes
benchmarks/results/compare.json and compare.png.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM, plain_pytorch, sgd_epochs  # noqa: E402
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


def _ceiling_process(rank: int, x, y, model_fn, batch: int, epochs: int, start, seconds) -> None:
    """One of the ceiling's two processes: one thread, its half of the data, its own SGD, no exchange."""
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    xs, ys = torch.from_numpy(x[rank::2]), torch.from_numpy(y[rank::2])
    start.wait()
    began = time.perf_counter()
    sgd_epochs(model, optimizer, xs, ys, batch, epochs, torch.Generator().manual_seed(rank))
    seconds[rank] = time.perf_counter() - began


def two_process_ceiling(x, y, model_fn, batch: int, epochs: int = EPOCHS) -> dict:
    """The most two workers can do on these cores without any exchange: two single-thread processes at once.

    samples/s counts both halves over the slower process's loop time."""
    context = multiprocessing.get_context("spawn")
    start, seconds = context.Barrier(2), context.Array("d", 2)
    workers = [context.Process(target=_ceiling_process, args=(rank, x, y, model_fn, batch, epochs, start, seconds))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"a ceiling process failed with exit code {worker.exitcode}")
    return {"name": f"ceiling: 2 processes x 1 thread, batch {batch}, no exchange",
            "samples_per_second": len(x) * epochs / max(seconds[:]), "train_seconds": max(seconds[:]),
            "test_accuracy": None}


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
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 64], help="per-worker batches")
    parser.add_argument("--policies", nargs="+", default=["sync", "async", "allreduce"],
                        help="policies of the model-size runs; a '+overlap' suffix sets overlap_communication")
    parser.add_argument("--no-w", action="store_true", help="skip workload W's table of policies and codecs")
    parser.add_argument("--no-distributor", action="store_true", help="skip TorchDistributor")
    parser.add_argument("--out", default="compare.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    rows = []
    spark = sparkdl.spark_session("sparkdl-compare", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, optimizer="sgd",
                               learning_rate=LR, momentum=MOMENTUM)
    sparkdl.train(data, MODEL, base.replace(epochs=1))     # start the Python workers once
    if not args.no_w:
        rows.append({**plain_pytorch(x, y, x_test, y_test), "bytes_per_step": 0})
        if not args.no_distributor:
            rows.append(run_distributor(spark, args.data))
        variants = {"sparkdl sync": {"policy": "sync"}, "sparkdl async": {"policy": "async"},
                    "sparkdl softsync c=2": {"policy": "softsync", "softsync_size": 2},
                    "sparkdl allreduce": {"policy": "allreduce"},
                    "sparkdl async + fp16": {"policy": "async", "compression": "fp16"},
                    "sparkdl async + int8": {"policy": "async", "compression": "int8"},
                    "sparkdl async + top-k 1%": {"policy": "async", "compression": "topk", "topk_ratio": 0.01}}
        for name, settings in variants.items():
            result = sparkdl.train(data, MODEL, base.replace(**settings))
            summary = result.summary
            rows.append({"name": name, "samples_per_second": summary["samples_per_second"],
                         "train_seconds": summary["train_seconds"],
                         "test_accuracy": result.accuracy(MODEL, x_test, y_test),
                         "bytes_per_step": summary["bytes_pushed"] / max(summary["pushes"], 1)})
    sizes = []
    for size in args.sizes:
        model_fn = functools.partial(mlp, 784, SIZES[size], 10)
        for batch in args.batches:
            reference = {**plain_pytorch(x, y, x_test, y_test, model_fn, global_batch=2 * batch),
                         "name": "plain PyTorch"}
            ceiling = {**two_process_ceiling(x, y, model_fn, batch), "name": "ceiling"}
            size_rows = [reference, ceiling]
            if not args.no_distributor and batch == GLOBAL_BATCH // 2:
                size_rows.append({**run_distributor(spark, args.data, SIZES[size]), "name": "TorchDistributor"})
            for name in args.policies:    # "allreduce+overlap": with overlap_communication
                policy, _, extra = name.partition("+")
                result = sparkdl.train(data, model_fn, base.replace(policy=policy, batch_size=batch,
                                                                    overlap_communication=extra == "overlap"))
                size_rows.append({"name": f"sparkdl {name}", "samples_per_second": result.summary["samples_per_second"],
                                  "train_seconds": result.summary["train_seconds"],
                                  "test_accuracy": result.accuracy(model_fn, x_test, y_test)})
            for row in size_rows:
                row["vs_pytorch"] = row["samples_per_second"] / reference["samples_per_second"]
                row["vs_ceiling"] = row["samples_per_second"] / ceiling["samples_per_second"]
            ours = [row for row in size_rows if row["name"].startswith("sparkdl")]
            best = max(ours, key=lambda row: row["samples_per_second"]) if ours else None
            sizes.append({"size": size, "hidden": list(SIZES[size]), "batch_per_worker": batch, "rows": size_rows,
                          "best_sparkdl": best and best["name"], "best_vs_pytorch": best and best["vs_pytorch"],
                          "best_vs_ceiling": best and best["vs_ceiling"]})
    spark.stop()

    if rows:
        print(f"{'run':34s} {'samples/s':>10s} {'wall s':>8s} {'accuracy':>9s} {'bytes pushed/step':>18s}")
        for row in rows:
            print(f"{row['name']:34s} {row['samples_per_second']:10.0f} {row['train_seconds']:8.2f} "
                  f"{row['test_accuracy']:9.4f} {row['bytes_per_step']:18,.0f}")
    print("\nsamples/s by model size and per-worker batch: x plain PyTorch (2 threads, global batch) / x the ceiling")
    for entry in sizes:
        print(f"{entry['size']} batch {entry['batch_per_worker']}:")
        for row in entry["rows"]:
            print(f"  {row['name']:18s} {row['samples_per_second']:9.0f}/s {row['vs_pytorch']:6.2f}x pytorch "
                  f"{row['vs_ceiling']:6.2f}x ceiling")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/compare.py " + " ".join(sys.argv[1:])
    (out / args.out).write_text(json.dumps({"command": command.strip(), "date": time.strftime("%Y-%m-%d"),
                                            "torch": torch.__version__, "rows": rows, "sizes": sizes},
                                           indent=2) + "\n")
    if rows:
        chart(rows, out / "compare.png")
    print(f"-> {out / args.out}")


if __name__ == "__main__":
    main()
