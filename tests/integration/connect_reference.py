"""The classic side of tests/integration/test_connect.py, run in a process of its own.

Fits the same estimator on the same Parquet data through a classic local[2] session, saves that
model, loads the model the Spark Connect run saved, and writes what the Connect tests compare
against: weights, predictions, Params, history columns and summary keys.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sparkdl  # noqa: E402
from sparkdl import TorchEstimator, TorchModel  # noqa: E402
from sparkdl.models import mlp  # noqa: E402

DIGITS_MLP = functools.partial(mlp, 64, (64,), 10)


def comparable_params(instance) -> dict:
    """Params by name, JSON-able (the model factory is compared by what it builds, elsewhere)."""
    return {param.name: value for param, value in instance.extractParamMap().items() if param.name != "model"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="directory with train/ and test/ Parquet")
    parser.add_argument("--settings", required=True, help="TorchEstimator Params as JSON (without model)")
    parser.add_argument("--connect-model", required=True, help="a TorchModel saved from Spark Connect")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spark = sparkdl.spark_session("sparkdl-connect-reference", master="local[2]", conf={
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
    spark.sparkContext.setLogLevel("ERROR")
    train = spark.read.parquet(f"{args.data}/train")
    test = spark.read.parquet(f"{args.data}/test")
    model = TorchEstimator(model=DIGITS_MLP, **json.loads(args.settings)).fit(train)
    torch.save(model.state_dict, out / "weights.pt")
    model.write().overwrite().save(str(out / "classic-model"))

    def predictions(fitted: TorchModel) -> list[float]:
        return [row.prediction for row in fitted.transform(test).orderBy("id").select("prediction").collect()]

    loaded = TorchModel.load(args.connect_model)
    (out / "reference.json").write_text(json.dumps({
        "params": comparable_params(model),
        "summary_keys": sorted(model.summary),
        "history_columns": list(model.history.columns),
        "updates": model.summary["updates"],
        "predictions": predictions(model),
        "connect_model_predictions": predictions(loaded),
        "connect_model_summary": loaded.summary,
    }, default=str))
    spark.stop()


if __name__ == "__main__":
    main()
