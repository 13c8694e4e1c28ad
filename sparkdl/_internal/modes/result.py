"""What a training run returns: final weights, history tables and summary figures."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from sparkdl._internal.ps.server.runlog import (
    GRADIENT_COLUMNS,
    UPDATE_COLUMNS,
    VALIDATION_COLUMNS,
    EpochRow,
    GradientRow,
    UpdateRow,
    ValidationRow,
    row_values,
)
from sparkdl._internal.training.pipeline_cuts import whole_model


@dataclass
class TrainResult:
    """Outcome of :func:`sparkdl.train`.

    ``history`` has one row per parameter-server update (columns ``version, time_s, epoch,
    loss, samples, gradients, staleness_mean, staleness_max, lr_scale, lr, samples_per_s``);
    ``epochs`` aggregates it per epoch; ``gradients`` has one row per pushed gradient
    (``time_s, worker, epoch, computed_on, staleness, accepted``); ``workers`` holds each
    task's own summary; ``summary`` the run's headline figures.
    """

    state_dict: dict[str, torch.Tensor]
    history: pd.DataFrame
    epochs: pd.DataFrame
    gradients: pd.DataFrame
    workers: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    #: what happened to the run: workers lost and rejoined, a resume from a checkpoint
    events: list[dict[str, Any]] = field(default_factory=list)
    #: one entry per barrier-stage attempt (a retried run has more than one)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: one row per validated epoch (``validation_fraction > 0``): ``epoch, version, time_s, samples,
    #: val_loss, val_metric`` (accuracy for classifiers, RMSE for regression); also merged into ``epochs``
    validation: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(VALIDATION_COLUMNS)))

    def model(self, model_fn: Callable[[], nn.Module]) -> nn.Module:
        """A fresh model from ``model_fn`` loaded with the trained weights, in eval mode."""
        model = whole_model(model_fn)
        model.load_state_dict(self.state_dict)
        return model.eval()

    def accuracy(self, model_fn: Callable[[], nn.Module], features: Any, labels: Any, batch_size: int = 4096) -> float:
        """Classification accuracy of the trained model on in-memory data (driver side)."""
        model = self.model(model_fn)
        x = torch.as_tensor(features, dtype=torch.float32)
        y = torch.tensor(np.asarray(labels))
        correct = 0
        with torch.inference_mode():
            for start in range(0, len(x), batch_size):
                predicted = model(x[start:start + batch_size]).argmax(dim=1)
                correct += int((predicted == y[start:start + batch_size]).sum())
        return correct / max(len(x), 1)


def validation_frame(rows: Sequence[ValidationRow]) -> pd.DataFrame:
    """The validated epochs as a DataFrame (``TrainResult.validation``)."""
    return pd.DataFrame([row_values(r) for r in rows], columns=list(VALIDATION_COLUMNS))


def with_validation(epochs: pd.DataFrame, validation: pd.DataFrame) -> pd.DataFrame:
    """The per-epoch history with ``val_loss`` and ``val_metric`` columns (NaN where not validated)."""
    if validation.empty:
        return epochs
    return epochs.merge(validation[["epoch", "val_loss", "val_metric"]], on="epoch", how="left")


def with_epoch_metrics(epochs: pd.DataFrame, rows: Sequence[EpochRow]) -> pd.DataFrame:
    """The per-epoch history with a column per ``trainStep`` metric (its row-weighted mean over the workers)."""
    custom = [{"epoch": row.epoch, **{k: v for k, v in row.metrics.items() if k != "loss"}} for row in rows]
    if not any(len(row) > 1 for row in custom):
        return epochs
    return epochs.merge(pd.DataFrame(custom), on="epoch", how="left")


def epoch_metrics_summary(rows: Sequence[EpochRow]) -> dict[str, Any]:
    """The summary's ``epoch_metrics``: per epoch the mean training loss and trainStep metrics (when any)."""
    if not any(set(row.metrics) - {"loss"} for row in rows):
        return {}
    return {"epoch_metrics": [{"epoch": row.epoch, **row.metrics} for row in rows]}


def history_frames(update_rows: Sequence[UpdateRow], gradient_rows: Sequence[GradientRow]
                   ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(per-update history, per-epoch history, per-gradient log) as pandas DataFrames."""
    history = pd.DataFrame([row_values(r) for r in update_rows], columns=list(UPDATE_COLUMNS))
    gradients = pd.DataFrame([row_values(r) for r in gradient_rows], columns=list(GRADIENT_COLUMNS))
    if history.empty:
        history["samples_per_s"] = []
        return history, pd.DataFrame(columns=["epoch", "updates", "loss", "samples", "seconds",
                                              "samples_per_s", "staleness_mean"]), gradients
    elapsed = history["time_s"].diff().fillna(history["time_s"].iloc[0])
    history["samples_per_s"] = history["samples"] / elapsed.clip(lower=1e-9)
    grouped = history.groupby("epoch")
    epochs = pd.DataFrame({
        "updates": grouped.size(),
        # sample-weighted mean loss of the epoch's updates
        "loss": grouped.apply(lambda g: (g["loss"] * g["samples"]).sum() / max(g["samples"].sum(), 1),
                              include_groups=False),
        "samples": grouped["samples"].sum(),
        "staleness_mean": grouped["staleness_mean"].mean(),
    }).reset_index()
    # an epoch runs from the previous epoch's last update to its own last update
    epochs["seconds"] = grouped["time_s"].max().diff().fillna(grouped["time_s"].max().iloc[0]).to_numpy()
    epochs["samples_per_s"] = epochs["samples"] / epochs["seconds"].clip(lower=1e-9)
    return history, epochs, gradients
