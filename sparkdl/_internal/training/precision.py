"""Mixed precision on the workers: autocast in the forward and the loss, a loss scaler for float16.

Parameters, gradients and everything a worker exchanges stay float32 (``precision`` is
autocast only, as in PyTorch's automatic mixed precision recipe): the parameter server, the
allreduce and the optimizers never see a half-precision value.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, cast

import torch

from sparkdl.errors import ClusterConfigError

#: autocast's dtype per ``precision`` ("32": no autocast)
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class _Gradients:
    """The parameters whose gradients a ``GradScaler`` unscales, in the shape of the optimizer it drives.

    ``GradScaler.step`` calls :meth:`step` only when every unscaled gradient is finite: that
    call is how the scaler says the step may be taken (the real step is the worker's business).
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.param_groups = [{"params": list(parameters)}]
        self.stepped = False

    def step(self) -> None:
        self.stepped = True


class MixedPrecision:
    """How one worker runs its forward and loss, and (float16) scales its loss.

    ``"bf16-mixed"``: forward and loss under ``torch.autocast(dtype=torch.bfloat16)``.
    ``"16-mixed"``: under float16 autocast, the loss multiplied by a ``torch.amp.GradScaler``'s
    scale before backward; :meth:`unscale` divides the gradients of ``parameters`` back before
    they are used, and reports a step whose gradient overflowed, which is then skipped (and
    counted in :attr:`skipped_steps`) while the scaler backs off.  ``"32"``: nothing.
    """

    def __init__(self, precision: str, device: torch.device, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.precision = precision
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self._gradients = _Gradients(parameters)
        #: steps whose unscaled gradient held inf/NaN, skipped by the loss scaler
        self.skipped_steps = 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward and the loss run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (multiplied by the loss scale under float16)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self) -> bool:
        """Divide the accumulated gradients by the loss scale; False when they hold inf/NaN (skip the step).

        Call it once per optimizer step or push, after every backward that contributes to it.
        """
        if self.scaler is None:
            return True
        self._gradients.stepped = False
        # unscales in place and checks for inf/NaN; GradScaler reads only param_groups and step() of an optimizer
        self.scaler.step(cast(torch.optim.Optimizer, self._gradients))
        self.scaler.update()
        if not self._gradients.stepped:
            self.skipped_steps += 1
        return self._gradients.stepped


#: the precision of plain float32 training
FLOAT32 = MixedPrecision("32", torch.device("cpu"))


def worker_precision(precision: str, device: torch.device, parameters: Iterable[torch.Tensor]) -> MixedPrecision:
    """A training task's :class:`MixedPrecision`; refuses float16 on a CPU device (it needs CUDA's loss scaling)."""
    if precision == "16-mixed" and device.type != "cuda":
        raise ClusterConfigError(f"precision='16-mixed' needs a CUDA device, and this task trains on {device}: give "
                                 "the tasks GPUs ('spark.task.resource.gpu.amount') or use precision='bf16-mixed'")
    return MixedPrecision(precision, device, parameters)
