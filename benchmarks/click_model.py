"""A click model with a 10M-row embedding table: sparkdl's parameter server against one PyTorch process.

    python benchmarks/click_model.py [--rows 10000000] [--samples 1000000] [--ps-shards 2]
                                     [--shard-snapshot-every 50] [--shared-tables]
                                     [--reference-only | --sparkdl-only]

Synthetic data with a known optimum: each sample holds 4 ids drawn from a Zipf law (exponent
1.5) over the table's rows, and clicks with probability sigmoid(sum of the 4 ids' planted
weights), the planted weights N(0, 1) per row.  The model: an ``nn.EmbeddingBag(rows, 64,
mode="sum", sparse=True)`` over the 4 ids and a linear read-out; Adagrad lr 0.05 on the table
and SGD lr 0.05 on the read-out, 1 epoch,
global batch 1024 (sparkdl: 2 workers x 512, async).  Reports samples/s, test log-loss against
the planted model's (the optimum) and the constant click rate's, bytes per push, distinct ids
per batch, and each worker's peak RSS against the table's size.  The reference is the same
model in one process with ``torch.optim.Adagrad`` on its sparse gradients (the limit); each
side runs in a process of its own (``--reference-only`` / ``--sparkdl-only``; by default the
script runs both, one after the other).  ``--ps-shards N`` holds the table in N PS shards on the
executors (``ps_hosts="executors"``) instead of the driver's PS, and reports the bytes the driver
sent and received against the bytes the workers moved; ``--shared-tables`` keeps the table in shared memory
on the driver's host, where the workers step it in place (``shared_tables``, Hogwild).  Writes
benchmarks/results/click_model.json (``click_model_shards.json`` with ``--ps-shards``, ``click_model_shared.json``
with ``--shared-tables``).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
FIELDS, DIM, LR, BATCH, ZIPF = 4, 64, 0.05, 1024, 1.5


class Clicks(nn.Module):
    """The click model: a sum of the sample's 4 id embeddings, then a logit."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
        nn.init.normal_(self.table.weight, std=0.01)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids.long()))[:, 0]


def make_data(rows: int, samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """Ids ``[samples, 4]`` (float32, exact below 2**24), labels, and the planted model's mean log-loss."""
    planted = np.random.default_rng(12345).normal(size=rows).astype(np.float32)   # one model: train and test
    rng = np.random.default_rng(seed)
    ids = ((rng.zipf(ZIPF, size=(samples, FIELDS)) - 1) % rows).astype(np.int64)
    p = 1.0 / (1.0 + np.exp(-planted[ids].sum(axis=1)))
    labels = (rng.random(samples) < p).astype(np.float32)
    eps = 1e-7
    entropy = float(-np.mean(p * np.log(p + eps) + (1 - p) * np.log(1 - p + eps)))
    return ids.astype(np.float32), labels, entropy


def log_loss(model: nn.Module, ids: np.ndarray, labels: np.ndarray) -> float:
    with torch.no_grad():
        logits = torch.cat([model(torch.from_numpy(ids[i:i + 65536])) for i in range(0, len(ids), 65536)])
        return float(nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels)))


def peak_rss_gb() -> float:
    from sparkdl._internal.memory import peak_rss_bytes
    return peak_rss_bytes() / 2**30


def reference(args: argparse.Namespace) -> dict:
    ids, labels, optimum = make_data(args.rows, args.samples)
    test_ids, test_labels, test_optimum = make_data(args.rows, args.samples // 10, seed=1)
    torch.manual_seed(0)
    model = Clicks(args.rows)
    # Adagrad on the table's sparse gradients, SGD on the read-out: sparkdl's embedding_optimizer and optimizer
    optimizers = [torch.optim.Adagrad([model.table.weight], lr=LR), torch.optim.SGD(model.out.parameters(), lr=LR)]
    x, y = torch.from_numpy(ids), torch.from_numpy(labels)
    started = time.perf_counter()
    for i in range(0, len(ids) - BATCH + 1, BATCH):
        for optimizer in optimizers:
            optimizer.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x[i:i + BATCH]), y[i:i + BATCH]).backward()
        for optimizer in optimizers:
            optimizer.step()
    seconds = time.perf_counter() - started
    return {"run": "pytorch", "samples_per_second": (len(ids) // BATCH) * BATCH / seconds,
            "test_log_loss": log_loss(model, test_ids, test_labels), "optimum": test_optimum,
            "constant": constant_loss(test_labels), "peak_rss_gb": peak_rss_gb()}


def constant_loss(labels: np.ndarray) -> float:
    rate = float(labels.mean())
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def with_sparkdl(args: argparse.Namespace) -> dict:
    import sparkdl
    from sparkdl import TrainConfig, train

    ids, labels, _ = make_data(args.rows, args.samples)
    test_ids, test_labels, test_optimum = make_data(args.rows, args.samples // 10, seed=1)
    spark = sparkdl.spark_session("sparkdl-click-model", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rdd = spark.sparkContext.parallelize(list(zip(ids, labels.tolist())), 2).cache()
    rdd.count()
    config = TrainConfig(num_workers=2, policy="async", epochs=1, batch_size=BATCH // 2, loss="bce_with_logits",
                         optimizer="sgd", embedding_optimizer="adagrad", learning_rate=LR, seed=0)
    if args.ps_shards:
        config = config.replace(ps_hosts="executors", ps_shards=args.ps_shards,
                                shard_snapshot_every=args.shard_snapshot_every)
    if args.shared_tables:
        config = config.replace(shared_tables=True)
    started = time.perf_counter()
    result = train(rdd, lambda: Clicks(args.rows), config)
    seconds = time.perf_counter() - started
    summary = result.summary
    model = Clicks(args.rows)
    model.load_state_dict(result.state_dict)
    batch_ids = ids[:BATCH // 2].astype(np.int64)
    spark.stop()
    shards = {}
    if args.ps_shards:
        # the driver's bytes: the shards' start (their dense ranges; their rows when they had to be sent),
        # their snapshots' changed rows, progress reports and final states
        moved = summary["bytes_pushed"] + summary["bytes_pulled"]
        shards = {"ps_shards": summary["ps_shards"], "shard_snapshot_every": args.shard_snapshot_every,
                  "driver_bytes": summary["driver_bytes"],
                  "shard_rows_sent": summary["shard_rows_sent"], "shard_snapshots": summary["shard_snapshots"],
                  "worker_bytes": moved, "driver_share": summary["driver_bytes"] / (summary["driver_bytes"] + moved)}
    return {"run": "sparkdl async" + (f", {args.ps_shards} PS shards on the executors" if args.ps_shards else "")
            + (", shared tables" if args.shared_tables else ""), "round_trips_per_step": summary["round_trips_per_step"],
            **shards, "samples_per_second": summary["samples_per_second"], "fit_seconds": seconds,
            "test_log_loss": log_loss(model, test_ids, test_labels), "optimum": test_optimum,
            "constant": constant_loss(test_labels),
            "bytes_per_push": (summary["bytes_pushed"] + summary["bytes_pulled"]) / summary["pushes"],
            "distinct_ids_per_batch": int(np.unique(batch_ids).size),
            "table_gb": args.rows * DIM * 4 / 2**30,
            "worker_peak_rss_gb": [w["peak_rss_bytes"] / 2**30 for w in result.workers],
            "driver_peak_rss_gb": peak_rss_gb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--ps-shards", type=int, default=0, help="PS shards on the executors (0: the driver's PS)")
    parser.add_argument("--shard-snapshot-every", type=int, default=50, help="with --ps-shards (default 50)")
    parser.add_argument("--shared-tables", action="store_true", help="the table in shared memory (shared_tables)")
    parser.add_argument("--reference-only", action="store_true")
    parser.add_argument("--sparkdl-only", action="store_true")
    args = parser.parse_args()
    if args.reference_only or args.sparkdl_only:
        print("RESULT " + json.dumps(reference(args) if args.reference_only else with_sparkdl(args)), flush=True)
        return
    rows = []
    for side in ("--reference-only", "--sparkdl-only"):     # each in a process of its own
        done = subprocess.run([sys.executable, __file__, side, "--rows", str(args.rows), "--samples",
                               str(args.samples), "--ps-shards", str(args.ps_shards),
                               "--shard-snapshot-every", str(args.shard_snapshot_every)]
                              + (["--shared-tables"] if args.shared_tables else []),
                              capture_output=True, text=True, check=True)
        line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
        rows.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "benchmarks" / "results" / ("click_model_shards.json" if args.ps_shards else
                                             "click_model_shared.json" if args.shared_tables else "click_model.json")
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"-> {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
