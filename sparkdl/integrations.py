"""Optional exports of a training run: TensorBoard event files and MLflow runs.

Each needs its own package (``tensorboard``, ``mlflow``); without it the function raises
ImportError with the install command.  Both take the history tables sparkdl returns.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["write_tensorboard", "log_mlflow", "log_mlflow_model"]


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


def log_mlflow_model(model: Any, input_example: Any, artifact_path: str = "model",
                     registered_model_name: str | None = None) -> str:
    """Log a fitted ``TorchModel`` as an MLflow model; return the logged model's URI.

    The PyTorch flavor (the torch module with its weights) carries an input/output signature
    inferred from ``input_example`` (a few feature rows, shaped as the model takes them), so
    data platforms can register and serve it; the saved Spark model (``TorchModel.load``-able)
    is logged next to it under ``<artifact_path>-spark``.  Logs into the active run, or a new one.
    """
    try:
        import mlflow
        import mlflow.pytorch
        from mlflow.models import infer_signature
    except ImportError as exc:
        raise ImportError("logging an MLflow model needs the mlflow package: pip install mlflow") from exc
    import tempfile

    import numpy as np
    import torch

    module = model.torch_module()     # in eval mode (a torch.export program: as exported)
    example = np.asarray(input_example, dtype=np.float32)
    with torch.no_grad():
        result = module(torch.from_numpy(example))
    while not isinstance(result, torch.Tensor):   # several outputs (a tuple, list or dict): the first signs it
        result = next(iter(result.values())) if isinstance(result, dict) else result[0]
    output = result.float().numpy()
    signature = infer_signature(example, output)
    active = mlflow.active_run()
    if active is None:
        mlflow.start_run(run_name="sparkdl-model")
    try:
        info = mlflow.pytorch.log_model(module, name=artifact_path, signature=signature, input_example=example,
                                        registered_model_name=registered_model_name)
        with tempfile.TemporaryDirectory() as folder:
            model.write().overwrite().save(str(Path(folder) / "spark-model"))
            mlflow.log_artifacts(str(Path(folder) / "spark-model"), artifact_path=f"{artifact_path}-spark")
    finally:
        if active is None:
            mlflow.end_run()
    return info.model_uri
