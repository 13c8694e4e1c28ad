"""The classic side of tests/integration/test_connect.py.

The Connect tests compare their fit with the same fit through classic Spark, and check that
each mode loads the other's saved model.  Under the whole suite the classic test session runs
these functions itself, around the Connect run (:func:`classic_run` before it,
:func:`scored_by_classic` after it); when the Connect tests run on their own, they start this
file as a script, which does both in a classic session of its own.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sparkdl  # noqa: E402
from sparkdl import TorchEstimator, TorchModel  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

DIGITS_MLP = functools.partial(mlp, 64, (64,), 10)
#: the run compared: sync with two workers is deterministic for a given seed
SETTINGS = dict(optimizer="sgd", learningRate=0.05, momentum=0.9, batchSize=16, epochs=8, numWorkers=2,
                updatePolicy="sync", seed=3)


def comparable_params(instance) -> dict:
    """Params by name, JSON-able (the model factory is compared by what it builds, elsewhere)."""
    return {param.name: value for param, value in instance.extractParamMap().items() if param.name != "model"}


def write_digits(spark: Any, digits: tuple, root: Path) -> None:
    """Digits as Parquet under ``root`` (one file per split, so both modes read the same partitions)."""
    x_train, x_test, y_train, y_test = digits
    for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        rows = [(i, row.tolist(), int(label)) for i, (row, label) in enumerate(zip(x, y))]
        (spark.createDataFrame(rows, "id long, features array<float>, label long")
         .coalesce(1).write.parquet(str(root / name)))


def predictions(spark: Any, model: TorchModel, root: Path) -> list[float]:
    test = spark.read.parquet(str(root / "test"))
    return [row.prediction for row in model.transform(test).orderBy("id").select("prediction").collect()]


def classic_run(spark: Any, root: Path) -> None:
    """Fit SETTINGS on ``root``'s data; save weights.pt, classic-model and reference.json there."""
    model = TorchEstimator(model=DIGITS_MLP, **SETTINGS).fit(spark.read.parquet(str(root / "train")))
    torch.save(model.state_dict, root / "weights.pt")
    model.write().overwrite().save(str(root / "classic-model"))
    reference = {"params": comparable_params(model), "summary_keys": sorted(model.summary),
                 "history_columns": list(model.history.columns), "updates": model.summary["updates"],
                 "predictions": predictions(spark, model, root)}
    (root / "reference.json").write_text(json.dumps(reference, default=str))


def scored_by_classic(spark: Any, root: Path) -> dict:
    """The model the Connect run saved (``root``/connect-model), loaded and scored by classic Spark."""
    loaded = TorchModel.load(str(root / "connect-model"))
    return {"predictions": predictions(spark, loaded, root), "summary": loaded.summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", type=Path, help="directory with train/ and test/ Parquet and connect-model/")
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-connect-reference", master="local[2]", conf={
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
    spark.sparkContext.setLogLevel("ERROR")
    classic_run(spark, args.root)
    (args.root / "scored-by-classic.json").write_text(json.dumps(scored_by_classic(spark, args.root), default=float))
    spark.stop()


if __name__ == "__main__":
    main()
