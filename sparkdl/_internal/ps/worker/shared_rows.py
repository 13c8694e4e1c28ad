"""A worker's rows of the embedding tables its parameter server keeps in shared memory (``shared_tables``).

On the PS's host a worker maps every table's file (:class:`~sparkdl._internal.ps.wire.shared_tables.SharedTable`),
gathers a batch's rows from it where it would pull them, and steps the rows its backward touched where it
would push them: with the table's row optimizer, at the rate of the PS's last reply, with no lock and no
message (Hogwild, Recht et al. 2011; the consistency this gives is in that module's docstring).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from sparkdl._internal.ps.row_steps import step_rows
from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire.shared_tables import SharedTable, table_file_name


class SharedRows:
    """Every table of a run, mapped; ``worker``'s step counter is slot ``worker + 1`` of each."""

    def __init__(self, tables: Sequence[SharedTable], worker: int) -> None:
        self.tables = list(tables)
        self.slot = worker + 1

    @classmethod
    def attach(cls, secret: bytes, port: int, specs: Sequence[TableSpec], slots: int,
               worker: int) -> SharedRows | None:
        """Map the tables of the PS at ``port``; None unless every one is here (then rows travel as messages)."""
        tables = [SharedTable.attach(table_file_name(secret, port, index), spec, slots)
                  for index, spec in enumerate(specs)]
        if any(table is None for table in tables) or not 0 < worker + 1 < slots:
            return None
        return cls([table for table in tables if table is not None], worker)

    def gather(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """A copy of table ``table``'s rows ``ids`` (int64) as they are now."""
        return self.tables[table].weight.index_select(0, ids)

    def step(self, table: int, ids: torch.Tensor, grads: torch.Tensor, learning_rate: float) -> None:
        """One update of table ``table``'s rows ``ids`` (distinct) with their gradients ``grads``, in place."""
        shared = self.tables[table]
        shared.steps[self.slot] += 1
        step_rows(shared.spec.optimizer, shared.weight, shared.state, ids, grads, learning_rate,
                  int(shared.steps.sum()), distinct=True)
