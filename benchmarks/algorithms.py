"""Async reliability over seeds, and local SGD next to gradient accumulation, on workload W.

    python benchmarks/algorithms.py [--seeds 5] [--rounds 6]

Part 1: conf/mnist_async.toml's settings (async, 2 workers x batch 32, SGD lr 0.05 momentum
0.9, 5 epochs) with seeds 0..4: test accuracy of each run, with ``implicit_momentum`` "ignore"
(the server steps with momentum 0.9) and "compensate" (0.8: asynchrony's 1 - 1/2 makes up the
rest), alternately, ``--rounds`` times (async is not deterministic: one seed spreads by round).
Part 2: s = 1, 4, 16 mini-batches per push, as local SGD (`local_update="sgd"`: s local
optimizer steps, the model delta pushed) and as gradient accumulation
(`local_update="accumulate"`: the mean gradient of s mini-batches pushed), async: test
accuracy, pushes and bytes pushed per training sample.
Writes benchmarks/results/algorithms.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

import sparkdl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    x, y = read_parquet_arrays(f"{args.data}/train.parquet")
    x_test, y_test = read_parquet_arrays(f"{args.data}/test.parquet")
    spark = sparkdl.spark_session("sparkdl-algorithms", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, policy="async", epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2,
                               optimizer="sgd", learning_rate=LR, momentum=MOMENTUM)
    sparkdl.train(data, MODEL, base)      # warm the Python workers
    seeds = []
    for round_ in range(args.rounds):
        for implicit in ("ignore", "compensate"):
            for seed in range(args.seeds):
                result = sparkdl.train(data, MODEL, base.replace(seed=seed, implicit_momentum=implicit))
                seeds.append({"round": round_, "implicit_momentum": implicit, "seed": seed,
                              "server_momentum": result.summary["server_momentum"],
                              "accuracy": result.accuracy(MODEL, x_test, y_test),
                              "staleness_mean": result.summary["staleness_mean"]})
            accuracies = [row["accuracy"] for row in seeds[-args.seeds:]]
            print(f"round {round_} implicit_momentum={implicit}: " + ", ".join(f"{a:.3f}" for a in accuracies))
    local = []
    for policy in ("sync", "async"):
        for steps in (1, 4, 16):
            for mode in ("sgd", "accumulate"):
                local.append(local_run(data, MODEL, base.replace(policy=policy, local_steps=steps, local_update=mode),
                                       x_test, y_test))
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "algorithms.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": seeds, "local": local}, indent=2) + "\n")
    print(f"-> {out}")


def local_run(data, model, config, x_test, y_test) -> dict:
    """One local-steps run: accuracy, pushes and bytes pushed per training sample."""
    result = sparkdl.train(data, model, config)
    summary = result.summary
    row = {"policy": config.policy, "local_steps": config.local_steps, "local_update": config.local_update,
           "accuracy": result.accuracy(model, x_test, y_test), "pushes": summary["pushes"],
           "bytes_pushed_per_sample": summary["bytes_pushed"] / summary["samples"],
           "train_seconds": summary["train_seconds"]}
    print(f"{row['policy']:5s} s={row['local_steps']:2d} {row['local_update']:10s}: accuracy {row['accuracy']:.4f}"
          f"  pushes {row['pushes']:4d}  bytes pushed/sample {row['bytes_pushed_per_sample']:8.0f}"
          f"  fit {row['train_seconds']:.2f} s")
    return row


if __name__ == "__main__":
    main()
