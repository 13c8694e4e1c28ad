"""One table's row-wise step on the parameter server, alone: microseconds per ``EmbeddingTable.apply_rows``.

    python benchmarks/table_apply.py [--reps 300] [--module path/to/embedding_table.py]

One intra-op thread (the PS's handlers run on one: ``ps_threads``); each call steps the distinct
rows one worker's batch touched (``distinct=True``, as one worker's push is applied) with fresh
gradients, for Adagrad and lazy Adam, at MovieLens's table sizes (6,040 users, 3,706 movies, 32
wide, 400-450 rows a batch of 512) and the click model's (10M x 64, 1,000 rows).  ``--module``
times another revision's ``embedding_table.py`` (a before/after in one process).  Writes
benchmarks/results/table_apply.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from sparkdl._internal.ps.tables import TableSpec

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((6_040, 32, 400), (3_706, 32, 450), (10_000_000, 64, 1_000))


def table_class(module_path: str | None) -> type:
    if module_path is None:
        from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
        return EmbeddingTable
    spec = importlib.util.spec_from_file_location("embedding_table_under_test", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EmbeddingTable


def microseconds(table_cls: type, optimizer: str, rows: int, dim: int, touched: int, reps: int) -> float:
    table = table_cls(TableSpec("t", rows, dim, optimizer), learning_rate=0.05)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randperm(rows, generator=generator)[:touched].sort().values,
                torch.randn(touched, dim, generator=generator)) for _ in range(20)]
    for index, grads in batches[:5]:
        table.apply_rows(index, grads, distinct=True)
    started = time.perf_counter()
    for k in range(reps):
        index, grads = batches[k % len(batches)]
        table.apply_rows(index, grads, distinct=True)
    return (time.perf_counter() - started) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--module", help="another embedding_table.py to time (default: this checkout's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table_cls = table_class(args.module)
    rows_out = []
    for optimizer in ("adagrad", "lazy_adam"):
        for rows, dim, touched in SHAPES:
            us = microseconds(table_cls, optimizer, rows, dim, touched, args.reps)
            rows_out.append({"optimizer": optimizer, "rows": rows, "dim": dim, "touched": touched, "us": us})
            print(f"{optimizer:9s} {rows:>10,} x {dim} rows, {touched} touched: {us:8.1f} us per step")
    out = ROOT / "benchmarks" / "results" / "table_apply.json"
    out.write_text(json.dumps({"command": "python benchmarks/table_apply.py" + (f" --module {args.module}"
                                                                                 if args.module else ""),
                               "date": time.strftime("%Y-%m-%d"), "rows": rows_out}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
