"""Train a model on Parquet data through sparkdl and evaluate it on the test split.

    python jobs/train.py --config conf/mnist_async.toml --output runs/mnist [--set train.policy=sync ...]
    PYSPARK_PYTHON=.venv/bin/python spark-submit --properties-file conf/local.properties \\
        jobs/train.py --config conf/mnist_async.toml --output runs/mnist

By default the job trains through the DataFrame API (TorchEstimator: Arrow batches into the
workers, scoring on the executors) and saves a TorchModel to OUTPUT/model, which
jobs/predict.py can load.  ``--api rdd`` uses the functional ``sparkdl.train`` on an RDD.
Both write OUTPUT/metrics.json (results, and the effective training settings under "config"),
OUTPUT/history.csv and OUTPUT/model.pt (the state_dict).  ``--set train.<field>=<value>``
overrides any ``TrainConfig`` field.

Tables with typed columns name the model's inputs in ``[data]`` (DataFrame API only):
``input_cols`` (and optionally ``input_args``), ``label_col``, ``weight_col``, and what a
pyspark.ml Pipeline does first: ``index`` (StringIndexer per string column -> ``<column>_id``,
an int id), ``numeric`` (VectorAssembler + StandardScaler -> ``numeric``), ``tokens`` (a text
column through RegexTokenizer + sparkdl's TokenIndexer -> ``ids``, ``vocab_size`` tokens).
A ``[model]`` value ``"indexed"`` is filled from the fitted Pipeline: ``cardinalities`` (one per
``index`` column) or ``vocabulary``.  The whole PipelineModel is saved to OUTPUT/model.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from sparkdl import TrainConfig, spark_session, train
from sparkdl._internal.spark.session import read_properties, under_spark_submit
from sparkdl.models import MODELS

DEFAULT_PROPERTIES = Path(__file__).resolve().parent.parent / "conf" / "local.properties"


def parse_value(text: str) -> Any:
    """A TOML value (number, bool, list, quoted string), else the raw text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def missing_data(job: dict[str, Any], config_path: Path) -> str | None:
    """Why the job's local input files are not there, and how to make them (None: they are, or are URIs)."""
    from prepare_data import DATASETS

    for role in ("train", "test"):
        where = str(job["data"].get(role, ""))
        if not where or "://" in where or Path(where).exists():
            continue
        name = Path(where).parent.name
        how = (f"prepare it with `python jobs/prepare_data.py --datasets {name}`" if name in DATASETS else
               f"jobs/prepare_data.py writes the data sets {DATASETS} to data/<name>/")
        return f"{config_path}: the {role} data {where} does not exist; {how}"
    return None


def load_job_config(path: Path, overrides: list[str]) -> dict[str, Any]:
    """The TOML job file with ``section.key=value`` overrides applied."""
    config = tomllib.loads(path.read_text())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set expects section.key=value (e.g. train.policy=sync), got {item!r}")
        section, name = key.split(".", 1)
        config.setdefault(section, {})[name] = parse_value(value)
    for section in ("data", "model", "train"):
        if section not in config:
            raise SystemExit(f"{path}: missing the [{section}] section")
    return config


def read_parquet_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(path, columns=["features", "label"])
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
    return features, table.column("label").to_numpy()


def train_with_estimator(spark, train_frame, job: dict[str, Any], model_fn, config: TrainConfig, output: Path):
    """Fit a TorchEstimator, save the TorchModel, score the test split on the executors."""
    from pyspark.sql import functions as F

    from sparkdl import TorchEstimator

    estimator = TorchEstimator.from_train_config(config, model=model_fn)
    model = estimator.fit(train_frame)
    model.write().overwrite().save(str((output / "model").resolve()))
    test_frame = spark.read.parquet(str(Path(job["data"]["test"]).resolve()))
    scored = model.transform(test_frame)
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
    return float(accuracy), model.summary, model.history, model.state_dict, model.gradients


def preprocessing_stages(data: dict[str, Any]) -> list[Any]:
    """The pyspark.ml stages the ``[data]`` section asks for, before the TorchEstimator."""
    from pyspark.ml.feature import RegexTokenizer, SQLTransformer, StandardScaler, StringIndexer, VectorAssembler

    from sparkdl.ml.vocabulary import TokenIndexer

    stages: list[Any] = []
    indexed = list(data.get("index", []))
    if indexed:
        stages.append(StringIndexer(inputCols=indexed, outputCols=[f"{c}_index" for c in indexed],
                                    handleInvalid="keep"))
        casts = ", ".join(f"CAST({c}_index AS INT) AS {c}_id" for c in indexed)
        stages.append(SQLTransformer(statement=f"SELECT *, {casts} FROM __THIS__"))
    if data.get("numeric"):
        stages += [VectorAssembler(inputCols=list(data["numeric"]), outputCol="numeric_raw"),
                   StandardScaler(inputCol="numeric_raw", outputCol="numeric", withMean=True)]
    if data.get("tokens"):
        stages += [RegexTokenizer(inputCol=data["tokens"], outputCol="tokens", pattern="\\s+", gaps=True),
                   TokenIndexer(inputCol="tokens", outputCol="ids", vocabSize=int(data.get("vocab_size", 20000)),
                                minCount=int(data.get("min_count", 2)))]
    return stages


def fill_indexed(model_settings: dict[str, Any], prepared: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``"indexed"`` model values from the fitted stages: categories per index column (+1 unseen), the vocabulary."""
    from pyspark.ml.feature import StringIndexerModel

    from sparkdl.ml.vocabulary import TokenIndexerModel

    filled = dict(model_settings)
    for stage in prepared.stages:
        if isinstance(stage, StringIndexerModel) and filled.get("cardinalities") == "indexed":
            filled["cardinalities"] = [len(labels) + 1 for labels in stage.labelsArray]
        if isinstance(stage, TokenIndexerModel) and filled.get("vocabulary") == "indexed":
            filled["vocabulary"] = len(stage.getVocabulary()) + 2
    if data.get("numeric") and filled.get("numeric_features") == "indexed":
        filled["numeric_features"] = len(data["numeric"])
    return filled


def score_table(scored, label: str, loss: Any) -> dict[str, float]:
    """Test metrics: accuracy (and ROC AUC for a binary classifier), or RMSE for a regression."""
    from pyspark.ml.evaluation import BinaryClassificationEvaluator
    from pyspark.sql import functions as F

    if loss == "mse":
        return {"test_rmse": scored.select(F.sqrt(F.avg((F.col("prediction") - F.col(label)) ** 2))).first()[0]}
    metrics = {"test_accuracy": scored.select(F.avg((F.col("prediction") == F.col(label)).cast("double"))).first()[0]}
    if loss == "bce_with_logits" or scored.select(F.max(label)).first()[0] == 1:
        metrics["test_auc"] = BinaryClassificationEvaluator(rawPredictionCol="probability", labelCol=label).evaluate(
            scored.withColumn(label, F.col(label).cast("double")))
    return metrics


def train_typed_table(spark, train_frame, job: dict[str, Any], model_name: str, model_settings: dict[str, Any],
                      config: TrainConfig, output: Path):
    """Fit the ``[data]`` section's preprocessing, then a TorchEstimator on its typed inputs; score the test split."""
    from pyspark.ml import Pipeline, PipelineModel

    from sparkdl import TorchEstimator

    data = job["data"]
    prepared = Pipeline(stages=preprocessing_stages(data)).fit(train_frame)
    kwargs = fill_indexed(model_settings, prepared, data)
    model_fn = functools.partial(MODELS[model_name], **kwargs)
    estimator = TorchEstimator.from_train_config(
        config, model=model_fn, inputCols=list(data["input_cols"]), inputArgs=list(data.get("input_args", [])),
        labelCol=data.get("label_col", "label"), weightCol=data.get("weight_col", ""))
    torch_model = estimator.fit(prepared.transform(train_frame))
    fitted = PipelineModel(stages=[*prepared.stages, torch_model])
    fitted.write().overwrite().save(str((output / "model").resolve()))
    test_frame = spark.read.parquet(str(Path(data["test"]).resolve()))
    metrics = score_table(fitted.transform(test_frame), data.get("label_col", "label"), config.loss)
    return metrics, torch_model, model_fn, kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="TOML job file (see conf/)")
    parser.add_argument("--output", required=True, type=Path, help="directory for metrics, history and model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a setting of the job file; repeatable")
    parser.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard event files to DIR")
    parser.add_argument("--mlflow", action="store_true", help="also log params, metrics and weights to MLflow")
    parser.add_argument("--mlflow-model", nargs="?", const="", metavar="NAME",
                        help="also log the trained model as an MLflow model (PyTorch flavor with a signature, plus "
                             "the Spark model); with NAME, register it under that name")
    parser.add_argument("--quiet", action="store_true", help="no live progress bar on stderr")
    parser.add_argument("--resume-from", metavar="DIR",
                        help="continue from the newest complete checkpoint in DIR (same as --set train.resume_from=DIR)")
    parser.add_argument("--api", choices=["dataframe", "rdd"], default="dataframe",
                        help="train through TorchEstimator (default) or sparkdl.train on an RDD")
    parser.add_argument("--spark-properties", type=Path, default=DEFAULT_PROPERTIES,
                        help="Spark properties used when not started by spark-submit (default: conf/local.properties)")
    args = parser.parse_args(argv)

    job = load_job_config(args.config, args.overrides)
    if args.resume_from:
        job["train"]["resume_from"] = args.resume_from
    job["train"].setdefault("verbose", not args.quiet)
    if args.quiet:
        job["train"]["verbose"] = False
    model_settings = dict(job["model"])
    model_name = model_settings.pop("name", "mlp")
    if model_name not in MODELS:
        raise SystemExit(f"unknown model {model_name!r}; choose one of {sorted(MODELS)}")
    model_fn = functools.partial(MODELS[model_name], **model_settings)   # "indexed" values: filled once fitted
    try:
        config = TrainConfig.from_mapping(job["train"])
    except ValueError as exc:
        raise SystemExit(f"{args.config}: {exc}") from None

    missing = missing_data(job, args.config)
    if missing:
        raise SystemExit(missing)
    # Under spark-submit its own --master/--properties-file rule; plain python uses the local file.
    use_file = not under_spark_submit() and args.spark_properties.exists()
    spark = spark_session("sparkdl-train", conf=read_properties(args.spark_properties) if use_file else None)
    spark.sparkContext.setLogLevel("WARN")
    train_frame = spark.read.parquet(str(Path(job["data"]["train"]).resolve()))
    if "input_cols" in job["data"]:
        if args.api != "dataframe":
            raise SystemExit(f"{args.config}: typed input columns (input_cols) train through the DataFrame API only")
        scores, torch_model, model_fn, model_settings = train_typed_table(
            spark, train_frame, job, model_name, model_settings, config, args.output)
        metrics = {**scores, "api": args.api, "train_file": job["data"]["train"], "master": spark.sparkContext.master,
                   **torch_model.summary, "config": config.to_json_dict(), "model": model_settings}
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float) + "\n")
        torch_model.history.to_csv(args.output / "history.csv", index=False)
        torch.save(torch_model.state_dict, args.output / "model.pt")
        shown = " ".join(f"{name}={value:.4f}" for name, value in scores.items())
        print(f"policy={config.policy} workers={config.num_workers} epochs={config.epochs} {shown} "
              f"train_seconds={torch_model.summary['train_seconds']:.2f} "
              f"samples_per_second={torch_model.summary['samples_per_second']:.0f} -> {args.output}")
        spark.stop()
        return 0
    if args.api == "dataframe":
        accuracy, result_summary, history, state, gradients = train_with_estimator(
            spark, train_frame, job, model_fn, config, args.output)
    else:
        rows = train_frame.select("features", "label").rdd.map(
            lambda row: (np.asarray(row[0], dtype=np.float32), int(row[1])))
        result = train(rows, model_fn, config)
        test_x, test_y = read_parquet_arrays(job["data"]["test"])
        accuracy = result.accuracy(model_fn, test_x, test_y)
        result_summary, history, state = result.summary, result.history, result.state_dict
        gradients = result.gradients
    metrics = {"test_accuracy": accuracy, "api": args.api, "train_file": job["data"]["train"],
               "master": spark.sparkContext.master, **result_summary, "config": config.to_json_dict()}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float) + "\n")
    history.to_csv(args.output / "history.csv", index=False)
    try:
        from sparkdl.plots import plot_history

        validation = pd.DataFrame(result_summary.get("validation", []))
        plot_history(history, args.output / "history.png", gradients,
                     title=f"{config.policy}, {config.num_workers} workers, test accuracy {accuracy:.3f}",
                     validation=validation)
    except ImportError as exc:
        print(f"history.png not written: {exc}", file=sys.stderr)
    if args.tensorboard:
        from sparkdl.integrations import write_tensorboard

        write_tensorboard(history, args.tensorboard, gradients)
    if args.mlflow or args.mlflow_model is not None:
        import mlflow

        from sparkdl import TorchModel
        from sparkdl.integrations import log_mlflow, log_mlflow_model

        run_id = log_mlflow({**job["train"], "model": model_name}, metrics, history, state, run_name=args.config.stem)
        if args.mlflow_model is not None:
            fitted = TorchModel._from_saved(state, history.to_dict("records"), result_summary)
            fitted._set(model=model_fn, loss=config.loss)
            examples, _ = read_parquet_arrays(job["data"]["test"])
            with mlflow.start_run(run_id=run_id):
                uri = log_mlflow_model(fitted, examples[:5], registered_model_name=args.mlflow_model or None)
            print(f"MLflow model: {uri}")
    torch.save(state, args.output / "model.pt")
    (args.output / "model.json").write_text(json.dumps({"name": model_name, "kwargs": model_settings}, indent=2))
    print(f"api={args.api} policy={config.policy} workers={config.num_workers} epochs={config.epochs} "
          f"test_accuracy={accuracy:.4f} train_seconds={result_summary['train_seconds']:.2f} "
          f"samples_per_second={result_summary['samples_per_second']:.0f} -> {args.output}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
