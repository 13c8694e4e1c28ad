"""Optional exports: tested where their packages are installed, skipped cleanly otherwise."""
from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
import torch

from sparkdl._internal.modes.result import history_frames
from sparkdl._internal.ps.server.runlog import GradientRow, UpdateRow
from sparkdl.integrations import log_mlflow, write_tensorboard

ROWS = [UpdateRow(v, 0.01 * v, 0, 2.0 / v, 32, 1, 0.5, 1, 1.0, 0.05) for v in range(1, 21)]
GRADIENTS = [GradientRow(0.01 * v, v % 2, 0, v - 1, v % 3, True) for v in range(1, 21)]


def tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    history, _, gradients = history_frames(ROWS, GRADIENTS)
    return history, gradients


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history, gradients = tables()
    write_tensorboard(history, tmp_path, gradients)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 21))
    assert losses[-1].value == pytest.approx(0.1)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    # set_experiment is process-wide (a module global and MLFLOW_EXPERIMENT_ID): undone after the test, so
    # a later test of this process does not look for this experiment in its own store
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")     # recorded as unset, so restored unset
    mlflow.set_tracking_uri(f"file://{tmp_path}")
    mlflow.set_experiment("sparkdl-tests")
    history, _ = tables()
    run_id = log_mlflow({"policy": "async", "epochs": 1}, {"test_accuracy": 0.9, "updates": 20}, history,
                        {"w": torch.ones(2)})
    run = mlflow.get_run(run_id)
    assert run.data.params["policy"] == "async" and run.data.metrics["test_accuracy"] == 0.9
    assert len(mlflow.MlflowClient().get_metric_history(run_id, "loss")) == 20


def test_missing_packages_give_install_hints(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.startswith(("mlflow", "torch.utils.tensorboard")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    history, _ = tables()
    with pytest.raises(ImportError, match="pip install tensorboard"):
        write_tensorboard(history, "unused")
    with pytest.raises(ImportError, match="pip install mlflow"):
        log_mlflow({}, {}, history)
