"""Embedding tables held as rows against the dense exchange, on MovieLens biased matrix factorisation.

    python benchmarks/embeddings.py [--rounds 2] [--epochs 5] [--policies sync async allreduce]

The model of conf/movielens_mf.toml (672 users, 9,066 movies, 32 factors and a bias each:
321k parameters, 9,738 rows per width), 2 workers x batch 256, trained once with dense
embeddings (the whole flat vector pushed and pulled every step) and once with ``sparse=True``
(the parameter server holds the four tables as rows; a step pulls and pushes only the rows its
batch touches), alternately, ``--rounds`` times, under sync and async with SGD (lr 0.05, the
same rule row-wise and dense), and the dense model once more under allreduce (gloo: no PS, the
whole gradient through the ring).  Reports bytes per worker and step (pushed + pulled, or the
ring's), test RMSE and the training loops' samples/s.  Writes benchmarks/results/embeddings.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
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
    parser.add_argument("--policies", nargs="+", default=["sync", "async", "allreduce"])
    args = parser.parse_args()
    from pyspark.sql import functions as F

    spark = sparkdl.spark_session("sparkdl-embeddings", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    train = spark.read.parquet(f"{args.data}/train.parquet").cache()
    test = spark.read.parquet(f"{args.data}/test.parquet").cache()
    mean = train.select(F.avg("rating")).first()[0]
    rows = []
    for round_ in range(args.rounds):
        for policy, sparse in (("sync", False), ("sync", True), ("async", False), ("async", True),
                               ("allreduce", False)):
            if policy in args.policies:
                model = TorchEstimator(model=functools.partial(BiasedMF, 672, 9066, 32, mean, sparse),
                                       inputCols=["user", "movie"], labelCol="rating", loss="mse", optimizer="sgd",
                                       learningRate=0.05, batchSize=BATCH, epochs=args.epochs, numWorkers=2,
                                       updatePolicy=policy, seed=0).fit(train)
                summary = model.summary
                scored = model.transform(test)
                rmse = scored.select(F.sqrt(F.avg((F.col("prediction") - F.col("rating")) ** 2))).first()[0]
                row = {"round": round_, "policy": policy, "sparse": sparse, "rmse": rmse,
                       # per worker and step: the bytes its push and pulls (or its share of the ring) moved
                       "bytes_per_step": (summary["bytes_pushed"] + summary["bytes_pulled"])
                       / (summary["samples"] / BATCH),
                       "samples_per_second": summary["samples_per_second"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "embeddings.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"-> {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
