"""Scoring throughput: TorchModel.transform and its SQL function against Spark's own floor and scorer, in one run.

    python benchmarks/scoring.py                      (after `make data`)
    python benchmarks/scoring.py --paths transform    (one path)

MNIST test images repeated to 200,000 rows (array<float> of 784) in a Parquet file, read into a DataFrame
cached in 2 partitions; the model is the M MLP (784-1024-1024-10, 1.9M parameters), batches of 1,024.  Each
path runs in a fresh process with its own local[2] session and is called three times there, writing to the
no-op sink (nothing collected): the first call pays the Python workers' start, torch's import and the
model's build; the later ones show the warm cost.  The paths:

* ``floor``: an identity ``mapInArrow`` (rows to Python and back, no model): Spark's own floor for any
  Python scorer of these rows;
* ``transform``: ``TorchModel.transform``;
* ``udf``: the model as a column function (``TorchModel.udf()`` in a ``select``);
* ``predict_batch_udf``: Spark's ``pyspark.ml.functions.predict_batch_udf`` (batch 1,024, input shape [784]);

and, in this process, the model alone: plain PyTorch over the same rows in memory (2 threads).  Warm, the
goal for ``transform`` is at most 1.1x (the floor + the model alone).
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import sparkdl  # noqa: E402
from sparkdl import TorchModel  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

MODEL = functools.partial(mlp, 784, (1024, 1024), 10)
BATCH = 1024
PATHS = ("floor", "transform", "udf", "predict_batch_udf")
INPUT = ROOT / "benchmarks" / "results" / "scoring_input.parquet"
CALLS = 3


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return MODEL().state_dict()


def model_alone(features: np.ndarray) -> float:
    """Seconds plain PyTorch takes to score ``features`` in memory (best of three)."""
    torch.set_num_threads(2)
    model = MODEL()
    model.load_state_dict(state())
    model.eval()
    x = torch.from_numpy(features)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with torch.inference_mode():
            for k in range(0, len(x), BATCH):
                model(x[k:k + BATCH]).argmax(dim=1)
        best = min(best, time.perf_counter() - start)
    return best


def scorer(path: str, frame):
    """A function of the cached frame that builds the DataFrame ``path`` scores."""
    if path == "floor":
        return lambda: frame.mapInArrow(lambda batches: batches, frame.schema)
    model = TorchModel.from_module(MODEL, state_dict=state(), outputKind="multiclass", probabilityCol="",
                                   inferenceBatchSize=BATCH)
    if path == "transform":
        return lambda: model.transform(frame)
    if path == "udf":
        return lambda: frame.select("*", model.udf()("features").alias("prediction"))
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    def make_predict():
        import torch as torch_

        net = MODEL()
        net.load_state_dict(weights)
        net.eval()

        def predict(inputs: np.ndarray) -> np.ndarray:
            with torch_.inference_mode():
                return net(torch_.from_numpy(inputs.astype(np.float32, copy=False))).argmax(dim=1).double().numpy()
        return predict

    weights = state()
    predict = predict_batch_udf(make_predict, return_type=T.DoubleType(), batch_size=BATCH,
                                input_tensor_shapes=[[784]])
    return lambda: frame.select("*", predict("features").alias("prediction"))


def run_one(path: str) -> list[float]:
    """The seconds of each call of ``path`` in this (fresh) process."""
    spark = sparkdl.spark_session(f"sparkdl-scoring-{path}", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    frame = spark.read.parquet(str(INPUT)).repartition(2).cache()
    frame.count()
    build = scorer(path, frame)
    seconds = []
    for _ in range(CALLS):
        start = time.perf_counter()
        build().write.format("noop").mode("overwrite").save()
        seconds.append(time.perf_counter() - start)
    spark.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--only", choices=PATHS, help=argparse.SUPPRESS)   # one path, in the fresh process
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only)))
        return

    table = pq.read_table(f"{args.data}/test.parquet").select(["features"])
    big = pa.concat_tables([table] * -(-args.rows // table.num_rows)).slice(0, args.rows)
    INPUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(big, INPUT, row_group_size=10_000)
    features = np.stack(big.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
    alone = model_alone(features)
    print(f"{args.rows:,} rows; the model alone in one process: {alone:.2f} s")
    results: dict[str, list[float]] = {}
    try:
        for path in args.paths:
            done = subprocess.run([sys.executable, __file__, "--only", path], capture_output=True, text=True,
                                  check=True)
            results[path] = json.loads(done.stdout.strip().splitlines()[-1])
            first, *later = results[path]
            print(f"{path:>18}: first call {first:6.2f} s, warm {min(later):6.2f} s "
                  f"({args.rows / min(later):,.0f} rows/s)")
    finally:
        INPUT.unlink(missing_ok=True)
    if "floor" in results:
        floor = min(results["floor"][1:])
        for path in ("transform", "udf", "predict_batch_udf"):
            if path in results:
                warm = min(results[path][1:])
                extra = results[path][0] - warm
                floor_extra = results["floor"][0] - floor
                print(f"{path:>18}: warm {warm / (floor + alone):.2f}x (the floor + the model alone); first call's "
                      f"extra over warm {extra:.2f} s against the floor's {floor_extra:.2f} s")
    out = ROOT / "benchmarks" / "results" / "scoring.json"
    out.write_text(json.dumps({"rows": args.rows, "model_alone_s": alone, "calls_s": results}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    sys.exit(main())
