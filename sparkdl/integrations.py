"""Optional exports of a training run: TensorBoard event files and MLflow runs.

Each needs its own package (``tensorboard``, ``mlflow``); without it the function raises
ImportError with the install command.  Both take the history tables sparkdl returns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd


def write_tensorboard(history: pd.DataFrame, log_dir: str | Path, gradients: pd.DataFrame | None = None) -> Path:
    """Per-update scalars (loss, samples/s, staleness) and a staleness histogram as event files."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("TensorBoard export needs the tensorboard package: pip install tensorboard") from exc
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for row in history.itertuples(index=False):
            step = int(row.version)
            writer.add_scalar("train/loss", float(row.loss), step)
            writer.add_scalar("train/samples_per_s", float(row.samples_per_s), step)
            writer.add_scalar("train/staleness_mean", float(row.staleness_mean), step)
        if gradients is not None and len(gradients):
            writer.add_histogram("train/staleness", gradients["staleness"].to_numpy(), int(history["version"].max()))
    finally:
        writer.close()
    return Path(log_dir)


def log_mlflow(params: Mapping[str, Any], summary: Mapping[str, Any], history: pd.DataFrame,
               state_dict: Mapping[str, Any] | None = None, run_name: str = "sparkdl") -> str:
    """Log params, per-update and final metrics and (optionally) the weights to an MLflow run; return its id."""
    try:
        import mlflow
    except ImportError as exc:
        raise ImportError("MLflow logging needs the mlflow package: pip install mlflow") from exc
    import tempfile

    import torch

    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params({k: v for k, v in params.items() if isinstance(v, (str, int, float, bool)) or v is None})
        for row in history.itertuples(index=False):
            mlflow.log_metric("loss", float(row.loss), step=int(row.version))
        mlflow.log_metrics({k: float(v) for k, v in summary.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if state_dict is not None:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "model.pt"
                torch.save(dict(state_dict), path)
                mlflow.log_artifact(str(path))
        return run.info.run_id
