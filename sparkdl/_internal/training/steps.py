"""How one mini-batch becomes a loss: ``loss(model(*inputs), label)``, or the user's ``trainStep``.

A ``trainStep`` is ``callable(model, inputs, label, weight)`` returning the loss (a scalar
tensor) or a dict with ``"loss"`` and other metrics (numbers or scalar tensors).  ``inputs``
is the tuple of input tensors, or a dict by ``inputArgs`` (ragged inputs' masks as
``<arg>_mask``); ``weight`` the rows' weights, or None without a weight column.  The metrics
are summed per epoch, weighted by the batch's rows (:class:`EpochTotals`), and averaged over
the workers on the driver.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparkdl._internal.data.block import Batch
from sparkdl._internal.training.inputs import POSITIONAL, ModelCall
from sparkdl._internal.training.losses import LossFn

#: the user's step: (model, inputs, label, weight) -> loss, or {"loss": loss, **metrics}
TrainStepFn = Callable[..., Any]


@dataclass(frozen=True)
class TrainStep:
    """One mini-batch's loss (and metrics): the run's loss on the model's output, or the user's step."""

    loss_fn: LossFn
    call: ModelCall = POSITIONAL
    user: TrainStepFn | None = None

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        if self.user is None:
            assert batch.labels is not None   # training rows are labelled
            return self.loss_fn(self.call(model, batch.inputs, batch.masks), batch.labels, batch.weights), {}
        args, kwargs = self.call.arguments(batch.inputs, batch.masks)
        outcome = self.user(model, kwargs if self.call.args else args, batch.labels, batch.weights)
        if isinstance(outcome, Mapping):
            if "loss" not in outcome:
                raise ValueError(f"trainStep returned a dict without 'loss' (keys {sorted(outcome)}); return the loss "
                                 "tensor, or a dict with 'loss' and metrics")
            loss = outcome["loss"]
            metrics = {str(k): _number(k, v) for k, v in outcome.items() if k != "loss"}
        else:
            loss, metrics = outcome, {}
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(f"trainStep must return the loss as a scalar tensor with a gradient, got {loss!r:.80}")
        return loss.reshape(()), metrics


def _number(name: Any, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"trainStep metric {name!r} must be a number or a scalar tensor, got shape "
                             f"{tuple(value.shape)}")
        return float(value.detach())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"trainStep metric {name!r} must be a number, got {type(value).__name__}") from None


@dataclass
class EpochTotals:
    """One worker's sums over an epoch: rows, the loss and each metric weighted by its batch's rows."""

    rows: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, loss: float, metrics: Mapping[str, float], rows: int) -> None:
        self.rows += rows
        for name, value in (("loss", loss), *metrics.items()):
            self.sums[name] = self.sums.get(name, 0.0) + value * rows

    def take(self) -> tuple[int, dict[str, float]]:
        """(rows, sums) of the epoch so far; the totals start again from zero."""
        taken = self.rows, self.sums
        self.rows, self.sums = 0, {}
        return taken

    def take_over_group(self, device: torch.device) -> tuple[int, dict[str, float]]:
        """(rows, row-weighted means) of the epoch so far over every worker of the process group (a collective:
        every rank runs the same step, so has the same metric names); the totals start again from zero."""
        import torch.distributed as dist

        rows, sums = self.take()
        names = sorted(sums)
        values = torch.tensor([float(rows), *(sums[n] for n in names)], dtype=torch.float64, device=device)
        dist.all_reduce(values)
        total = float(values[0])
        if total <= 0:
            return 0, {}
        return int(total), {n: v / total for n, v in zip(names, values[1:].tolist(), strict=True)}
