"""The loss registry: names in ``TrainConfig.loss`` -> loss functions, and the targets they expect."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _squeezed(fn: LossFn) -> LossFn:
    """``fn`` for a regression/binary head of shape [B, 1] against labels of shape [B]."""
    def apply(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dim() == 2 and output.shape[1] == 1 and target.dim() == 1:
            output = output.squeeze(1)
        return fn(output, target)
    return apply


LOSSES: dict[str, LossFn] = {
    "cross_entropy": F.cross_entropy,
    "mse": _squeezed(F.mse_loss),
    "bce_with_logits": _squeezed(F.binary_cross_entropy_with_logits),
}


def resolve_loss(loss: str | LossFn) -> LossFn:
    """The loss function named in the config (or the user's callable)."""
    if callable(loss):
        return loss
    try:
        return LOSSES[loss]
    except KeyError:
        raise ValueError(f"unknown loss {loss!r}; choose one of {sorted(LOSSES)} or pass a callable") from None


def validation_metric(loss: Any) -> str | None:
    """The metric validation reports besides the loss: accuracy for classifiers, RMSE for regression."""
    if loss in ("cross_entropy", "bce_with_logits"):
        return "accuracy"
    if loss == "mse":
        return "rmse"
    return None


def metric_sum(loss: Any, output: torch.Tensor, target: torch.Tensor) -> float:
    """Per-row metric summed over a batch: correct predictions, or squared errors (see validation_metric)."""
    name = validation_metric(loss)
    if name is None:
        return 0.0
    if output.dim() == 2 and output.shape[1] == 1 and target.dim() == 1:
        output = output.squeeze(1)
    if loss == "cross_entropy":
        return float((output.argmax(dim=1) == target).sum())
    if loss == "bce_with_logits":
        return float(((output > 0).to(target.dtype) == target).sum())
    return float(((output - target) ** 2).sum())


def finish_metric(loss: Any, total: float, samples: int) -> float:
    """The metric from its per-row sum: accuracy = correct / n, RMSE = sqrt(squared errors / n)."""
    name = validation_metric(loss)
    if name is None or not samples:
        return float("nan")
    return total / samples if name == "accuracy" else (total / samples) ** 0.5
