"""Validation while training and early stopping, on real data (scikit-learn digits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkdl import TrainConfig, train
from sparkdl._internal.training.loop import holdout_split
from tests.conftest import DIGITS_MLP

CONFIG = TrainConfig(num_workers=2, policy="sync", epochs=40, batch_size=16, learning_rate=0.3, momentum=0.9,
                     validation_fraction=0.2, early_stopping_patience=2, seed=1)


def holdout_loss(state_dict, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Loss and accuracy of these weights on exactly the rows the two workers held out."""
    halves = [(x[:len(x) // 2], y[:len(y) // 2]), (x[len(x) // 2:], y[len(y) // 2:])]   # parallelize's 2 slices
    rows = [(hx[held.numpy()], hy[held.numpy()]) for worker, (hx, hy) in enumerate(halves)
            for held in [holdout_split(len(hx), CONFIG.validation_fraction, CONFIG.seed, worker)[1]]]
    vx = torch.from_numpy(np.concatenate([r[0] for r in rows]))
    vy = torch.from_numpy(np.concatenate([r[1] for r in rows]))
    model = DIGITS_MLP()
    model.load_state_dict(state_dict)
    with torch.no_grad():
        output = model.eval()(vx)
    return float(torch.nn.functional.cross_entropy(output, vy)), float((output.argmax(1) == vy).float().mean())


@pytest.fixture(scope="module")
def runs(digits_rdd):
    return {restore: train(digits_rdd, DIGITS_MLP, CONFIG.replace(restore_best_weights=restore))
            for restore in (True, False)}


def test_early_stopping_stops_and_the_curves_are_recorded(runs):
    result = runs[True]
    summary = result.summary
    assert summary["stopped_early"] and summary["best_epoch"] is not None
    validated = list(result.validation["epoch"])
    assert validated == list(range(len(validated))) and len(validated) < CONFIG.epochs
    # stopped `patience` validations after the best one
    assert validated[-1] == summary["best_epoch"] + CONFIG.early_stopping_patience
    assert {"val_loss", "val_metric"} <= set(result.epochs.columns)
    assert result.validation["val_metric"].max() > 0.9 and summary["validation_metric"] == "accuracy"
    assert any(e["event"] == "stopped_early" for e in result.events)


def test_keep_best_restores_the_best_epochs_weights(runs, digits):
    x_train, _, y_train, _ = digits
    best = runs[True]
    loss, accuracy = holdout_loss(best.state_dict, x_train, y_train)
    assert loss == pytest.approx(best.summary["best_val_loss"], rel=1e-4)
    assert accuracy == pytest.approx(best.summary["best_val_metric"], abs=1e-6)
    last = runs[False]                         # the same deterministic run, keeping the last weights
    loss, _ = holdout_loss(last.state_dict, x_train, y_train)
    assert loss == pytest.approx(last.summary["val_loss"], rel=1e-4)
    assert last.summary["val_loss"] > best.summary["best_val_loss"]


def test_every_epoch_of_an_async_run_is_validated_on_every_workers_held_out_rows(digits_rdd):
    """Under the global sample budget the worker whose push spends it, and the other one told to stop then, are
    inside the last epoch: each still reports its part of it, so that epoch is validated on both workers' rows."""
    result = train(digits_rdd, DIGITS_MLP, CONFIG.replace(policy="async", epochs=4, learning_rate=0.05,
                                                        early_stopping_patience=None))
    held_out = [len(holdout_split(n, CONFIG.validation_fraction, CONFIG.seed, worker)[1])
                for worker, n in enumerate(digits_rdd.glom().map(len).collect())]   # the two workers' partitions
    # the budget is 4 epochs of the whole data; a worker the scheduler favours may train more epochs of its
    # partition than the other.  A worker reports every epoch it completed, and the run's epoch it was stopped
    # inside: each epoch is validated on the held-out rows of every worker that reports it
    reported = {}
    for w in result.workers:
        completed, partial = divmod(w["batches"], w["steps_per_epoch"])
        reported[w["worker"]] = set(range(completed)) | ({completed} if partial and completed < 4 else set())
    epochs = list(result.validation["epoch"])
    assert epochs == sorted(set().union(*reported.values())) and epochs[:4] == [0, 1, 2, 3], result.validation
    assert list(result.validation["samples"]) == [sum(rows for worker, rows in enumerate(held_out)
                                                      if epoch in reported[worker]) for epoch in epochs], reported
