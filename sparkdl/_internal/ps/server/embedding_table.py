"""An embedding table as the parameter server holds it: rows, a row-wise optimizer, seeded lazy initialisation.

A table (an ``nn.Embedding`` or ``nn.EmbeddingBag`` declared ``sparse=True``) is not part of
the flat parameter vector: the PS keeps it as rows, workers pull the rows a batch touches and
push those rows' gradients (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014: push and pull of only the keys a worker touches).  With
``shards`` PS shards, row ``r`` lives on shard ``r % shards`` at local index ``r // shards``:
ids are often ranked by frequency (Zipf), so ranges would put the hot rows on one shard,
while a stride spreads them.

The optimizers update only the rows a gradient names, as PyTorch's sparse optimizers do:

* ``"sgd"``: ``w_r <- w_r - lr g_r`` (``torch.optim.SGD`` on a sparse gradient, no momentum).
* ``"adagrad"``: ``s_r <- s_r + g_r^2``, ``w_r <- w_r - lr g_r / (sqrt(s_r) + eps)``
  (``torch.optim.Adagrad``; Duchi, Hazan and Singer, JMLR 2011).
* ``"lazy_adam"``: Adam's moments of the touched rows only; untouched rows keep theirs, and the
  bias correction uses the table's step count (``torch.optim.SparseAdam``).

Adagrad and lazy Adam step as gather -> PyTorch's fused dense kernel -> scatter (``_fused_rows``), a
handful of operations per table and push where the written-out rules took a dozen or more.

Momentum and weight decay are not applied to tables (the launcher warns when they are set): either
would change every row at every step (``torch.optim.Adagrad`` and ``SparseAdam`` refuse them on sparse
gradients too).  A table starts from the model's own rows; :func:`initial_rows` draws them the way
``nn.Embedding`` does for a table given no values.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from sparkdl._internal.ps.tables import (
    ADAGRAD_EPS,
    ROW_STATE_KEYS,
    TableSpec,
    coalesce_rows,
    initial_rows,
    with_state_of,
)
from sparkdl._internal.training.optim import ADAM_BETAS, ADAM_EPS


class EmbeddingTable:
    """One PS shard's rows of one table, with their row-wise optimizer state.

    Ids are global row ids; :meth:`gather` and :meth:`apply` check that every id belongs to
    this shard and the table before reading or writing anything.
    """

    def __init__(self, spec: TableSpec, shard: int = 0, shards: int = 1, learning_rate: float = 0.01,
                 rows: torch.Tensor | None = None) -> None:
        """``rows``: this shard's rows when known (a checkpoint), else :func:`initial_rows`."""
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not one of {shards}")
        self.spec = spec
        self.shard, self.shards = shard, shards
        self.learning_rate = learning_rate
        self.weight = initial_rows(spec, shard, shards) if rows is None else rows.to(torch.float32).contiguous()
        if self.weight.shape != (len(range(shard, spec.rows, shards)), spec.dim):
            raise ValueError(f"table {spec.name!r}: shard {shard} of {shards} holds "
                             f"{len(range(shard, spec.rows, shards))} rows of {spec.dim}, "
                             f"not {tuple(self.weight.shape)}")
        #: updates applied to this table (SparseAdam's step: its bias correction)
        self.steps = 0
        #: per local row: the update (``steps``) that last changed it, 0 when none did since the rows were
        #: loaded; what :meth:`changes_since` reads, so a shard's snapshot carries only its changed rows
        self.changed_at = torch.zeros(len(self.weight), dtype=torch.int32)
        self.state_sum: torch.Tensor | None = None     # adagrad
        self.exp_avg: torch.Tensor | None = None       # lazy_adam
        self.exp_avg_sq: torch.Tensor | None = None

    def local_index(self, ids: torch.Tensor, increasing: bool = False) -> torch.Tensor:
        """This shard's row indices of the global ``ids``; a ValueError naming the first id that is outside
        the table or on another shard.

        ``increasing``: the caller checked that the ids increase (a message's, as ``torch.unique`` gives them),
        so the first and last bound them all; the check then runs in numpy, where a few hundred ids take a
        microsecond or two and torch's per-operation dispatch would take tens (it runs for every table of
        every message)."""
        ids = ids.to(torch.int64)
        if increasing:
            values = ids.numpy()
            if not len(values) or (values[0] >= 0 and values[-1] < self.spec.rows and (
                    self.shards == 1 or not (values % self.shards != self.shard).any())):
                return ids if self.shards == 1 else torch.from_numpy(values // self.shards)
        bad = (ids < 0) | (ids >= self.spec.rows) | (ids % self.shards != self.shard)
        if bool(bad.any()):
            first = int(ids[bad][0])
            where = ("outside the table" if not 0 <= first < self.spec.rows
                     else f"held by shard {first % self.shards}, not {self.shard}")
            raise ValueError(f"table {self.spec.name!r} ({self.spec.rows} rows): id {first} is {where}")
        return ids // self.shards

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the rows ``ids``, in their order."""
        return self.rows_at(self.local_index(ids))

    def rows_at(self, index: torch.Tensor) -> torch.Tensor:
        """A copy of the rows at this shard's row indices ``index`` (checked by the caller: :meth:`local_index`)."""
        return self.weight.index_select(0, index)

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, grad_scale: float = 1.0,
              learning_rate: float | None = None) -> None:
        """One update of the rows ``ids`` with ``grads / grad_scale``; repeated ids are summed first (one
        coalesced sparse gradient, as several workers' pushes into one sync update)."""
        self.apply_rows(self.local_index(ids), grads, grad_scale, learning_rate)   # checked before any write

    def apply_rows(self, index: torch.Tensor, grads: torch.Tensor, grad_scale: float = 1.0,
                   learning_rate: float | None = None, distinct: bool = False) -> None:
        """:meth:`apply` at this shard's row indices ``index`` (checked by the caller); ``distinct``: no index
        repeats (one worker's rows), so they step as they are, without the sort that sums repeated rows."""
        if grads.shape != (index.numel(), self.spec.dim):
            raise ValueError(f"table {self.spec.name!r}: {index.numel()} ids need gradients of "
                             f"{(index.numel(), self.spec.dim)}, not {tuple(grads.shape)}")
        lr = self.learning_rate if learning_rate is None else learning_rate
        self.steps += 1
        self.changed_at[index] = self.steps
        kind = self.spec.optimizer
        if kind == "sgd":    # linear in the gradient: repeated ids add up without coalescing
            self.weight.index_add_(0, index, grads.to(torch.float32), alpha=-lr / grad_scale)
            return
        index, grad = (index, grads.to(torch.float32)) if distinct else coalesce_rows(index, grads.to(torch.float32))
        if grad_scale != 1.0:
            grad = grad / grad_scale
        if kind == "adagrad":
            if self.state_sum is None:
                self.state_sum = torch.zeros_like(self.weight)
            self._fused_rows(index, grad, (self.state_sum,), lambda rows, state, steps: torch._fused_adagrad_(
                [rows], [grad], [state[0]], [steps], lr=lr, lr_decay=0.0, weight_decay=0.0, eps=ADAGRAD_EPS,
                maximize=False))
        else:
            if self.exp_avg is None or self.exp_avg_sq is None:
                self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.weight), torch.zeros_like(self.weight)
            beta1, beta2 = ADAM_BETAS
            # SparseAdam divides by sqrt(v) + eps and scales the step by sqrt(1 - beta2^t); Adam's fused kernel
            # divides by sqrt(v) / sqrt(1 - beta2^t) + eps': the same update with eps' = eps / sqrt(1 - beta2^t)
            eps = ADAM_EPS / math.sqrt(1 - beta2 ** self.steps)
            self._fused_rows(index, grad, (self.exp_avg, self.exp_avg_sq),
                             lambda rows, state, steps: torch._fused_adam_(
                                 [rows], [grad], [state[0]], [state[1]], [], [steps], lr=lr, beta1=beta1, beta2=beta2,
                                 weight_decay=0.0, eps=eps, amsgrad=False, maximize=False))

    def _fused_rows(self, index: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...],
                    fused: Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], object]) -> None:
        """A row-wise step as gather, one fused kernel, scatter: the touched rows' state is gathered and stepped
        by PyTorch's fused dense optimizer (``steps``: the table's step count, as its state step), and written
        back with ``index_copy_`` (``index`` is distinct here).  The kernel steps a zero tensor, which then
        holds the rows' update, added to them in one ``index_add_``: with no weight decay the update does
        not depend on the rows, and a table too large for the caches is read and written once fewer per row."""
        if index.numel() == 0:
            return
        update = torch.zeros((index.numel(), self.spec.dim), dtype=self.weight.dtype)
        gathered = [tensor.index_select(0, index) for tensor in state]
        fused(update, gathered, torch.tensor(float(self.steps)))
        self.weight.index_add_(0, index, update)
        for tensor, values in zip(state, gathered, strict=True):
            tensor.index_copy_(0, index, values)

    def state_dict(self) -> dict:
        """The rows and their optimizer state (for checkpoints)."""
        state = {"weight": self.weight.clone(), "steps": self.steps}
        for key in ROW_STATE_KEYS:
            value = getattr(self, key)
            if value is not None:
                state[key] = value.clone()
        return state

    def changes_since(self, steps: int, optimizer_state: bool = True) -> dict:
        """The rows changed by the updates after the ``steps``-th, with their optimizer state (unless not
        ``optimizer_state``) and this shard's local row indices: what
        :func:`~sparkdl._internal.ps.shards.ranges.apply_table_changes` lays over the state saved then."""
        rows = torch.nonzero(self.changed_at > steps).flatten()
        changes = {"rows": rows, "weight": self.weight.index_select(0, rows), "steps": self.steps}
        for key in ROW_STATE_KEYS if optimizer_state else ():
            value = getattr(self, key)
            if value is not None:
                changes[key] = value.index_select(0, rows)
        return changes

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (no row counts as changed since)."""
        if state["weight"].shape != self.weight.shape:
            raise ValueError(f"table {self.spec.name!r}: the saved rows are {tuple(state['weight'].shape)}, "
                             f"this shard holds {tuple(self.weight.shape)}")
        self.weight.copy_(state["weight"])     # in place: a table this size is held once
        self.steps = int(state["steps"])
        self.changed_at.zero_()
        state = with_state_of(state, self.spec.optimizer)
        for key in ROW_STATE_KEYS:
            current = getattr(self, key)
            if key not in state:
                setattr(self, key, None)
            elif current is not None and current.shape == state[key].shape:
                current.copy_(state[key])
            else:
                setattr(self, key, state[key].clone())
