"""A driver program for the multi-host lab (tests/e2e/lab.py): train digits on the lab's standalone master.

Run on the lab's driver host; prints one ``RESULT {json}`` line (the run's summary, its workers'
summaries and the warnings the run gave) and saves the final weights to ``--weights``.  The same ``fit`` runs in the test
process on ``local[2]`` for the single-host reference.

    python tests/e2e/lab_run.py --master spark://10.200.77.1:7077 --driver-host 10.200.77.1 \\
        --settings '{"policy": "sync"}' --weights /tmp/w.pt
"""
from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import numpy as np
import torch

import sparkdl
from sparkdl import TrainConfig, TrainResult, train
from sparkdl.models import mlp

#: the settings every lab run shares: deterministic data order, so sync equals its single-host run
BASE = {"num_workers": 2, "epochs": 2, "batch_size": 32, "learning_rate": 0.1, "shuffle": False, "seed": 5,
        "timeout_s": 60.0}


def digits_mlp() -> torch.nn.Module:
    return mlp(64, (64,), 10)


def digits_rows() -> list[tuple[np.ndarray, int]]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return [(row, int(label)) for row, label in zip((x / 16.0).astype(np.float32), y)]


def training_accuracy(state_dict: dict[str, torch.Tensor]) -> float:
    """The digits MLP with ``state_dict`` scored on the rows it trained on (chance: 0.1)."""
    model = digits_mlp()
    model.load_state_dict(state_dict)
    x, y = zip(*digits_rows())
    with torch.no_grad():
        return (model(torch.from_numpy(np.stack(x))).argmax(1) == torch.tensor(y)).float().mean().item()


def fit(spark: Any, settings: dict[str, Any]) -> TrainResult:
    """Train the digits MLP with ``BASE`` and ``settings`` on two contiguous partitions."""
    rdd = spark.sparkContext.parallelize(digits_rows(), 2)
    return train(rdd, digits_mlp, TrainConfig(**{**BASE, **settings}))


def rank_report() -> dict[str, Any]:
    """A ``sparkdl.run`` function: the variables torchrun would set, as this rank got them, the address it runs at,
    and the sum of the ranks over the group it forms with ``init_process_group()`` from them."""
    import os
    import socket

    import torch.distributed as dist

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR")
    values = {name: os.environ[name] for name in names}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:    # the address that routes to rank 0's host
        probe.connect((values["MASTER_ADDR"], 9))
        address = probe.getsockname()[0]
    dist.init_process_group("gloo")
    try:
        ranks = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(ranks)
        return {**values, "address": address, "rank_sum": ranks.item()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--driver-host", required=True, help="the driver host's address in the lab")
    parser.add_argument("--settings", default="{}", help="TrainConfig fields as JSON, over BASE")
    parser.add_argument("--weights", help="where to save the final state_dict")
    parser.add_argument("--ranks", type=int, help="instead of training, sparkdl.run the rank report on this many "
                                                  "tasks and print what each rank got")
    args = parser.parse_args()
    if not args.ranks and not args.weights:
        parser.error("training needs --weights")
    spark = sparkdl.spark_session("sparkdl-lab", master=args.master, conf={
        "spark.driver.host": args.driver_host, "spark.driver.bindAddress": args.driver_host,
        "spark.ui.enabled": "false", "spark.executor.cores": "1", "spark.executor.memory": "1g",
        "spark.cores.max": "8"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if args.ranks:
            print("RESULT " + json.dumps({"ranks": list(sparkdl.run(rank_report, num_workers=args.ranks))}), flush=True)
            return
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            result = fit(spark, json.loads(args.settings))
        torch.save(result.state_dict, args.weights)
        print("RESULT " + json.dumps({"summary": result.summary, "workers": result.workers,
                                      "gradients": result.gradients.to_dict("records"),
                                      "attempts": len(result.attempts),
                                      "warnings": [str(w.message) for w in warned]}, default=str), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
