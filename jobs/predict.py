"""Score a Parquet dataset with a saved TorchModel, on the executors.

    python jobs/predict.py --model runs/mnist_async/model --input data/mnist/test.parquet --output runs/scored
    PYSPARK_PYTHON=$PWD/.venv/bin/python spark-submit --properties-file conf/local.properties \\
        jobs/predict.py --model ... --input ... --output ...

Writes the input rows plus ``prediction`` (and ``probability`` for classifiers) as Parquet.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparkdl import TorchModel, spark_session
from sparkdl._internal.spark.session import read_properties, under_spark_submit

DEFAULT_PROPERTIES = Path(__file__).resolve().parent.parent / "conf" / "local.properties"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="directory of a saved TorchModel")
    parser.add_argument("--input", required=True, help="Parquet file or directory to score")
    parser.add_argument("--output", required=True, help="Parquet directory to write")
    parser.add_argument("--handle-invalid", choices=["error", "skip", "keep"], default=None,
                        help="rows with null, NaN or infinite features: fail (error), leave them out (skip) or "
                             "write them with prediction NaN (keep); default: the saved model's handleInvalid "
                             "('error' unless it was set)")
    parser.add_argument("--spark-properties", type=Path, default=DEFAULT_PROPERTIES,
                        help="Spark properties used when not started by spark-submit")
    args = parser.parse_args(argv)
    use_file = not under_spark_submit() and args.spark_properties.exists()
    spark = spark_session("sparkdl-predict", conf=read_properties(args.spark_properties) if use_file else None)
    spark.sparkContext.setLogLevel("WARN")
    model = TorchModel.load(str(Path(args.model).resolve()) if "://" not in args.model else args.model)
    frame = spark.read.parquet(args.input)
    if args.handle_invalid:
        model.setHandleInvalid(args.handle_invalid)
    model.transform(frame).write.mode("overwrite").parquet(args.output)
    count = spark.read.parquet(args.output).count()
    print(f"scored {count} rows with {args.model} -> {args.output}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
