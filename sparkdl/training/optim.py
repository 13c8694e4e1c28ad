"""The optimizer over one flat parameter tensor, shared by the PS and allreduce workers."""
from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def make_optimizer(config: TrainConfig, flat: torch.Tensor) -> torch.optim.Optimizer:
    """``config.optimizer`` over the single flat tensor (element-wise rules, so exact per parameter).

    PyTorch's fused implementation: one pass over the tensor for the whole update (weight decay,
    momentum or Adam's moments, the step), and it divides the gradient by the optimizer's
    ``grad_scale`` in the same pass, which the parameter server uses to average a round's sum.
    """
    if config.optimizer == "sgd":
        return torch.optim.SGD([flat], lr=config.learning_rate, momentum=config.momentum,
                               weight_decay=config.weight_decay, fused=True)
    return torch.optim.Adam([flat], lr=config.learning_rate, weight_decay=config.weight_decay, fused=True)


def learning_rate_at(config: TrainConfig, applied: int, planned_updates: int | None) -> float:
    """The PS optimizer's learning rate for the update after ``applied`` updates.

    ``alpha0`` (``learning_rate``), times ``c * s`` under ``lr_scaling="linear"`` (the linear
    scaling rule of Goyal et al. 2017: the samples of one update over ``batch_size``), times
    a linear warm-up over the first ``lr_warmup_updates`` updates, times the schedule:
    ``lr_step_gamma ** (applied // lr_step_every)`` ("step") or
    ``(1 + cos(pi * applied / planned_updates)) / 2`` ("cosine").  Per-gradient staleness
    factors (``staleness_lr``) act on the gradients, not here, so they compose with this.
    """
    rate = config.learning_rate
    if config.lr_scaling == "linear":
        rate *= config.gradients_per_update * config.local_steps
    if applied < config.lr_warmup_updates:
        rate *= (applied + 1) / config.lr_warmup_updates
    if config.lr_schedule == "step":
        rate *= config.lr_step_gamma ** (applied // config.lr_step_every)
    elif config.lr_schedule == "cosine" and planned_updates:
        rate *= 0.5 * (1.0 + math.cos(math.pi * min(applied, planned_updates) / planned_updates))
    return rate
