"""Pipeline (model) parallelism against data parallelism, on this machine, on MNIST-5k.

    python benchmarks/pipeline.py            (after `make data`; about 10 minutes)

Models: W (MLP 784-256-128-10, 0.24M parameters) and a larger MLP 784-2048-2048-2048-10
(10.0M parameters).  Layouts (P stages x D replicas): (1, 2), (2, 1), (2, 2), (4, 1), each
pipeline with m = 1, 4 and 8 micro-batches (1F1B where m >= P, else GPipe); sync SGD,
global batch 64 (D replicas x 64 / D), one epoch, local[4].  For every run: training
samples/s, the measured bubble (idle share of a stage's pipeline steps) against the ideal
(P - 1) / (m + P - 1), the largest task's parameter bytes and peak RSS, and the bytes per
step between stages (activations and their gradients) and to the PS (each stage's range,
pushed and pulled).  Writes benchmarks/results/pipeline.json.
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

MODELS = {"W 784-256-128-10": functools.partial(mlp, 784, (256, 128), 10),
          "MLP 784-2048x3-10": functools.partial(mlp, 784, (2048, 2048, 2048), 10)}
LAYOUTS = [(1, 2), (2, 1), (2, 2), (4, 1)]
MICRO_BATCHES = [1, 4, 8]
GLOBAL_BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    spark = sparkdl.spark_session("sparkdl-bench-pipeline", master="local[4]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    for model_name, model_fn in MODELS.items():
        parameters = sum(p.numel() for p in model_fn().parameters())
        layers_with_parameters = sum(1 for layer in model_fn() if any(True for _ in layer.parameters()))
        for stages, replicas in LAYOUTS:
            if stages > layers_with_parameters:   # W's three Linear layers cannot make four stages
                continue
            data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), replicas).cache()
            data.count()
            for micro in (MICRO_BATCHES if stages > 1 else [1]):
                schedule = "1f1b" if micro >= stages else "gpipe"
                config = sparkdl.TrainConfig(num_workers=replicas, pipeline_stages=stages, micro_batches=micro,
                                             pipeline_schedule=schedule, policy="sync", epochs=args.epochs,
                                             batch_size=GLOBAL_BATCH // replicas, learning_rate=0.05, momentum=0.9)
                result = sparkdl.train(data, model_fn, config)
                summary = result.summary
                row = {"model": model_name, "parameters": parameters, "P": stages, "D": replicas,
                       "m": micro if stages > 1 else None, "schedule": schedule if stages > 1 else None,
                       "samples_per_second": summary["samples_per_second"],
                       "bubble": summary.get("bubble"), "ideal_bubble": summary.get("ideal_bubble"),
                       "max_task_parameter_bytes": max(w.get("parameter_bytes", parameters * 4)
                                                       for w in result.workers),
                       "peak_worker_rss_bytes": summary["peak_worker_rss_bytes"],
                       "activation_bytes_per_step": summary.get("activation_bytes_per_step", 0),
                       "ps_bytes_per_step": (summary["bytes_pushed"] + summary["bytes_pulled"])
                       / max(summary["updates"], 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            data.unpersist()
    spark.stop()

    print(f"\n{'model':20s} {'P':>2s} {'D':>2s} {'m':>3s} {'samples/s':>10s} {'bubble':>7s} {'ideal':>6s} "
          f"{'task MB':>8s} {'act KB/step':>12s} {'PS MB/step':>11s}")
    for row in rows:
        print(f"{row['model']:20s} {row['P']:2d} {row['D']:2d} {row['m'] or '-':>3} {row['samples_per_second']:10.0f} "
              f"{row['bubble'] if row['bubble'] is not None else float('nan'):7.2f} "
              f"{row['ideal_bubble'] if row['ideal_bubble'] is not None else float('nan'):6.2f} "
              f"{row['max_task_parameter_bytes'] / 2**20:8.1f} {row['activation_bytes_per_step'] / 1024:12.0f} "
              f"{row['ps_bytes_per_step'] / 2**20:11.1f}")
    out = ROOT / "benchmarks" / "results" / "pipeline.json"
    out.write_text(json.dumps({"machine": platform.platform(), "cpus": torch.get_num_threads(),
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
