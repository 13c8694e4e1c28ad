"""Where the first fit of a session spends its time, against a warm fit and Spark's own floor.

    python benchmarks/cold_start.py [--repeats 2] [--features-shape]    (after `make data`; a minute each)

Each repeat starts a fresh Python process with a fresh local[2] session (as `make run` does)
and times: the session start; the first TorchEstimator.fit on workload W (MNIST-5k, MLP
784-256-128-10, async, 2 workers x 32, 5 epochs), split into the data validation job, the
training stage and the training loop inside it, and the checks before launch (the model's output
width: from the first row's job for MNIST's array<float> column, or, with --features-shape, from
the schema and featuresShape alone); then a second, warm fit.  Another fresh
process times Spark's floor: the first and second empty ``mapInArrow`` job over the same
repartitioned data (no torch, no sparkdl on the executors).  Writes
benchmarks/results/cold_start.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "mnist" / "train.parquet"


def fits(features_shape: bool) -> dict:
    """Runs in a fresh process: session start, a cold fit and a warm fit, with the fit split in parts.

    ``features_shape``: the estimator is given featuresShape=[784], so the schema fixes the rows' width and
    no job reads a row before launch."""
    started = time.perf_counter()
    import functools

    import sparkdl
    import sparkdl.ml.estimator as estimator_module
    from sparkdl import TorchEstimator, TrainConfig
    from sparkdl.models import mlp

    imported = time.perf_counter()
    spark = sparkdl.spark_session("sparkdl-cold-start", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    session = time.perf_counter()
    checks: list[float] = []
    before_launch = estimator_module._input_and_output_width

    def timed_checks(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return before_launch(*args, **kwargs)
        finally:
            checks.append(time.perf_counter() - begin)

    estimator_module._input_and_output_width = timed_checks
    frame = spark.read.parquet(str(DATA))
    config = TrainConfig(num_workers=2, policy="async", epochs=5, batch_size=32, learning_rate=0.05, momentum=0.9)
    runs = []
    for _ in range(2):
        begin = time.perf_counter()
        model = TorchEstimator.from_train_config(config, model=functools.partial(mlp, 784, (256, 128), 10),
                                                   **({"featuresShape": [784]} if features_shape else {})).fit(frame)
        summary = model.summary
        runs.append({"fit_seconds": time.perf_counter() - begin, "checks_seconds": checks[-1],
                     "stage_seconds": summary["stage_seconds"], "loop_seconds": summary["loop_seconds"]})
    spark.stop()
    return {"import_seconds": imported - started, "session_seconds": session - imported, "cold": runs[0],
            "warm": runs[1]}


def spark_floor() -> dict:
    """Runs in a fresh process: the first and the second empty mapInArrow job of a session."""
    import pyarrow as pa

    import sparkdl

    spark = sparkdl.spark_session("sparkdl-floor", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    frame = spark.read.parquet(str(DATA)).select("features", "label").repartition(2)

    def count(batches):
        rows = sum(batch.num_rows for batch in batches)
        yield pa.RecordBatch.from_pydict({"rows": [rows]})

    seconds = []
    for _ in range(2):
        begin = time.perf_counter()
        frame.mapInArrow(count, "rows long").collect()
        seconds.append(time.perf_counter() - begin)
    spark.stop()
    return {"first_empty_job_seconds": seconds[0], "second_empty_job_seconds": seconds[1]}


def in_fresh_process(name: str, features_shape: bool = False) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", name] + (["--features-shape"] if features_shape else []),
                          capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--features-shape", action="store_true",
                        help="give featuresShape=[784]: the schema fixes the width, no first-row job runs")
    parser.add_argument("--child", choices=["fits", "floor"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fits(args.features_shape) if args.child == "fits" else spark_floor()))
        return
    runs = [in_fresh_process("fits", args.features_shape) for _ in range(args.repeats)]
    floor = in_fresh_process("floor")
    for run in runs:
        cold, warm = run["cold"], run["warm"]
        print(f"session start {run['session_seconds']:.2f} s | first fit {cold['fit_seconds']:.2f} s (checks "
              f"{cold['checks_seconds']:.2f}, stage {cold['stage_seconds']:.2f} of which loop "
              f"{cold['loop_seconds']:.2f}) | warm fit {warm['fit_seconds']:.2f} s (checks "
              f"{warm['checks_seconds']:.2f}, stage {warm['stage_seconds']:.2f}, loop {warm['loop_seconds']:.2f})")
    print(f"Spark floor: first empty mapInArrow job {floor['first_empty_job_seconds']:.2f} s, second "
          f"{floor['second_empty_job_seconds']:.2f} s")
    out = ROOT / "benchmarks" / "results" / "cold_start.json"
    command = f"python benchmarks/cold_start.py --repeats {args.repeats}" + (
        " --features-shape" if args.features_shape else "")
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"), "runs": runs,
                               "spark_floor": floor}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
