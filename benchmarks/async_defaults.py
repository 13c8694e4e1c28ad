"""The asynchronous defaults, measured: the async job configs, run after run, and small data sets over seeds.

    python benchmarks/async_defaults.py [--runs 20] [--configs conf/mnist_async.toml conf/mnist_shards.toml]
                                        [--set train.epochs=8] [--settings ignore auto]
                                        [--small-seeds 3] [--no-configs] [--no-small]

Part 1, the job configs as `make run` trains them (jobs/train.py: a TorchEstimator fitted on the train
parquet, the test split scored by ``transform``), ``--runs`` times each with ``implicit_momentum`` "ignore"
and "auto", alternately (one Spark session; a seed does not fix an async run, so the runs spread).
Part 2, small data sets (scikit-learn's diabetes regression, 442 rows, and wine classification, 178 rows;
a quarter held out, standardised on the training rows): an MLP with one hidden layer of 16 trained 30 epochs
at a global batch of 32 by one process (plain PyTorch), by sync and by async on 2 workers with Adam 0.01, and
by async with SGD 0.05 momentum 0.9 under both momentum settings; the Adam runs again on the raw features
(and diabetes' raw target); R^2 (diabetes) and accuracy (wine) on the held-out rows.
Writes benchmarks/results/async_defaults.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))

from train import load_job_config  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.models import MODELS, mlp  # noqa: E402

SMALL_EPOCHS, SMALL_BATCH = 30, 32
MOMENTUM_SETTINGS = ("ignore", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--configs", nargs="+", type=Path,
                        default=[ROOT / "conf" / "mnist_async.toml", ROOT / "conf" / "mnist_shards.toml"])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a setting of every job file (as jobs/train.py --set); repeatable")
    parser.add_argument("--settings", nargs="+", default=list(MOMENTUM_SETTINGS), choices=MOMENTUM_SETTINGS,
                        help="the implicit_momentum values to compare")
    parser.add_argument("--small-seeds", type=int, default=3)
    parser.add_argument("--no-configs", action="store_true")
    parser.add_argument("--no-small", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "async_defaults.json")
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-async-defaults", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, list[dict]] = {"configs": [], "small": []}
    if not args.no_configs:
        for path in args.configs:
            results["configs"] += config_runs(spark, path, args.runs, args.overrides, args.settings)
    if not args.no_small:
        for seed in range(args.small_seeds):
            results["small"] += small_runs(spark, seed)
    spark.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {args.out}")


def config_runs(spark, path: Path, runs: int, overrides: list[str], settings: list[str]) -> list[dict]:
    """``runs`` fits of the job file under each momentum setting, alternately, as jobs/train.py fits it."""
    from pyspark.sql import functions as F

    job = load_job_config(path, overrides)
    model_settings = dict(job["model"])
    model_fn = functools.partial(MODELS[model_settings.pop("name", "mlp")], **model_settings)
    base = sparkdl.TrainConfig.from_mapping({**job["train"], "verbose": False})
    train = spark.read.parquet(str(ROOT / job["data"]["train"])).cache()
    test = spark.read.parquet(str(ROOT / job["data"]["test"])).cache()
    train.count(), test.count()
    rows = []
    for run in range(runs):
        for setting in settings:
            estimator = sparkdl.TorchEstimator.from_train_config(base.replace(implicit_momentum=setting),
                                                                 model=model_fn)
            model = estimator.fit(train)
            scored = model.transform(test)
            accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
            rows.append({"config": path.name, "overrides": overrides, "run": run, "implicit_momentum": setting,
                         "server_momentum": model.summary["server_momentum"], "accuracy": float(accuracy)})
            print(f"{path.name} run {run:2d} {setting:7s} (momentum {model.summary['server_momentum']:.2f}): "
                  f"accuracy {accuracy:.4f}", flush=True)
    train.unpersist(), test.unpersist()
    for setting in settings:
        scores = [r["accuracy"] for r in rows if r["implicit_momentum"] == setting]
        print(f"{path.name} {setting}: min {min(scores):.4f} mean {np.mean(scores):.4f} "
              f">= 0.90 in {sum(s >= 0.90 for s in scores)} of {len(scores)}", flush=True)
    return rows


def small_sets(seed: int, standardise: bool) -> dict[str, tuple]:
    """Diabetes and wine, a quarter held out (split by ``seed``); ``standardise``: scaled on the training rows."""
    from sklearn.datasets import load_diabetes, load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    sets = {}
    for name, loader in (("diabetes", load_diabetes), ("wine", load_wine)):
        x, y = loader(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
        if standardise:
            scaler = StandardScaler().fit(x_train)
            x_train, x_test = (scaler.transform(a) for a in (x_train, x_test))
        x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
        y_train, y_test = y_train.astype(np.float32), y_test.astype(np.float32)
        if name == "diabetes" and standardise:       # the target standardised too, so Adam's step suits it
            mean, std = y_train.mean(), y_train.std()
            y_train, y_test = ((y_train - mean) / std).astype(np.float32), ((y_test - mean) / std).astype(np.float32)
        sets[name] = (x_train, y_train, x_test, y_test)
    return sets


def small_runs(spark, seed: int) -> list[dict]:
    """One process, sync, async with Adam, async with SGD under each momentum setting, on both small sets
    standardised; and the Adam runs on the raw features (and raw target)."""
    rows = []
    sets = [("", name, arrays) for name, arrays in small_sets(seed, True).items()]
    sets += [(" raw", name, arrays) for name, arrays in small_sets(seed, False).items()]
    for prepared, name, (x_train, y_train, x_test, y_test) in sets:
        regression = name == "diabetes"
        outputs = 1 if regression else int(y_train.max()) + 1
        model_fn = functools.partial(mlp, x_train.shape[1], (16,), outputs)
        target = (lambda v: torch.tensor(v).view(-1, 1)) if regression else (lambda v: torch.tensor(v).long())
        loss = "mse" if regression else "cross_entropy"
        data = spark.sparkContext.parallelize(
            [(x, float(v) if regression else int(v)) for x, v in zip(x_train, y_train)], 2).cache()
        adam = sparkdl.TrainConfig(num_workers=2, epochs=SMALL_EPOCHS, batch_size=SMALL_BATCH // 2, loss=loss,
                                   optimizer="adam", learning_rate=0.01, seed=seed, verbose=False)
        sgd = adam.replace(optimizer="sgd", learning_rate=0.05, momentum=0.9)
        runs = {"one process adam": None, "sync adam": adam, "async adam": adam.replace(policy="async")}
        if not prepared:
            runs.update({f"async sgd {s}": sgd.replace(policy="async", implicit_momentum=s) for s in MOMENTUM_SETTINGS})
        for label, config in runs.items():
            if config is None:
                model = one_process(model_fn, x_train, target(y_train), loss, seed)
            else:
                model = sparkdl.train(data, model_fn, config).model(model_fn)
            with torch.inference_mode():
                predicted = model(torch.from_numpy(x_test))
            score = r_squared(predicted.view(-1), torch.from_numpy(y_test)) if regression else \
                float((predicted.argmax(1) == torch.from_numpy(y_test)).float().mean())
            rows.append({"set": name + prepared, "seed": seed, "run": label, "score": score,
                         "metric": "r2" if regression else "accuracy"})
            print(f"{name + prepared:12s} seed {seed} {label:18s}: {'R^2' if regression else 'accuracy'} {score:.3f}",
                  flush=True)
        data.unpersist()
    return rows


def one_process(model_fn, x: np.ndarray, y: torch.Tensor, loss: str, seed: int) -> torch.nn.Module:
    """Plain PyTorch: Adam 0.01 at the global batch, shuffled each epoch, as many epochs."""
    torch.manual_seed(seed)
    model = model_fn()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    criterion = torch.nn.MSELoss() if loss == "mse" else torch.nn.CrossEntropyLoss()
    features = torch.from_numpy(x)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(SMALL_EPOCHS):
        order = torch.randperm(len(features), generator=generator)
        for start in range(0, len(order), SMALL_BATCH):
            batch = order[start:start + SMALL_BATCH]
            optimizer.zero_grad()
            criterion(model(features[batch]), y[batch]).backward()
            optimizer.step()
    return model.eval()


def r_squared(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    return float(1 - ((predicted - actual) ** 2).sum() / ((actual - actual.mean()) ** 2).sum())


if __name__ == "__main__":
    main()
