"""Fully sharded data parallelism against allreduce: per-worker memory and seconds per step, on this machine.

    python benchmarks/fully_sharded.py               (after `make data`; about 5 minutes)
    python benchmarks/fully_sharded.py --width 4096  (a larger model)

Model: an MLP 784 - width x layers - 10 (8 hidden layers of 2048: 34.6M parameters, 138 MB in
float32), AdamW, global batch 64, the first 1,280 MNIST rows (20 steps), local[4].  Runs:
allreduce on 2 workers, fsdp on 2 and on 4 workers.  For every run: each worker's peak RSS
growth during its task (``peak_rss_bytes - start_rss_bytes``), the model's own need per worker
((weights + gradient + AdamW moments) / N + the largest layer's weights and gradient in full +
the next layer's weights; allreduce: the whole 16 bytes per parameter), their ratio, seconds
per step, and the parameter values each worker held.  Writes benchmarks/results/fully_sharded.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))

from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

RUNS = [("allreduce", 2), ("fsdp", 2), ("fsdp", 4)]
GLOBAL_BATCH = 64
ROWS = 1280


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x, y = x[:ROWS], y[:ROWS]
    model_fn = functools.partial(mlp, 784, (args.width,) * args.layers, 10)
    model = model_fn()
    parameters = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model)
    del model
    spark = sparkdl.spark_session("sparkdl-bench-fsdp", master="local[4]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    for policy, workers in RUNS:
        data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), workers).cache()
        data.count()
        config = sparkdl.TrainConfig(num_workers=workers, policy=policy, epochs=1, batch_size=GLOBAL_BATCH // workers,
                                     optimizer="adamw", learning_rate=1e-3, weight_decay=0.01, shuffle=False,
                                     timeout_s=600)
        result = sparkdl.train(data, model_fn, config)
        summary = result.summary
        growth = [w["peak_rss_bytes"] - w["start_rss_bytes"] for w in result.workers]
        need = (16 * parameters if policy == "allreduce"
                else 16 * -(-parameters // workers) + 12 * largest)
        row = {"policy": policy, "workers": workers, "parameters": parameters, "largest_layer": largest,
               "peak_worker_rss_growth_mb": max(growth) / 1e6, "model_need_per_worker_mb": need / 1e6,
               "growth_over_need": max(growth) / need,
               "seconds_per_step": summary["loop_seconds"] / max(summary["updates"], 1),
               "held_parameters": [w.get("sharded_parameters", parameters) for w in result.workers],
               "final_loss": float(result.history["loss"].iloc[-1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
        data.unpersist()
    spark.stop()
    print(f"\n{'policy':10s} {'N':>2s} {'growth MB':>10s} {'need MB':>8s} {'ratio':>6s} {'s/step':>7s}")
    for r in rows:
        print(f"{r['policy']:10s} {r['workers']:2d} {r['peak_worker_rss_growth_mb']:10.0f} "
              f"{r['model_need_per_worker_mb']:8.0f} {r['growth_over_need']:6.2f} {r['seconds_per_step']:7.3f}")
    out = ROOT / "benchmarks" / "results" / "fully_sharded.json"
    out.write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
