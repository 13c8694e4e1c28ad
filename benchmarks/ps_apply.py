"""The parameter server's update path alone: a sync round of N gradients averaged and stepped.

    python benchmarks/ps_apply.py [--values 10000000] [--workers 2] [--rounds 20]

Drives ``PSCore`` directly (no sockets): every round, each worker's gradient is added into the
round's sum (weighted by its samples), then the average is stepped by SGD with momentum 0.9.
Prints the milliseconds per update spent aggregating and in the optimizer step, with the
intra-op threads torch uses here, and writes benchmarks/results/ps_apply.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparkdl._internal.ps.server.core import PSCore, PushMeta
from sparkdl.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=10_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "ps_apply.json")
    args = parser.parse_args()
    config = TrainConfig(num_workers=args.workers, policy="sync", learning_rate=1e-4, momentum=0.9, epochs=1000)
    core = PSCore(config, torch.zeros(args.values))
    tokens = [core.hello(worker, 0, 32 * 1_000_000) for worker in range(args.workers)]
    gradients = [torch.randn(args.values) for _ in range(args.workers)]
    results = []
    for round_ in range(args.rounds + 2):
        aggregate, optimizer = core.stats.aggregate_seconds, core.stats.optimizer_seconds
        started = time.perf_counter()
        for worker, token in enumerate(tokens):
            core.push(worker, token, PushMeta(core.version, 32, 1.0, 0), gradients[worker], True)
        wall = time.perf_counter() - started
        if round_ >= 2:        # two warm-up rounds
            results.append((core.stats.aggregate_seconds - aggregate, core.stats.optimizer_seconds - optimizer, wall))
    aggregate_ms, optimizer_ms, wall_ms = (1e3 * sum(r[i] for r in results) / len(results) for i in range(3))
    out = {"command": f"python benchmarks/ps_apply.py --values {args.values} --workers {args.workers} "
                      f"--rounds {args.rounds}", "threads": torch.get_num_threads(), "aggregate_ms": aggregate_ms,
           "optimizer_ms": optimizer_ms, "update_ms": wall_ms, "updates": core.version}
    print(f"{args.workers} gradients of {args.values:,} values per update, {torch.get_num_threads()} threads: "
          f"aggregate {aggregate_ms:.1f} ms + average and step {optimizer_ms:.1f} ms = {wall_ms:.1f} ms per update")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
