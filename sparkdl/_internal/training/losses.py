"""The loss registry: names in ``TrainConfig.loss`` -> loss functions, and the targets they expect.

Every loss here is ``loss(output, target, weight)``: the mean over the batch's rows, or with
per-row weights (``weightCol``) ``sum(w * l) / sum(w)``.  A named loss computes each row's
loss (the mean over its elements for vector labels: multi-label ``bce_with_logits``,
multi-output ``mse``); a callable one is the user's, called as ``loss(output, target)`` and,
with weights, ``loss(output, target, weight=w)``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

#: loss(output, target, weight or None) -> the batch's (weighted) mean loss
LossFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _squeezed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A regression/binary head of shape [B, 1] against labels of shape [B]: the head squeezed."""
    if output.dim() == 2 and output.shape[1] == 1 and target.dim() == 1:
        return output.squeeze(1)
    return output


def _named(loss: Callable[..., torch.Tensor]) -> LossFn:
    """A torch.nn.functional loss as ``loss(output, target, weight)``."""
    def apply(output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        output = _squeezed(output, target)
        if weight is None:      # the fused mean: no per-row tensor (the common case, on the hot path)
            return loss(output, target)
        per_element = loss(output, target, reduction="none")
        per_row = per_element.reshape(len(per_element), -1).mean(dim=1)
        return (per_row * weight).sum() / weight.sum().clamp_min(torch.finfo(per_row.dtype).tiny)
    return apply


LOSSES: dict[str, LossFn] = {
    "cross_entropy": _named(F.cross_entropy),
    "mse": _named(F.mse_loss),
    "bce_with_logits": _named(F.binary_cross_entropy_with_logits),
}


def accepts_weight(loss: Callable[..., Any]) -> bool:
    """Whether a callable loss takes ``weight=`` (needed with a weight column)."""
    try:
        parameters = inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return False
    return "weight" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _users(loss: Callable[..., torch.Tensor]) -> LossFn:
    def apply(output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return loss(output, target) if weight is None else loss(output, target, weight=weight)
    return apply


def resolve_loss(loss: str | Callable[..., torch.Tensor]) -> LossFn:
    """The loss function named in the config (or the user's callable), as ``loss(output, target, weight)``."""
    if callable(loss):
        return _users(loss)
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
    output = _squeezed(output, target)
    if loss == "cross_entropy":
        return float((output.argmax(dim=1) == target).sum())
    if loss == "bce_with_logits":      # multi-label: the row's share of right labels
        right = ((output > 0).to(target.dtype) == target).to(torch.float64)
        return float(right.reshape(len(right), -1).mean(dim=1).sum())
    # multi-output: the row's mean squared error over its outputs
    return float(((output - target).to(torch.float64) ** 2).reshape(len(target), -1).mean(dim=1).sum())


def finish_metric(loss: Any, total: float, samples: int) -> float:
    """The metric from its per-row sum: accuracy = correct / n, RMSE = sqrt(squared errors / n)."""
    name = validation_metric(loss)
    if name is None or not samples:
        return float("nan")
    return total / samples if name == "accuracy" else (total / samples) ** 0.5
