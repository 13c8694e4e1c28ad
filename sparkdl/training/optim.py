"""The optimizer over one flat parameter tensor, shared by the PS and allreduce workers."""
from __future__ import annotations

import torch

from ..config import TrainConfig


def make_optimizer(config: TrainConfig, flat: torch.Tensor) -> torch.optim.Optimizer:
    """``config.optimizer`` over the single flat tensor (element-wise rules, so exact per parameter)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD([flat], lr=config.learning_rate, momentum=config.momentum,
                               weight_decay=config.weight_decay)
    return torch.optim.Adam([flat], lr=config.learning_rate, weight_decay=config.weight_decay)
