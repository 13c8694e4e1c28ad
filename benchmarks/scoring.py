"""TorchModel.transform throughput vs plain PyTorch on the same rows, in one run.

    python benchmarks/scoring.py          (after `make data`)

MNIST-5k test images repeated to >= 200k rows, MLP 784-256-128-10, batch 1024.  The Spark
side scores on the executors of local[2] and writes to the no-op sink (nothing collected);
plain PyTorch scores the same numpy array in one process with 2 threads.  Also measures the
fit input path: Arrow record batches -> the float32 feature matrix.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
import sparkdl  # noqa: E402
from sparkdl import TorchModel  # noqa: E402
from sparkdl._internal.data.arrow import ColumnSpec, arrow_to_arrays  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

MODEL = functools.partial(mlp, 784, (256, 128), 10)
BATCH = 1024


def plain_pytorch(features: np.ndarray, state: dict) -> float:
    torch.set_num_threads(2)
    model = MODEL()
    model.load_state_dict(state)
    model.eval()
    x = torch.from_numpy(features)
    start = time.perf_counter()
    with torch.inference_mode():
        for k in range(0, len(x), BATCH):
            model(x[k:k + BATCH]).argmax(dim=1)
    return len(x) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data" / "mnist"))
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    table = pq.read_table(f"{args.data}/test.parquet")
    repeats = -(-args.rows // table.num_rows)
    big = pa.concat_tables([table] * repeats)
    path = ROOT / "benchmarks" / "results" / "inference_input.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(big, path, row_group_size=10_000)

    torch.manual_seed(0)
    state = MODEL().state_dict()
    features = np.stack(big.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)

    # fit input path: Arrow batches -> float32 matrix, as the training workers do it
    batches = big.to_batches(max_chunksize=10_000)
    start = time.perf_counter()
    converted, _ = arrow_to_arrays(batches, ColumnSpec(label_col="label"))
    arrow_rows_per_s = len(converted) / (time.perf_counter() - start)

    spark = sparkdl.spark_session("sparkdl-inference-bench", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    frame = spark.read.parquet(str(path))
    model = TorchModel(model=MODEL, inferenceBatchSize=BATCH)
    model.state_dict = state
    model.transform(frame).write.format("noop").mode("overwrite").save()   # warm-up: Python workers, caches
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        model.transform(frame).write.format("noop").mode("overwrite").save()
        timings.append(time.perf_counter() - start)
    spark_rows_per_s = big.num_rows / min(timings)
    plain_rows_per_s = max(plain_pytorch(features, state) for _ in range(3))
    spark.stop()
    path.unlink()

    result = {"rows": big.num_rows, "batch_size": BATCH, "transform_rows_per_s": spark_rows_per_s,
              "plain_pytorch_rows_per_s": plain_rows_per_s, "ratio": spark_rows_per_s / plain_rows_per_s,
              "fit_input_arrow_rows_per_s": arrow_rows_per_s}
    print(f"TorchModel.transform: {spark_rows_per_s:,.0f} rows/s   plain PyTorch: {plain_rows_per_s:,.0f} rows/s   "
          f"ratio {result['ratio']:.2f}")
    print(f"fit input (Arrow -> float32 matrix): {arrow_rows_per_s:,.0f} rows/s")
    out = ROOT / "benchmarks" / "results" / "inference.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    sys.exit(main())
