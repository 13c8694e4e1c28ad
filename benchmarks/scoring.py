"""Scoring throughput: TorchModel.transform and its SQL function against Spark's own floor and scorer, in one run.

    python benchmarks/scoring.py                      (after `make data`)
    python benchmarks/scoring.py --paths transform    (one path)
    python benchmarks/scoring.py --workload png       (a CNN on encoded PNG images, decode included)

The ``dense`` workload (the default): MNIST test images repeated to 200,000 rows (array<float> of 784) in a
Parquet file, read into a DataFrame cached in 2 partitions; the model is the M MLP (784-1024-1024-10, 1.9M
parameters), batches of 1,024.  The ``png`` workload: the same images as PNG files (a binary column, 200,000
rows), LeNet (``sparkdl.models.lenet``) behind ``DecodeImages``; every path decodes the images itself
(``batchTransform`` for sparkdl, in the predict function for ``predict_batch_udf``).  Each
path runs in a fresh process with its own local[2] session and is called three times there, writing to the
no-op sink (nothing collected); Spark's own paths run under pyspark's worker daemon, sparkdl's under
``sparkdl.daemon`` (as ``sparkdl.spark_session`` sets it).  The first call pays the Python workers' start,
torch's import and the model's build; the later ones show the warm cost.  The paths:

* ``floor``: an identity ``mapInArrow`` (rows to Python and back, no model): Spark's own floor for any
  Python scorer of these rows;
* ``transform``: ``TorchModel.transform``;
* ``udf``: the model as a column function (``TorchModel.udf()`` in a ``select``);
* ``predict_batch_udf``: Spark's ``pyspark.ml.functions.predict_batch_udf`` (batch 1,024, input shape [784]);

and, in this process, the model alone: plain PyTorch over the same rows in memory (2 threads; decoding the
PNG files included).  Warm, the goal for ``transform`` is at most 1.1x (the floor + the model alone).
"""
from __future__ import annotations

import argparse
import dataclasses
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
from sparkdl.models import lenet, mlp  # noqa: E402
from sparkdl.transforms import DecodeImages  # noqa: E402

MODELS = {"dense": functools.partial(mlp, 784, (1024, 1024), 10), "png": functools.partial(lenet, 10)}
DATA = {"dense": "mnist", "png": "mnist_png"}
BATCH = 1024
PATHS = ("floor", "transform", "udf", "predict_batch_udf")
INPUT = ROOT / "benchmarks" / "results" / "scoring_input.parquet"
CALLS = 3


def state(workload: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return MODELS[workload]().state_dict()


def model_alone(workload: str, column: pa.ChunkedArray) -> float:
    """Seconds plain PyTorch takes to score the rows in memory (best of three): the floats stacked into one
    tensor beforehand, the PNG files decoded batch by batch (decoding is part of the work)."""
    torch.set_num_threads(2)
    model = MODELS[workload]()
    model.load_state_dict(state(workload))
    model.eval()
    if workload == "png":
        files, decode = column.to_pylist(), DecodeImages()
        batches = lambda: (decode(files[k:k + BATCH]) for k in range(0, len(files), BATCH))  # noqa: E731
    else:
        x = torch.from_numpy(np.stack(column.to_numpy(zero_copy_only=False)).astype(np.float32))
        batches = lambda: (x[k:k + BATCH] for k in range(0, len(x), BATCH))  # noqa: E731
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in batches():
                model(batch).argmax(dim=1)
        best = min(best, time.perf_counter() - start)
    return best


def scorer(path: str, workload: str, frame):
    """A function of the cached frame that builds the DataFrame ``path`` scores."""
    if path == "floor":
        return lambda: frame.mapInArrow(lambda batches: batches, frame.schema)
    decoding = {"batchTransform": DecodeImages()} if workload == "png" else {}
    model = TorchModel.from_module(MODELS[workload], state_dict=state(workload), outputKind="multiclass",
                                   probabilityCol="", inferenceBatchSize=BATCH, **decoding)
    if path == "transform":
        return lambda: model.transform(frame)
    if path == "udf":
        return lambda: frame.select("*", model.udf()("features").alias("prediction"))
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    def make_predict():
        import torch as torch_

        net = build()
        net.load_state_dict(weights)
        net.eval()

        def predict(inputs: np.ndarray) -> np.ndarray:
            with torch_.inference_mode():
                batch = decode(list(inputs)) if decode else torch_.from_numpy(inputs.astype(np.float32, copy=False))
                return net(batch).argmax(dim=1).double().numpy()
        return predict

    build, weights, decode = MODELS[workload], state(workload), DecodeImages() if workload == "png" else None
    predict = predict_batch_udf(make_predict, return_type=T.DoubleType(), batch_size=BATCH,
                                input_tensor_shapes=None if decode else [[784]])
    return lambda: frame.select("*", predict("features").alias("prediction"))


def run_one(path: str, workload: str, sparkdl_daemon: str) -> dict:
    """The seconds of each call of ``path`` in this (fresh) process and, for sparkdl's paths, the scoring tasks'
    report of the warm calls (``sparkdl.scoring_report``: read, convert, model and write seconds)."""
    from sparkdl.ml._scoring_report import WORKER_LOGGING

    # Spark's own paths run as in a plain session: pyspark's daemon, not sparkdl's (which imports torch)
    daemon = "pyspark.daemon" if path in ("floor", "predict_batch_udf") else sparkdl_daemon
    conf = {"spark.ui.enabled": "false", "spark.python.daemon.module": daemon}
    spark = sparkdl.spark_session(f"sparkdl-scoring-{path}", master="local[2]", conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    frame = spark.read.parquet(str(INPUT)).repartition(2).cache()
    frame.count()
    build = scorer(path, workload, frame)
    reported = path in ("transform", "udf")
    if reported:
        spark.conf.set(WORKER_LOGGING, "true")
    seconds, reports = [], []
    for _ in range(CALLS):
        start = time.perf_counter()
        build().write.format("noop").mode("overwrite").save()
        seconds.append(time.perf_counter() - start)
        if reported:
            reports.append(sparkdl.scoring_report(spark))
    spark.stop()
    if not reported:
        return {"seconds": seconds}
    first, last = reports[0], reports[-1]
    warm = sparkdl.ScoringReport(**{name: getattr(last, name) - getattr(first, name)
                                    for name in dataclasses.asdict(last)})
    return {"seconds": seconds, "warm_report": str(warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(MODELS), default="dense")
    parser.add_argument("--data", help="the folder of test.parquet (default: data/mnist, data/mnist_png for png)")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--sparkdl-daemon", default="sparkdl.daemon", choices=("sparkdl.daemon", "pyspark.daemon"),
                        help="the Python worker daemon of sparkdl's paths (pyspark.daemon: as without sparkdl's)")
    parser.add_argument("--only", choices=PATHS, help=argparse.SUPPRESS)   # one path, in the fresh process
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only, args.workload, args.sparkdl_daemon)))
        return

    data = args.data or str(ROOT / "data" / DATA[args.workload])
    table = pq.read_table(f"{data}/test.parquet").select(["features"])
    big = pa.concat_tables([table] * -(-args.rows // table.num_rows)).slice(0, args.rows)
    INPUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(big, INPUT, row_group_size=10_000)
    alone = model_alone(args.workload, big.column("features"))
    print(f"{args.workload}: {args.rows:,} rows; the model alone in one process: {alone:.2f} s")
    results: dict[str, list[float]] = {}
    reports: dict[str, str] = {}
    try:
        for path in args.paths:
            done = subprocess.run([sys.executable, __file__, "--only", path, "--workload", args.workload,
                                   "--sparkdl-daemon", args.sparkdl_daemon], capture_output=True, text=True, check=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            results[path] = measured["seconds"]
            first, *later = results[path]
            print(f"{path:>18}: first call {first:6.2f} s, warm {min(later):6.2f} s "
                  f"({args.rows / min(later):,.0f} rows/s)")
            if "warm_report" in measured:
                reports[path] = measured["warm_report"]
                print(f"{'':>18}  the warm calls' tasks: {reports[path]}")
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
    suffix = "" if args.workload == "dense" else f"_{args.workload}"
    out = ROOT / "benchmarks" / "results" / f"scoring{suffix}.json"
    out.write_text(json.dumps({"workload": args.workload, "rows": args.rows, "model_alone_s": alone,
                               "calls_s": results, "warm_reports": reports}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    sys.exit(main())
