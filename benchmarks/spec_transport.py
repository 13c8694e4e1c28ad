"""How the job spec reaches the tasks in classic PySpark: a broadcast variable vs the task closure.

    python benchmarks/spec_transport.py [--hidden 6144] [--repeats 5]

The job spec holds the initial weights, so its size is the model's.  One classic local[2]
session trains an MLP 784-H-H-10 for one mini-batch per worker (64 random rows, async), the
spec shipped either way in turn (classic PySpark itself turns a closure over 1 MB into a
broadcast of the pickled function).  Prints each run's train() and barrier-stage seconds after
one warm-up run that starts the Python workers.  Spark Connect has no broadcast variables:
there the spec always travels in the closure, or as a session file above 32 MB.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sparkdl  # noqa: E402
from sparkdl import TrainConfig, train  # noqa: E402
from sparkdl._internal.spark import backend  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

BROADCAST = (backend.ClassicBackend.share, backend.ClassicBackend.release)


def ship(mode: str) -> None:
    """Make classic sessions ship job specs by ``mode`` ("broadcast" or "closure")."""
    if mode == "broadcast":
        backend.ClassicBackend.share, backend.ClassicBackend.release = BROADCAST
    else:
        backend.ClassicBackend.share = lambda self, data: data
        backend.ClassicBackend.release = lambda self, shared: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=6144, help="width H of the two hidden layers")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-spec-transport", master="local[2]", conf={"spark.ui.enabled": "false"})
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    model_fn = functools.partial(mlp, 784, (args.hidden, args.hidden), 10)
    megabytes = sum(p.numel() for p in model_fn().parameters()) * 4 / 1e6
    rng = np.random.default_rng(0)
    rdd = sc.parallelize([(rng.random(784, dtype=np.float32), int(rng.integers(10))) for _ in range(64)], 2).cache()
    config = TrainConfig(num_workers=2, epochs=1, batch_size=32, policy="async", timeout_s=300)
    train(rdd, functools.partial(mlp, 784, (16,), 10), config)   # warm-up: starts the Python workers
    runs: dict[str, list[tuple[float, float]]] = {"broadcast": [], "closure": []}
    for _ in range(args.repeats):
        for mode in ("closure", "broadcast"):
            ship(mode)
            started = time.perf_counter()
            result = train(rdd, model_fn, config)
            runs[mode].append((time.perf_counter() - started, result.summary["stage_seconds"]))
    ship("broadcast")
    print(f"MLP 784-{args.hidden}-{args.hidden}-10: {megabytes:.0f} MB of float32 weights, local[2]")
    for mode, times in runs.items():
        stage = [s for _, s in times]
        print(f"{mode:9s} stage s {' '.join(f'{s:5.2f}' for s in stage)}   median {statistics.median(stage):.2f}"
              f"   train() median {statistics.median(t for t, _ in times):.2f}")
    spark.stop()


if __name__ == "__main__":
    main()
