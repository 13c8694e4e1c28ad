"""The optimizer over one flat parameter tensor, shared by the PS and allreduce workers."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from sparkdl.config import TrainConfig

#: Adam's moment decay rates and epsilon: PyTorch's defaults
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: added to the gradient's norm before clipping divides by it (torch.nn.utils.clip_grad_norm_'s)
CLIP_EPS = 1e-6

#: (size, decayed) of every parameter tensor, in flat order: which spans of the flat vector AdamW decays
TensorLayout = Sequence[tuple[int, bool]]


def tensor_layout(parameters: Iterable[torch.Tensor]) -> tuple[tuple[int, bool], ...]:
    """The :data:`TensorLayout` of a model's parameters.

    The usual rule for decoupled weight decay: matrices and kernels decay; 1-D tensors (biases,
    LayerNorm and BatchNorm weights) do not.
    """
    return tuple((p.numel(), p.dim() > 1) for p in parameters)


def clip_layout(layout: TensorLayout, span: tuple[int, int]) -> tuple[tuple[int, bool], ...]:
    """The pieces of ``layout``'s tensors that fall in the key range ``span`` (a PS shard's, a stage's)."""
    lo, hi = span
    offsets = [0, *itertools.accumulate(size for size, _ in layout)]
    pieces = [(min(hi, end) - max(lo, start), decays)
              for (start, end), (_, decays) in zip(itertools.pairwise(offsets), layout, strict=True)]
    return tuple((size, decays) for size, decays in pieces if size > 0)


def _decayed_spans(layout: TensorLayout) -> list[tuple[int, int]]:
    """The flat ranges of the decayed tensors, neighbours merged."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for size, decays in layout:
        if decays:
            if spans and spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], offset + size)
            else:
                spans.append((offset, offset + size))
        offset += size
    return spans


class FlatOptimizer:
    """SGD (momentum, weight decay), Adam or AdamW over one flat float32 tensor, in one fused pass per step.

    It calls the fused kernels ``torch.optim.SGD(fused=True)``, ``torch.optim.Adam(fused=True)``
    and ``torch.optim.AdamW(fused=True)`` run, directly: the same arithmetic, but constructing a
    ``torch.optim`` optimizer imports ``torch._dynamo`` (1.7 s on this project's machine, on the
    first fit of every process).  ``step(grad, grad_scale)`` divides the gradient by
    ``grad_scale`` in the same pass (the parameter server's average over a round).
    ``state_dict`` has ``torch.optim``'s layout, so checkpoints load either way.

    AdamW is Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019): ``w <- w * (1 - lr * weight_decay)`` before the Adam step,
    as ``torch.optim.AdamW`` does.  Given the model's ``layout``, only its decayed tensors
    (not the 1-D ones, unless ``decay_all_parameters``) are decayed: the same as a
    ``torch.optim.AdamW`` with a no-decay parameter group.  With ``grad_clip_norm`` the
    gradient the step applies (``grad / grad_scale``) is first clipped to that L2 norm.
    """

    def __init__(self, config: TrainConfig, flat: torch.Tensor, layout: TensorLayout | None = None,
                 momentum: float | None = None) -> None:
        """``layout``: the parameter tensors in ``flat`` (None: one tensor that decays as a whole);
        ``momentum``: SGD's momentum, when not ``config.momentum``."""
        self.param = flat.data if isinstance(flat, torch.nn.Parameter) else flat
        self.kind = config.optimizer
        self.lr = config.learning_rate
        self.momentum = (config.momentum if momentum is None else momentum) if self.kind == "sgd" else 0.0
        self.weight_decay = config.weight_decay
        self.clip_norm = config.grad_clip_norm
        self.momentum_buffer: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps = torch.zeros((), dtype=torch.float32, device=flat.device)
        #: AdamW with some tensors left out of the decay: views of the decayed ranges (None: the fused kernel
        #: decays the whole tensor)
        self._decayed: list[torch.Tensor] | None = None
        if self.kind == "adamw" and layout is not None and not config.decay_all_parameters:
            if sum(size for size, _ in layout) != self.param.numel():
                raise ValueError(f"the tensor layout covers {sum(size for size, _ in layout)} values, the flat "
                                 f"parameter has {self.param.numel()}")
            spans = _decayed_spans(layout)
            if spans != [(0, self.param.numel())]:
                self._decayed = [self.param[lo:hi] for lo, hi in spans]

    def _clipped_scale(self, grad: torch.Tensor, grad_scale: torch.Tensor | None) -> torch.Tensor:
        """The divisor that also clips ``grad / grad_scale`` to ``clip_norm`` (no extra pass over the gradient)."""
        assert self.clip_norm is not None   # called only with clipping on
        norm = torch.linalg.vector_norm(grad)
        divisor = grad_scale if grad_scale is not None else torch.ones((), dtype=norm.dtype, device=norm.device)
        coefficient = (self.clip_norm / (norm / divisor + CLIP_EPS)).clamp(max=1.0)
        return divisor / coefficient

    def step(self, grad: torch.Tensor, grad_scale: torch.Tensor | None = None) -> None:
        """One update of the parameter with ``grad / grad_scale`` (``grad`` may be changed in place)."""
        if self.clip_norm is not None:
            grad_scale = self._clipped_scale(grad, grad_scale)
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
        weight_decay = self.weight_decay
        if self.kind == "adamw" and self._decayed is not None:
            # torch.optim.AdamW's order: the decoupled decay first, on the decayed tensors only
            if weight_decay and self._decayed:
                torch._foreach_mul_(self._decayed, 1 - self.lr * weight_decay)
            weight_decay = 0.0
        fused = torch._fused_adamw_ if self.kind == "adamw" else torch._fused_adam_
        fused([self.param], [grad], [self.exp_avg], [self.exp_avg_sq], [], [self.steps], lr=self.lr,
              beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], weight_decay=weight_decay, eps=ADAM_EPS,
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
            if self.kind == "adamw":
                group["decoupled_weight_decay"] = True
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


def make_optimizer(config: TrainConfig, flat: torch.Tensor, layout: TensorLayout | None = None,
                   momentum: float | None = None) -> FlatOptimizer:
    """``config.optimizer`` over the single flat tensor (element-wise rules, so exact per parameter).

    ``layout``: the parameter tensors in ``flat`` (:func:`tensor_layout`), for AdamW's decay rule.
    ``momentum``: SGD's momentum when not ``config.momentum`` (the server's, :func:`server_momentum`).
    """
    return FlatOptimizer(config, flat, layout, momentum)


def compensated_momentum(momentum: float, workers: int) -> float:
    """The explicit SGD momentum that, with the momentum ``workers`` asynchronous workers add, makes ``momentum``.

    Mitliagkas, Zhang, Hadjis and Ré, "Asynchrony begets momentum, with an application to deep
    learning" (Allerton 2016): with N workers updating one server asynchronously, the expected
    update follows SGD with momentum ``mu_implicit = 1 - 1/N`` (their queueing model), and the
    best explicit momentum falls as N grows.  The paper gives no closed rule for the explicit
    value; sparkdl's is ours: each momentum source ``mu`` scales the step's long-run size by
    ``1 / (1 - mu)``, so the two together match ``momentum`` when
    ``(1 - mu_explicit) (1 - mu_implicit) = 1 - momentum``, i.e.
    ``mu_explicit = max(0, 1 - N (1 - momentum))``: 0.9 becomes 0.8 with 2 workers, 0.6 with 4,
    and 0 from 10 on (asynchrony alone then carries at least the momentum asked for).
    """
    return max(0.0, 1.0 - workers * (1.0 - momentum))


def server_momentum(config: TrainConfig) -> float:
    """The SGD momentum the parameter server applies: ``momentum``, compensated under
    ``implicit_momentum="compensate"`` (async only) for the workers that push at once: ``num_workers``, or
    with work units up to ``max_workers`` (an elastic run may train more workers than it starts with).
    ``"auto"`` compensates where "compensate" applies (async with SGD) and leaves Adam and the other
    policies' momentum as set."""
    compensate = config.implicit_momentum == "compensate" or (
        config.implicit_momentum == "auto" and config.optimizer == "sgd")
    if compensate and config.policy == "async":
        return compensated_momentum(config.momentum, max(config.num_workers, config.max_workers or 0))
    return config.momentum


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
