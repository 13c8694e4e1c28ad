"""One update of an embedding table's rows by its row-wise optimizer: the rule the parameter server applies to
a push's rows, and that workers apply themselves to tables they share with it in memory (``shared_tables``).

The optimizers update only the rows a gradient names, as PyTorch's sparse optimizers do:

* ``"sgd"``: ``w_r <- w_r - lr g_r`` (``torch.optim.SGD`` on a sparse gradient, no momentum).
* ``"adagrad"``: ``s_r <- s_r + g_r^2``, ``w_r <- w_r - lr g_r / (sqrt(s_r) + eps)``
  (``torch.optim.Adagrad``; Duchi, Hazan and Singer, JMLR 2011).
* ``"lazy_adam"``: Adam's moments of the touched rows only; untouched rows keep theirs, and the
  bias correction uses the table's step count (``torch.optim.SparseAdam``).

Adagrad and lazy Adam step as gather -> PyTorch's fused dense kernel -> scatter (:func:`_fused_rows`), a
handful of operations per table and push where the written-out rules took a dozen or more.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from sparkdl._internal.ps.tables import ADAGRAD_EPS, STATE_KEYS, coalesce_rows
from sparkdl._internal.training.optim import ADAM_BETAS, ADAM_EPS


def row_state(optimizer: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zeroed optimizer state for the rows ``weight`` (one tensor of its shape per state key of ``optimizer``)."""
    return tuple(torch.zeros_like(weight) for _ in STATE_KEYS[optimizer])


def step_rows(optimizer: str, weight: torch.Tensor, state: Sequence[torch.Tensor], index: torch.Tensor,
              grads: torch.Tensor, lr: float, steps: int, grad_scale: float = 1.0, distinct: bool = False) -> None:
    """Update ``weight``'s rows at ``index`` (and their ``state``, :func:`row_state`'s tensors) with
    ``grads / grad_scale``, in place.

    ``steps``: the table's step count including this update (lazy Adam's bias correction); ``distinct``: no
    index repeats (one worker's rows), so they step as they are, without the sort that sums repeated rows.
    """
    if optimizer == "sgd":    # linear in the gradient: repeated ids add up without coalescing
        weight.index_add_(0, index, grads.to(torch.float32), alpha=-lr / grad_scale)
        return
    index, grad = (index, grads.to(torch.float32)) if distinct else coalesce_rows(index, grads.to(torch.float32))
    if grad_scale != 1.0:
        grad = grad / grad_scale
    if optimizer == "adagrad":
        _fused_rows(weight, index, grad, state, steps, lambda rows, gathered, step: torch._fused_adagrad_(
            [rows], [grad], [gathered[0]], [step], lr=lr, lr_decay=0.0, weight_decay=0.0, eps=ADAGRAD_EPS,
            maximize=False))
        return
    beta1, beta2 = ADAM_BETAS
    # SparseAdam divides by sqrt(v) + eps and scales the step by sqrt(1 - beta2^t); Adam's fused kernel
    # divides by sqrt(v) / sqrt(1 - beta2^t) + eps': the same update with eps' = eps / sqrt(1 - beta2^t)
    eps = ADAM_EPS / math.sqrt(1 - beta2 ** steps)
    _fused_rows(weight, index, grad, state, steps, lambda rows, gathered, step: torch._fused_adam_(
        [rows], [grad], [gathered[0]], [gathered[1]], [], [step], lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=0.0, eps=eps, amsgrad=False, maximize=False))


def _fused_rows(weight: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor],
                steps: int, fused: Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], object]) -> None:
    """A row-wise step as gather, one fused kernel, scatter: the touched rows' state is gathered and stepped
    by PyTorch's fused dense optimizer (``steps``: the table's step count, as its state step), and written
    back with ``index_copy_`` (``index`` is distinct here).  The kernel steps a zero tensor, which then
    holds the rows' update, added to them in one ``index_add_``: with no weight decay the update does
    not depend on the rows, and a table too large for the caches is read and written once fewer per row."""
    if index.numel() == 0:
        return
    update = torch.zeros((index.numel(), weight.shape[1]), dtype=weight.dtype)
    gathered = [tensor.index_select(0, index) for tensor in state]
    fused(update, gathered, torch.tensor(float(steps)))
    weight.index_add_(0, index, update)
    for tensor, values in zip(state, gathered, strict=True):
        tensor.index_copy_(0, index, values)
