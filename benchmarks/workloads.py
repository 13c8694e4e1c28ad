"""Three real tables with typed inputs: sparkdl against the same model in one process, and what a user would pick.

    python jobs/prepare_data.py --datasets movielens flights tweets
    python benchmarks/workloads.py [--workloads movielens flights tweets] [--policies sync async]

For each job file (conf/movielens_mf.toml, conf/flights_embeddings.toml, conf/tweets_text.toml):

- sparkdl: the job's preprocessing Pipeline and TorchEstimator on local[2], once per policy; the
  test metric and samples/s (``summary["samples_per_second"]``: samples over the workers' training
  loops), and the fit's wall (``train_seconds``: Spark's stage, the PS, everything);
- the limit: the same model, epochs, optimizer and global batch in one PyTorch process, on the same
  preprocessed rows (read back to the driver), its samples/s over its training loop;
- the usual pick for that data: Spark's ALS on MovieLens (rank 32, regParam 0.1, 15 iterations),
  scikit-learn's HistGradientBoostingClassifier on flights (the four strings as categorical features),
  TF-IDF + LogisticRegression on tweets.

Writes benchmarks/results/workloads.json and prints one line per run.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))

import train as job_module  # noqa: E402

from sparkdl import TrainConfig, spark_session  # noqa: E402
from sparkdl._internal.data.block import Ragged  # noqa: E402
from sparkdl._internal.training.losses import resolve_loss  # noqa: E402
from sparkdl.models import MODELS  # noqa: E402

JOBS = {"movielens": "conf/movielens_mf.toml", "flights": "conf/flights_embeddings.toml",
        "tweets": "conf/tweets_text.toml"}


def binary_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def columns_of(frame, names: list[str]) -> list[np.ndarray | Ragged]:
    """Preprocessed input columns on the driver: ids and numbers as arrays, token ids as ragged rows."""
    pdf = frame.select(*names).toPandas()
    out: list[np.ndarray | Ragged] = []
    for name in names:
        values = pdf[name].to_numpy()
        first = values[0]
        if hasattr(first, "toArray"):
            out.append(np.stack([v.toArray() for v in values]).astype(np.float32))
        elif isinstance(first, (list, np.ndarray)):
            lengths = np.array([len(v) for v in values])
            out.append(Ragged(np.concatenate(values).astype(np.int64), np.concatenate([[0], np.cumsum(lengths)])))
        else:
            out.append(values.astype(np.int64 if values.dtype.kind in "iu" else np.float32))
    return out


def batch_of(columns: list[np.ndarray | Ragged], index: np.ndarray) -> tuple[list[torch.Tensor], list]:
    inputs, masks = [], []
    for column in columns:
        if isinstance(column, Ragged):
            rows = column.take(index)
            width = int(rows.lengths.max()) if len(index) else 0
            padded = np.zeros((len(index), width), np.int64)
            mask = np.arange(width)[None, :] < rows.lengths[:, None]
            padded[mask] = rows.values
            inputs.append(torch.from_numpy(padded))
            masks.append(torch.from_numpy(mask))
        else:
            inputs.append(torch.from_numpy(column[index]))
            masks.append(None)
    return inputs, masks


def plain_pytorch(model_fn, config: TrainConfig, train_cols, train_y, test_cols, input_args: list[str]):
    """The same model, optimizer, epochs and global batch in one process: (test outputs, samples/s)."""
    torch.manual_seed(config.seed)
    model = model_fn()
    optimizer = (torch.optim.Adam(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
                 if config.optimizer == "adam" else
                 torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum,
                                 weight_decay=config.weight_decay))
    loss_fn = resolve_loss(config.loss)
    target = torch.from_numpy(train_y.astype(np.int64 if config.loss == "cross_entropy" else np.float32))
    batch = config.batch_size * config.num_workers
    generator = np.random.default_rng(config.seed)
    n = len(train_y)

    def call(inputs, masks):
        if not input_args:
            return model(*inputs)
        kwargs = dict(zip(input_args, inputs, strict=True))
        kwargs.update({f"{a}_mask": m for a, m in zip(input_args, masks, strict=True) if m is not None})
        return model(**kwargs)

    started = time.perf_counter()
    for _ in range(config.epochs):
        order = generator.permutation(n)
        for start in range(0, n, batch):
            index = order[start:start + batch]
            inputs, masks = batch_of(train_cols, index)
            optimizer.zero_grad()
            loss_fn(call(inputs, masks), target[index], None).backward()
            optimizer.step()
    seconds = time.perf_counter() - started
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(test_cols[0]), 4096):
            inputs, masks = batch_of(test_cols, np.arange(start, min(start + 4096, len(test_cols[0]))))
            outputs.append(call(inputs, masks).float())
    return torch.cat(outputs), n * config.epochs / seconds


def plain_metrics(outputs: torch.Tensor, labels: np.ndarray, loss: str) -> dict[str, float]:
    if loss == "mse":
        return {"test_rmse": float(np.sqrt(np.mean((outputs.reshape(-1).numpy() - labels) ** 2)))}
    if loss == "cross_entropy":
        scores = torch.softmax(outputs, dim=1)[:, 1].numpy()
        predicted = outputs.argmax(dim=1).numpy()
    else:
        scores = torch.sigmoid(outputs.reshape(-1)).numpy()
        predicted = (scores > 0.5).astype(int)
    return {"test_accuracy": float(np.mean(predicted == labels)), "test_auc": binary_auc(labels, scores)}


def usual_pick(name: str, spark, data: dict, train_frame, test_frame) -> dict[str, float]:
    from pyspark.sql import functions as F

    if name == "movielens":
        from pyspark.ml.recommendation import ALS

        als = ALS(userCol="user", itemCol="movie", ratingCol="rating", rank=32, regParam=0.1, maxIter=15, seed=0,
                  coldStartStrategy="drop")
        scored = als.fit(train_frame).transform(test_frame)
        rmse = scored.select(F.sqrt(F.avg((F.col("prediction") - F.col("rating")) ** 2))).first()[0]
        return {"method": "Spark ALS (rank 32, regParam 0.1, 15 iterations; cold-start rows dropped)",
                "test_rmse": float(rmse)}
    train_pdf, test_pdf = train_frame.toPandas(), test_frame.toPandas()
    label = data["label_col"]
    if name == "flights":
        from sklearn.ensemble import HistGradientBoostingClassifier

        features = list(dict.fromkeys([*data["index"], *data["numeric"]]))
        strings = [c for c in data["index"] if train_pdf[c].dtype == object]
        for column in strings:
            categories = {v: i for i, v in enumerate(train_pdf[column].value_counts().index[:250])}
            train_pdf[column] = train_pdf[column].map(categories).fillna(250)
            test_pdf[column] = test_pdf[column].map(categories).fillna(250)
        model = HistGradientBoostingClassifier(categorical_features=[features.index(c) for c in strings],
                                               random_state=0)
        model.fit(train_pdf[features], train_pdf[label])
        scores = model.predict_proba(test_pdf[features])[:, 1]
        return {"method": "HistGradientBoostingClassifier (the strings as categorical features, the rest as numbers)",
                "test_accuracy": float(np.mean((scores > 0.5) == test_pdf[label])),
                "test_auc": binary_auc(test_pdf[label].to_numpy(), scores)}
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(token_pattern=r"\S+", min_df=2)
    model = LogisticRegression(max_iter=1000).fit(vectorizer.fit_transform(train_pdf[data["tokens"]]),
                                                  train_pdf[label])
    scores = model.predict_proba(vectorizer.transform(test_pdf[data["tokens"]]))[:, 1]
    return {"method": "TF-IDF + LogisticRegression", "test_accuracy": float(np.mean((scores > 0.5) == test_pdf[label])),
            "test_auc": binary_auc(test_pdf[label].to_numpy(), scores)}


def run(name: str, policies: list[str], spark, output: Path) -> dict:
    from pyspark.ml import Pipeline

    job = job_module.load_job_config(ROOT / JOBS[name], [])
    job["train"]["verbose"] = False
    data = job["data"]
    model_settings = dict(job["model"])
    model_name = model_settings.pop("name")
    train_frame = spark.read.parquet(str(ROOT / data["train"])).cache()
    test_frame = spark.read.parquet(str(ROOT / data["test"])).cache()
    results: dict = {"workload": name, "rows": train_frame.count(), "sparkdl": {}}
    for policy in policies:
        config = TrainConfig.from_mapping({**job["train"], "policy": policy})
        metrics, torch_model, _, kwargs = job_module.train_typed_table(
            spark, train_frame, job, model_name, model_settings, config, output / f"{name}-{policy}")
        results["sparkdl"][policy] = {**metrics, "samples_per_second": torch_model.summary["samples_per_second"],
                                      "train_seconds": torch_model.summary["train_seconds"]}
        print(name, "sparkdl", policy, results["sparkdl"][policy], flush=True)
    config = TrainConfig.from_mapping(job["train"])
    prepared = Pipeline(stages=job_module.preprocessing_stages(data)).fit(train_frame)
    model_fn = functools.partial(MODELS[model_name], **job_module.fill_indexed(model_settings, prepared, data))
    train_rows, test_rows = prepared.transform(train_frame), prepared.transform(test_frame)
    label = data["label_col"]
    outputs, rate = plain_pytorch(model_fn, config, columns_of(train_rows, data["input_cols"]),
                                  train_rows.select(label).toPandas()[label].to_numpy(),
                                  columns_of(test_rows, data["input_cols"]), list(data.get("input_args", [])))
    results["pytorch"] = {**plain_metrics(outputs, test_rows.select(label).toPandas()[label].to_numpy(), config.loss),
                          "samples_per_second": rate}
    print(name, "pytorch", results["pytorch"], flush=True)
    results["usual_pick"] = usual_pick(name, spark, data, train_frame, test_frame)
    print(name, "usual pick", results["usual_pick"], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--policies", nargs="+", default=["sync", "async"])
    args = parser.parse_args()
    spark = spark_session("sparkdl-workloads", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    output = ROOT / "runs" / "workloads"
    target = ROOT / "benchmarks" / "results" / "workloads.json"
    # a run of some workloads keeps the others' last figures
    kept = {r["workload"]: r for r in json.loads(target.read_text())} if target.exists() else {}
    for name in args.workloads:
        kept[name] = run(name, args.policies, spark, output)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps([kept[name] for name in JOBS if name in kept], indent=2, default=float) + "\n")
    spark.stop()


if __name__ == "__main__":
    main()
