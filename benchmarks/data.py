"""Worker memory and throughput against shard size, with the shard in memory or on disk.

    python benchmarks/data.py                         (about 5 minutes)
    python benchmarks/data.py --shard-mb 50 300       (quicker)

Workload W's model and batch (MLP 784-256-128-10, 2 workers x batch 32, SGD lr 0.05 momentum
0.9, sync) for one epoch over synthetic rows of 784 float32 values, generated inside each
worker as Spark streams its partition, so nothing but the worker holds them.  For every shard
size and ``data_cache`` it records each worker's peak RSS (reset at task start) and the
training loop's samples/s, and writes benchmarks/results/data.json.  Synthetic rows are fine
here: the figures are memory and speed, not accuracy.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import numpy as np

import sparkdl
from sparkdl import TrainConfig, train
from sparkdl.models import mlp

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 784
ROW_BYTES = WIDTH * 4
MODEL = functools.partial(mlp, WIDTH, (256, 128), 10)


def generated_rows(rows_per_shard: int):
    """A partition function yielding ``rows_per_shard`` rows, made block by block as they are consumed."""
    def rows_of(partition: int, _):
        generator = np.random.default_rng(partition)
        for start in range(0, rows_per_shard, 4096):
            block = generator.random((min(4096, rows_per_shard - start), WIDTH), dtype=np.float32)
            labels = (block[:, 0] * 10).astype(np.int64)
            yield from zip(block, labels.tolist())
    return rows_of


def measure(spark, shard_mb: float, cache: str) -> dict:
    rows = int(shard_mb * 1e6 / ROW_BYTES) // 32 * 32          # whole batches
    data = spark.sparkContext.parallelize(range(2), 2).mapPartitionsWithIndex(generated_rows(rows))
    config = TrainConfig(num_workers=2, policy="sync", epochs=1, batch_size=32, learning_rate=0.05, momentum=0.9,
                         data_cache=cache, timeout_s=600)
    started = time.perf_counter()
    result = train(data, MODEL, config)
    seconds = time.perf_counter() - started
    return {"shard_mb": shard_mb, "rows_per_shard": rows, "data_cache": cache,
            "partition_bytes": result.workers[0]["partition_bytes"],
            "peak_worker_rss_mb": max(w["peak_rss_bytes"] for w in result.workers) / 1e6,
            "samples_per_second": result.summary["samples_per_second"], "train_seconds": seconds,
            "caches": sorted({w["data_cache"] for w in result.workers})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-mb", type=float, nargs="+", default=[50, 300, 1500])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "data.json")
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-data-benchmark", master="local[2]",
                                  conf={"spark.ui.enabled": "false", "spark.driver.memory": "2g"})
    spark.sparkContext.setLogLevel("ERROR")
    runs = []
    for shard_mb in args.shard_mb:
        for cache in ("memory", "disk"):
            run = measure(spark, shard_mb, cache)
            runs.append(run)
            print(f"shard {shard_mb:6.0f} MB  {cache:6s}  peak worker RSS {run['peak_worker_rss_mb']:7.0f} MB  "
                  f"{run['samples_per_second']:7.0f} samples/s  ({run['train_seconds']:.1f} s)", flush=True)
    spark.stop()
    disk = [r for r in runs if r["data_cache"] == "disk"]
    memory = {r["shard_mb"]: r for r in runs if r["data_cache"] == "memory"}
    summary = {
        "disk_rss_growth_mb": disk[-1]["peak_worker_rss_mb"] - disk[0]["peak_worker_rss_mb"],
        "shard_growth_mb": (disk[-1]["partition_bytes"] - disk[0]["partition_bytes"]) / 1e6,
        "disk_vs_memory_samples_per_second": {r["shard_mb"]: r["samples_per_second"] /
                                              memory[r["shard_mb"]]["samples_per_second"] for r in disk},
    }
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"command": "python benchmarks/data.py " + " ".join(
        f"--shard-mb {' '.join(f'{s:g}' for s in args.shard_mb)}".split()), "machine": platform.platform(),
        "runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
