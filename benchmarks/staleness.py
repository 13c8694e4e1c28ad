"""Staleness study (Zhang et al. 2016's shapes): 4, 8 and 16 workers on W, sync vs async and
n-softsync, with and without the per-gradient alpha0/tau rule.

    python benchmarks/staleness.py [--workers 4 8 16]

Workers are threads of this process (16 workers on 2 cores is fine: it only raises the
staleness), each running sparkdl's own replica loop against a live parameter server over
loopback; no Spark.  n-softsync with lambda = N learners uses c = N / n gradients per update;
Zhang et al. observe a mean staleness of about n.  Prints final test accuracy, the staleness
distribution, and the PS's cost per update (CPU of its handler threads, optimizer time),
the figure that tells whether the single PS binds at 8 workers.
Writes benchmarks/results/staleness.json.
"""
from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM  # noqa: E402
from train import read_parquet_arrays  # noqa: E402

from sparkdl._internal.modes.parameter_server.worker import train_replica  # noqa: E402
from sparkdl._internal.ps.server.server import ParameterServer  # noqa: E402
from sparkdl._internal.ps.worker.client import PSClient  # noqa: E402
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import flatten_parameters, load_flat_parameters  # noqa: E402
from sparkdl.config import TrainConfig  # noqa: E402


def run(config: TrainConfig, x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> dict:
    torch.manual_seed(config.seed)
    initial = flatten_parameters(MODEL())
    secret = secrets.token_bytes(32)
    server = ParameterServer(config, initial, secret)
    host, port = server.start()
    spec = JobSpec(config, MODEL, initial.numpy(), host, port, secret)
    shards = np.array_split(np.arange(len(x)), config.num_workers)
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            client = PSClient(host, port, secret, rank, config.timeout_s)
            train_replica(rank, x[shards[rank]], y[shards[rank]], spec, torch.device("cpu"), client)
            client.close()
        except BaseException as exc:
            errors.append(exc)

    torch.set_num_threads(1)
    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(config.num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    server.stop()
    if errors:
        raise errors[0]
    model = MODEL()
    load_flat_parameters(model, server.weights())
    with torch.inference_mode():
        accuracy = float((model.eval()(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    staleness = np.array([row.staleness for row in server.core.log.gradients])
    updates = max(server.stats.updates, 1)
    return {"accuracy": accuracy, "updates": server.stats.updates, "wall_s": wall,
            "staleness_mean": float(staleness.mean()), "staleness_p50": float(np.percentile(staleness, 50)),
            "staleness_p90": float(np.percentile(staleness, 90)), "staleness_max": int(staleness.max()),
            "ps_cpu_ms_per_update": 1e3 * server.stats.handler_cpu_seconds / updates,
            "ps_optimizer_ms_per_update": 1e3 * server.stats.optimizer_seconds / updates,
            "ps_cpu_share": server.stats.handler_cpu_seconds / wall}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    x, y = read_parquet_arrays(str(ROOT / "data" / "mnist" / "train.parquet"))
    x_test, y_test = read_parquet_arrays(str(ROOT / "data" / "mnist" / "test.parquet"))
    rows = []
    print(f"{'workers':>7s} {'policy':12s} {'lr':8s} {'accuracy':>8s} {'stale mean':>10s} {'p90':>5s} {'max':>5s} "
          f"{'PS cpu ms/update':>16s} {'PS cpu share':>12s}")
    for workers in args.workers:
        variants = [("sync", workers, "none")] + [(policy, c, rule) for policy, c in (("async", 1), ("softsync", 2))
                                                  for rule in ("none", "inverse")]
        for policy, c, staleness_lr in variants:
            # global batch 64 as in W: each worker's mini-batch is 64 / N
            config = TrainConfig(num_workers=workers, policy=policy, softsync_size=c, epochs=EPOCHS,
                                 batch_size=GLOBAL_BATCH // workers, learning_rate=LR, momentum=MOMENTUM,
                                 staleness_lr=staleness_lr, timeout_s=120)
            name = policy if policy != "softsync" else f"{workers // c}-softsync"
            result = {"workers": workers, "policy": name, "staleness_lr": staleness_lr,
                      **run(config, x, y, x_test, y_test)}
            rows.append(result)
            print(f"{workers:7d} {result['policy']:12s} {staleness_lr:8s} {result['accuracy']:8.4f} "
                  f"{result['staleness_mean']:10.2f} {result['staleness_p90']:5.0f} {result['staleness_max']:5d} "
                  f"{result['ps_cpu_ms_per_update']:16.3f} {result['ps_cpu_share']:12.2f}")
    out = ROOT / "benchmarks" / "results" / "staleness.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
