"""Pipeline runs that need more task slots and their own cluster than the shared test session has:
one executor of four task slots whose Python workers may use 1500 MiB each.  The runs named go one
after another in one session; each prints one ``RESULT {json}`` line (or the error it raised).
Used by test_pipeline_cluster.py, which runs all three in one process: one cluster start for all.

    python tests/e2e/pipeline_run.py replicas        # P = 2 x D = 2, and P = 4
    python tests/e2e/pipeline_run.py --marker-dir D kill   # a stage task SIGKILLed mid-run
    python tests/e2e/pipeline_run.py memory          # a model that one task's Python memory cannot hold
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from fault_run import kill_when  # this directory: the script runs from it
from script_results import report_each
from torch import nn

import sparkdl
from sparkdl import SparkDLError, TorchEstimator, TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root, for the tests package
from tests.reference import largest_difference, single_process_sgd  # noqa: E402


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=0, stratify=y)


def deep_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def replicas(spark) -> dict:
    """P = 2, D = 2 and P = 4, D = 1 each equal one process's SGD (with batch D x b); P = 2 learns digits."""
    x_train, x_test, y_train, y_test = digits()
    batch, steps = 8, 10
    n = 2 * batch * steps
    x, y = x_train[:n], y_train[:n]
    rdd = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2)    # contiguous halves: one per replica
    config = TrainConfig(num_workers=2, pipeline_stages=2, micro_batches=2, policy="sync", epochs=2,
                         batch_size=batch, learning_rate=0.1, shuffle=False, seed=7)
    result = train(rdd, deep_mlp, config)
    initial, reference = single_process_sgd(deep_mlp, [(x[:n // 2], y[:n // 2]), (x[n // 2:], y[n // 2:])], batch,
                                            steps, config.epochs, config.learning_rate, config.seed)

    def frame(features, labels):
        return spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(features, labels)],
                                     "features array<float>, label long")

    estimator = TorchEstimator(model=deep_mlp, pipelineStages=2, microBatches=4, numWorkers=2, batchSize=32,
                               epochs=8, optimizer="sgd", learningRate=0.05, momentum=0.9)
    model = estimator.fit(frame(x_train, y_train))
    scored = model.transform(frame(x_test, y_test)).select("prediction", "label").collect()
    accuracy = float(np.mean([row.prediction == row.label for row in scored]))
    # four stages, one replica, micro-batches of two: the same as one process with batch 8
    four_config = config.replace(num_workers=1, pipeline_stages=4, micro_batches=4)
    four = train(spark.sparkContext.parallelize(list(zip(x[:n // 2], y[:n // 2].tolist())), 1), deep_mlp,
                 four_config)
    _, four_reference = single_process_sgd(deep_mlp, [(x[:n // 2], y[:n // 2])], batch, steps, four_config.epochs,
                                           four_config.learning_rate, four_config.seed)
    return {"equal_error": largest_difference(result.state_dict, reference),
            "moved": largest_difference(result.state_dict, initial), "updates": result.summary["updates"],
            "tasks": [(w["worker"], w["pipeline_stage"]) for w in result.workers],
            "fit_accuracy": accuracy, "fit_summary": model.summary,
            "four_equal_error": largest_difference(four.state_dict, four_reference),
            "four_updates": four.summary["updates"],
            "four_stage_parameters": [w["parameter_bytes"] // 4 for w in four.workers]}


class Reporting(nn.Module):
    """The last layer; on partition 1 (the last stage of replica 0) it reports its process and progress."""

    def __init__(self, marker_dir: str) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 10)
        self.marker_dir = marker_dir
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        context = TaskContext.get()
        if self.training and context is not None and context.partitionId() == 1:
            self.calls += 1
            if self.calls % 10 == 1:   # written whole (temp + rename): the reader never sees half
                path = Path(self.marker_dir) / f"{context.taskAttemptId()}.progress"
                temporary = path.with_suffix(".tmp")
                temporary.write_text(f"{os.getpid()} {self.calls}")
                os.replace(temporary, path)
        return self.linear(x)


def reporting_mlp(marker_dir: str):
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), Reporting(marker_dir))
    return build


def kill(spark, marker_dir: Path) -> dict:
    """Train P = 2 undisturbed, then with the last stage's Python worker killed mid-run."""
    x_train, x_test, y_train, y_test = digits()
    rdd = spark.sparkContext.parallelize(list(zip(x_train, y_train.tolist())), 1)
    config = TrainConfig(num_workers=1, pipeline_stages=2, micro_batches=2, policy="sync", epochs=3, batch_size=16,
                         learning_rate=0.05, momentum=0.9, timeout_s=30, max_attempts=3)
    outcome = {}
    for name in ("clean", "faulty"):
        directory = marker_dir / name
        directory.mkdir(parents=True)
        record: dict = {}
        killer = None
        if name == "faulty":
            killer = threading.Thread(target=kill_when, args=(directory, 300, record), daemon=True)
            killer.start()
        model_fn = reporting_mlp(str(directory))
        result = train(rdd, model_fn, config)
        if killer is not None:
            killer.join(timeout=1)
            if not record:
                raise RuntimeError("the stage task was never killed: the run finished first")
        outcome[name] = {"accuracy": result.accuracy(model_fn, x_test, y_test), **result.summary,
                         "events": result.events, "workers": result.workers, "kill": record}
    return outcome


def huge_mlp() -> nn.Sequential:
    """67M parameters (256 MiB): 16 layers of 2048 x 2048."""
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers[:-1], nn.Linear(2048, 4))


def memory(spark) -> dict:
    """Under a 1500 MiB per-task Python limit: one task cannot hold the model, four stages can."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2048)).astype(np.float32)
    y = rng.integers(0, 4, 64)
    rdd = spark.sparkContext.parallelize([(x[i], int(y[i])) for i in range(64)], 1)
    config = TrainConfig(num_workers=1, policy="sync", batch_size=16, epochs=1, learning_rate=0.01, timeout_s=120,
                         max_attempts=2)
    out: dict = {}
    try:
        train(rdd, huge_mlp, config)
        out["one_task"] = "trained"
    except SparkDLError as exc:
        out["one_task"] = f"{type(exc).__name__}: {exc}"
    result = train(rdd, huge_mlp, config.replace(pipeline_stages=4, micro_batches=4))
    out["four_stages"] = {"updates": result.summary["updates"], "attempts": result.summary["attempts"],
                          "parameter_bytes": [w["parameter_bytes"] for w in result.workers],
                          "peak_rss_bytes": [w["peak_rss_bytes"] for w in result.workers],
                          "finite": all(bool(torch.isfinite(v).all()) for v in result.state_dict.values())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("modes", nargs="+", choices=["replicas", "kill", "memory"])
    parser.add_argument("--marker-dir", type=Path, help="kill: where the stage task reports its progress")
    args = parser.parse_args()
    if "kill" in args.modes and args.marker_dir is None:
        parser.error("kill needs --marker-dir")
    # one executor, four task slots, 1500 MiB of Python memory per task
    spark = sparkdl.spark_session("sparkdl-pipeline", master="local-cluster[1,4,1024]", conf={
        "spark.ui.enabled": "false", "spark.executor.cores": "4", "spark.executor.pyspark.memory": "6000m"})
    spark.sparkContext.setLogLevel("ERROR")
    runs = {"replicas": lambda: replicas(spark), "kill": lambda: kill(spark, args.marker_dir),
            "memory": lambda: memory(spark)}
    report_each({mode: runs[mode] for mode in args.modes})
    spark.stop()


if __name__ == "__main__":
    main()
