"""Embedding tables held as rows against the dense exchange, on MovieLens biased matrix factorisation.

    python benchmarks/embeddings.py [--rounds 2] [--epochs 5] [--policies sync async async-shared allreduce]
        [--no-one-process]

(``python jobs/prepare_data.py --datasets movielens`` writes the data first.)

The model of conf/movielens_mf.toml (672 users, 9,066 movies, 32 factors and a bias each:
321k parameters, 9,738 rows per width), 2 workers x batch 256, trained once with dense
embeddings (the whole flat vector pushed and pulled every step) and once with ``sparse=True``
(the parameter server holds the four tables as rows; a step pulls and pushes only the rows its
batch touches), alternately, ``--rounds`` times, under sync and async with SGD (lr 0.05, the
same rule row-wise and dense), and the dense model once more under allreduce (gloo: no PS, the
whole gradient through the ring); ``async-shared`` trains the ``sparse=True`` model under async with
``sharedTables=True`` (the workers step the tables in shared memory, Hogwild).  Each round also trains the
model in one PyTorch process (2 threads, the global batch of 512, ``torch.optim.SGD`` on the tables' sparse
gradients or the dense ones: sync's updates, in another data order).  Reports bytes per worker and step (pushed + pulled,
or the ring's), the round trips a worker's step waited on, test RMSE and the training loops'
samples/s, each sparkdl row also as a ratio to the one process of its round.  Writes
benchmarks/results/embeddings.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 256

import sparkdl  # noqa: E402
from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.models import BiasedMF  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "movielens"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--policies", nargs="+", default=["sync", "async", "allreduce"],
                        choices=["sync", "async", "async-shared", "allreduce"])
    parser.add_argument("--no-one-process", action="store_true", help="skip the one-process PyTorch baseline")
    args = parser.parse_args()
    from pyspark.sql import functions as F

    spark = sparkdl.spark_session("sparkdl-embeddings", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    train = spark.read.parquet(f"{args.data}/train.parquet").cache()
    test = spark.read.parquet(f"{args.data}/test.parquet").cache()
    mean = train.select(F.avg("rating")).first()[0]
    rows = []
    for round_ in range(args.rounds):
        reference = {}
        if not args.no_one_process:
            for sparse in (False, True):
                reference[sparse] = one_process(args.data, mean, sparse, args.epochs)
                row = {"round": round_, "policy": "one process", "sparse": sparse, **reference[sparse]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for policy, sparse in (("sync", False), ("sync", True), ("async", False), ("async", True),
                               ("async-shared", True), ("allreduce", False)):
            if policy in args.policies:
                model = TorchEstimator(model=functools.partial(BiasedMF, 672, 9066, 32, mean, sparse),
                                       inputCols=["user", "movie"], labelCol="rating", loss="mse", optimizer="sgd",
                                       learningRate=0.05, batchSize=BATCH, epochs=args.epochs, numWorkers=2,
                                       updatePolicy=policy.removesuffix("-shared"),
                                       sharedTables=policy.endswith("-shared"), seed=0).fit(train)
                summary = model.summary
                scored = model.transform(test)
                rmse = scored.select(F.sqrt(F.avg((F.col("prediction") - F.col("rating")) ** 2))).first()[0]
                row = {"round": round_, "policy": policy, "sparse": sparse, "rmse": rmse,
                       # per worker and step: the bytes its push and pulls (or its share of the ring) moved
                       "bytes_per_step": (summary["bytes_pushed"] + summary["bytes_pulled"])
                       / (summary["samples"] / BATCH),
                       "round_trips_per_step": summary.get("round_trips_per_step"),
                       "samples_per_second": summary["samples_per_second"]}
                if reference:
                    best = max(r["samples_per_second"] for r in reference.values())
                    row["vs_one_process"] = round(summary["samples_per_second"] / best, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "embeddings.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"-> {out.relative_to(ROOT)}")


def one_process(data: str, mean: float, sparse: bool, epochs: int) -> dict:
    """The model trained in this process: 2 threads, batch 2 x BATCH, SGD lr 0.05; samples/s of the loop, test RMSE."""
    import pyarrow.parquet as pq
    import torch

    def columns(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = pq.read_table(path, columns=["user", "movie", "rating"])
        return (torch.from_numpy(table["user"].to_numpy().astype("int64")),
                torch.from_numpy(table["movie"].to_numpy().astype("int64")),
                torch.from_numpy(table["rating"].to_numpy().astype("float32")))
    users, movies, ratings = columns(f"{data}/train.parquet")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = BiasedMF(672, 9066, 32, mean, sparse)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batch, samples = 2 * BATCH, 0
    started = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(ratings))
        for start in range(0, len(order), batch):
            take = order[start:start + batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(users[take], movies[take]), ratings[take])
            loss.backward()
            optimizer.step()
            samples += len(take)
    seconds = time.perf_counter() - started
    users, movies, ratings = columns(f"{data}/test.parquet")
    with torch.no_grad():
        rmse = float(torch.sqrt(torch.mean((model(users, movies) - ratings) ** 2)))
    return {"rmse": rmse, "samples_per_second": samples / seconds}


if __name__ == "__main__":
    sys.exit(main())
