"""Worker memory and throughput against shard size, with the shard in memory or on disk.

    python benchmarks/data.py                         (about 5 minutes)
    python benchmarks/data.py --shard-mb 50 300       (quicker)
    python benchmarks/data.py --source dataframe      (about 5 minutes)

Workload W's model and batch (MLP 784-256-128-10, 2 workers x batch 32, SGD lr 0.05 momentum
0.9, sync) for one epoch over synthetic rows of 784 float32 values, generated inside each
worker as Spark streams its partition, so nothing but the worker holds them.  With ``--source
dataframe`` the rows are a DataFrame's ``array<float>`` column instead, generated in the JVM and
read by ``TorchEstimator.fit`` as Arrow batches of Spark's default 10,000 rows.  For every shard
size and ``data_cache`` it records each worker's peak RSS (reset at task start; every task gets a
fresh Python worker, so one fit's leftovers do not raise the next one's peak) and the training
loop's samples/s, and writes benchmarks/results/data.json (data_dataframe.json).  Synthetic rows
are fine here: the figures are memory and speed, not accuracy.
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
from sparkdl import TorchEstimator, TrainConfig, train
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


def measure_dataframe(spark, shard_mb: float, cache: str) -> dict:
    """:func:`measure` through ``TorchEstimator.fit`` on a DataFrame generated in the JVM."""
    from pyspark.sql import functions as F

    rows = int(shard_mb * 1e6 / ROW_BYTES) // 32 * 32
    features = F.array(*[F.rand(seed=i).cast("float") for i in range(WIDTH)])
    frame = spark.range(2 * rows, numPartitions=2).select(features.alias("features"),
                                                         (F.rand(seed=WIDTH) * 10).cast("long").alias("label"))
    estimator = TorchEstimator(model=MODEL, numWorkers=2, updatePolicy="sync", epochs=1, batchSize=32,
                               learningRate=0.05, momentum=0.9, dataCache=cache, timeout=600)
    started = time.perf_counter()
    summary = estimator.fit(frame).summary
    seconds = time.perf_counter() - started
    return {"shard_mb": shard_mb, "rows_per_shard": rows, "data_cache": cache,
            "partition_bytes": rows * ROW_BYTES, "peak_worker_rss_mb": summary["peak_worker_rss_bytes"] / 1e6,
            "samples_per_second": summary["samples_per_second"], "train_seconds": seconds,
            "caches": [summary["data_cache"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-mb", type=float, nargs="+", default=[50, 300, 1500])
    parser.add_argument("--source", choices=("rdd", "dataframe"), default="rdd")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    output = args.output or ROOT / "benchmarks" / "results" / (
        "data.json" if args.source == "rdd" else "data_dataframe.json")
    spark = sparkdl.spark_session("sparkdl-data-benchmark", master="local[2]",
                                  conf={"spark.ui.enabled": "false", "spark.driver.memory": "2g",
                                        "spark.python.worker.reuse": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    runs = []
    for shard_mb in args.shard_mb:
        for cache in ("memory", "disk"):
            run = (measure if args.source == "rdd" else measure_dataframe)(spark, shard_mb, cache)
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
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"command": f"python benchmarks/data.py --source {args.source} --shard-mb "
                                  + " ".join(f"{s:g}" for s in args.shard_mb), "machine": platform.platform(),
        "runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
