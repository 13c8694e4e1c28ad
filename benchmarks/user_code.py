"""The user's own code, side by side in one session on MNIST-5k (after `make data`):

    python benchmarks/user_code.py [--repeats 2]

1. The same DDP ``train_fn`` (MLP 784-256-128-10, SGD lr 0.05 momentum 0.9, batch 32 per rank,
   3 epochs, gloo) through Spark's ``TorchDistributor(num_processes=2, local_mode=False,
   use_gpu=False)`` and through ``sparkdl.TorchDistributor`` with the same arguments, run
   alternately: seconds from ``run()`` to its result, and rank 0's test accuracy; then sparkdl's
   back to back.
2. A hand-written loop with ``ctx.ps_optimizer`` (async) against ``sparkdl.train`` with the same
   settings (5 epochs, 2 workers x batch 32): training-loop samples/s and test accuracy.

Writes benchmarks/results/user_code.json.
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))

from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

MODEL = functools.partial(mlp, 784, (256, 128), 10)
DDP_EPOCHS, LOOP_EPOCHS, BATCH, LR, MOMENTUM = 3, 5, 32, 0.05, 0.9


def ddp_train(path: str) -> dict:
    """A plain torch.distributed training function, as notebooks write them for Spark's TorchDistributor."""
    import pyarrow.parquet as pq
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    table = pq.read_table(path, columns=["features", "label"])
    x = torch.from_numpy(np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float32))
    y = torch.from_numpy(table.column("label").to_numpy()).long()
    x, y = x[rank::world], y[rank::world]
    torch.manual_seed(0)
    model = DistributedDataParallel(MODEL())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(DDP_EPOCHS):
        order = torch.randperm(len(x), generator=generator)
        for k in range(0, len(x) - BATCH + 1, BATCH):
            index = order[k:k + BATCH]
            optimizer.zero_grad()
            F.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return state


def ps_loop(epochs: int) -> dict:
    """The estimator's async loop, by hand, with a PS optimizer."""
    ctx = sparkdl.context()
    model = MODEL()
    optimizer = ctx.ps_optimizer(model)
    started, samples = time.perf_counter(), 0
    for epoch in range(epochs):
        for batch in ctx.batches(epoch):
            loss = F.cross_entropy(model(*batch.inputs), batch.labels)
            loss.backward()
            optimizer.step(loss=loss.item())
            samples += len(batch)
    return {"samples": samples, "seconds": time.perf_counter() - started}


def accuracy(state: dict, x_test: np.ndarray, y_test: np.ndarray) -> float:
    model = MODEL()
    model.load_state_dict(state)
    with torch.inference_mode():
        return float((model.eval()(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from pyspark.ml.torch.distributor import TorchDistributor as SparksDistributor

    train_path = str(Path(args.data, "train.parquet").resolve())
    x, y = read_parquet_arrays(train_path)
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    spark = sparkdl.spark_session("sparkdl-bench", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows: list[dict] = []
    sparkdl.run(lambda: None, num_workers=2)   # the session's first Python workers start before anything is timed
    for repeat in range(args.repeats):
        for name, distributor in (("Spark TorchDistributor", SparksDistributor), ("sparkdl TorchDistributor",
                                                                                  sparkdl.TorchDistributor)):
            started = time.perf_counter()
            state = distributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_train, train_path)
            rows.append({"name": name, "repeat": repeat, "seconds_to_result": time.perf_counter() - started,
                         "test_accuracy": accuracy(state, x_test, y_test)})
            print(rows[-1], flush=True)
    # back to back: each run finds the Python workers that the run before it left (Spark's distributor
    # does not leave its own: its tasks leave their input unread)
    sparkdl.run(lambda: None, num_workers=2)
    for repeat in range(args.repeats):
        started = time.perf_counter()
        state = sparkdl.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_train, train_path)
        rows.append({"name": "sparkdl TorchDistributor, back to back", "repeat": repeat,
                     "seconds_to_result": time.perf_counter() - started,
                     "test_accuracy": accuracy(state, x_test, y_test)})
        print(rows[-1], flush=True)

    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    config = sparkdl.TrainConfig(num_workers=2, epochs=LOOP_EPOCHS, batch_size=BATCH, optimizer="sgd",
                                 learning_rate=LR, momentum=MOMENTUM, policy="async")
    for repeat in range(args.repeats):
        reference = sparkdl.train(data, MODEL, config)
        rows.append({"name": "sparkdl.train async", "repeat": repeat,
                     "samples_per_second": reference.summary["samples_per_second"],
                     "test_accuracy": reference.accuracy(MODEL, x_test, y_test)})
        print(rows[-1], flush=True)
        result = sparkdl.run(ps_loop, args=(LOOP_EPOCHS,), config=config, data=data)
        model = result.load_weights(MODEL())
        rows.append({"name": "custom loop, PS optimizer, async", "repeat": repeat,
                     "samples_per_second": sum(r["samples"] for r in result) / max(r["seconds"] for r in result),
                     "test_accuracy": accuracy(model.state_dict(), x_test, y_test)})
        print(rows[-1], flush=True)
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "user_code.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__, "rows": rows},
                              indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
