"""The loss registry: names in ``TrainConfig.loss`` -> loss functions, and the targets they expect."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
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


def targets_for_loss(labels: np.ndarray, loss: Any) -> np.ndarray:
    """Class indices (int64) for cross-entropy, float32 targets otherwise."""
    if loss == "cross_entropy":
        return labels.astype(np.int64, copy=False)
    return labels.astype(np.float32, copy=False)
