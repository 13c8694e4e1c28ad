"""An embedding table as the parameter server holds it: rows, a row-wise optimizer, seeded lazy initialisation.

A table (an ``nn.Embedding`` or ``nn.EmbeddingBag`` declared ``sparse=True``) is not part of
the flat parameter vector: the PS keeps it as rows, workers pull the rows a batch touches and
push those rows' gradients (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014: push and pull of only the keys a worker touches).  With
``shards`` PS shards, row ``r`` lives on shard ``r % shards`` at local index ``r // shards``:
ids are often ranked by frequency (Zipf), so ranges would put the hot rows on one shard,
while a stride spreads them.

The row optimizers and their rules are in :mod:`sparkdl._internal.ps.row_steps`.  With ``shared_tables`` the
rows, their state and the step count live in shared memory (:meth:`EmbeddingTable.share`), where the workers on
the PS's host step them too.

Momentum and weight decay are not applied to tables (the launcher warns when they are set): either
would change every row at every step (``torch.optim.Adagrad`` and ``SparseAdam`` refuse them on sparse
gradients too).  A table starts from the model's own rows; :func:`initial_rows` draws them the way
``nn.Embedding`` does for a table given no values.
"""
from __future__ import annotations

import torch

from sparkdl._internal.ps.row_steps import row_state, step_rows
from sparkdl._internal.ps.tables import ROW_STATE_KEYS, STATE_KEYS, TableSpec, initial_rows, with_state_of
from sparkdl._internal.ps.wire.shared_tables import SharedTable


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
        #: updates applied to this table, per writer (SparseAdam's step, its bias correction, is their sum): the
        #: PS's own count only, unless the table is shared with the workers of its host (:meth:`share`)
        self._steps = torch.zeros(1, dtype=torch.int64)
        #: the shared-memory file the table lives in (``shared_tables``), else None
        self.shared: SharedTable | None = None
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
        self._steps[0] += 1
        steps = self.steps
        self.changed_at[index] = steps
        step_rows(self.spec.optimizer, self.weight, self._state(), index, grads, lr, steps, grad_scale, distinct)

    @property
    def steps(self) -> int:
        """Updates applied to this table (by the PS, and by the workers that share it in memory)."""
        return int(self._steps.sum())

    def _state(self) -> tuple[torch.Tensor, ...]:
        """The row optimizer's state tensors (made, zeroed, at the first update that needs them)."""
        keys = STATE_KEYS[self.spec.optimizer]
        if any(getattr(self, key) is None for key in keys):
            for key, tensor in zip(keys, row_state(self.spec.optimizer, self.weight), strict=True):
                setattr(self, key, tensor)
        return tuple(getattr(self, key) for key in keys)

    def share(self, shared: SharedTable) -> None:
        """Move the rows, their optimizer state and the step count into ``shared`` (a whole table, one PS):
        from now on this table's tensors are views of it, which workers step in place too."""
        if self.shards != 1 or shared.weight.shape != self.weight.shape:
            raise ValueError(f"table {self.spec.name!r}: only a whole table moves into shared memory")
        shared.weight.copy_(self.weight)
        for key, target in zip(STATE_KEYS[self.spec.optimizer], shared.state, strict=True):
            current = getattr(self, key)
            if current is None:
                target.zero_()
            else:
                target.copy_(current)
            setattr(self, key, target)
        shared.steps.zero_()
        shared.steps[0] = self.steps
        self.weight, self._steps, self.shared = shared.weight, shared.steps, shared

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
        self._steps.zero_()
        self._steps[0] = int(state["steps"])
        self.changed_at.zero_()
        state = with_state_of(state, self.spec.optimizer)
        for key in ROW_STATE_KEYS:
            current = getattr(self, key)
            if key not in state and self.shared is not None and current is not None:
                current.zero_()     # stays in the shared file
            elif key not in state:
                setattr(self, key, None)
            elif current is not None and current.shape == state[key].shape:
                current.copy_(state[key])
            else:
                setattr(self, key, state[key].clone())
