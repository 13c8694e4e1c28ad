"""The optimizer over one flat parameter tensor, shared by the PS and allreduce workers."""
from __future__ import annotations

import math
from typing import Any, cast

import torch

from ..config import TrainConfig

#: Adam's moment decay rates and epsilon: PyTorch's defaults
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class FlatOptimizer:
    """SGD (momentum, weight decay) or Adam over one flat float32 tensor, in one fused pass per step.

    It calls the fused kernels ``torch.optim.SGD(fused=True)`` and ``torch.optim.Adam(fused=True)``
    run, directly: the same arithmetic, but constructing a ``torch.optim`` optimizer imports
    ``torch._dynamo`` (1.7 s on this project's machine, on the first fit of every process).
    ``step(grad, grad_scale)`` divides the gradient by ``grad_scale`` in the same pass (the
    parameter server's average over a round).  ``state_dict`` has ``torch.optim``'s layout, so
    checkpoints load either way.
    """

    def __init__(self, config: TrainConfig, flat: torch.Tensor) -> None:
        self.param = flat.data if isinstance(flat, torch.nn.Parameter) else flat
        self.kind = config.optimizer
        self.lr = config.learning_rate
        self.momentum = config.momentum if self.kind == "sgd" else 0.0
        self.weight_decay = config.weight_decay
        self.momentum_buffer: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps = torch.zeros((), dtype=torch.float32, device=flat.device)

    def step(self, grad: torch.Tensor, grad_scale: torch.Tensor | None = None) -> None:
        """One update of the parameter with ``grad / grad_scale`` (``grad`` may be changed in place)."""
        if self.kind == "sgd":
            first = self.momentum != 0 and self.momentum_buffer is None
            if first:
                self.momentum_buffer = torch.empty_like(self.param)
            # with momentum the buffer exists by now (made just above at the first step)
            torch._fused_sgd_([self.param], [grad], [cast(torch.Tensor, self.momentum_buffer)] if self.momentum else [],
                              weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=first, grad_scale=grad_scale)
            return
        if self.exp_avg is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.param), torch.zeros_like(self.param)
        assert self.exp_avg_sq is not None   # the two moments are always set together
        self.steps += 1
        torch._fused_adam_([self.param], [grad], [self.exp_avg], [self.exp_avg_sq], [], [self.steps], lr=self.lr,
                           beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], weight_decay=self.weight_decay, eps=ADAM_EPS,
                           amsgrad=False, maximize=False, grad_scale=grad_scale)

    def state_dict(self) -> dict:
        """The state in ``torch.optim``'s layout (one parameter, index 0)."""
        if self.kind == "sgd":
            state = {} if self.momentum_buffer is None else {0: {"momentum_buffer": self.momentum_buffer.clone()}}
            group: dict[str, Any] = {"lr": self.lr, "momentum": self.momentum, "dampening": 0,
                                     "weight_decay": self.weight_decay, "nesterov": False, "maximize": False,
                                     "foreach": None, "differentiable": False, "fused": True}
        else:
            state = {} if self.exp_avg is None else {0: {"step": self.steps.clone(), "exp_avg": self.exp_avg.clone(),
                                                         "exp_avg_sq": cast(torch.Tensor, self.exp_avg_sq).clone()}}
            group = {"lr": self.lr, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": self.weight_decay,
                     "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": True}
        return {"state": state, "param_groups": [{**group, "params": [0]}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` (or a ``torch.optim`` optimizer of the same kind) saved."""
        state = state_dict["state"].get(0, {})
        self.lr = state_dict["param_groups"][0]["lr"]
        device = self.param.device
        if self.kind == "sgd":
            buffer = state.get("momentum_buffer")
            self.momentum_buffer = None if buffer is None else buffer.to(device).clone()
        elif state:
            self.exp_avg, self.exp_avg_sq = state["exp_avg"].to(device).clone(), state["exp_avg_sq"].to(device).clone()
            self.steps = torch.as_tensor(state["step"], dtype=torch.float32).to(device).clone()


def make_optimizer(config: TrainConfig, flat: torch.Tensor) -> FlatOptimizer:
    """``config.optimizer`` over the single flat tensor (element-wise rules, so exact per parameter)."""
    return FlatOptimizer(config, flat)


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
