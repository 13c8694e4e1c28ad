"""Snapshots of a parameter server's state, and the restore of one: checkpoints and shard snapshots. No I/O.

A snapshot holds what a run needs to continue: the master weights, the optimizer state, the
version and counters, every slot's data position and the tables' rows.  Updates make one *due*
every ``snapshot_every`` versions; the server writes it (a checkpoint file) or sends it (an
executor-hosted shard's to the driver) outside its lock.  An executor-hosted shard's periodic
snapshots carry only the table rows changed since the previous one (the coordinator lays them
over the consistent cut it keeps).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.membership import Membership
from sparkdl._internal.ps.server.policy import UpdatePolicy
from sparkdl._internal.ps.server.runlog import RunLog
from sparkdl._internal.training.optim import FlatOptimizer
from sparkdl.config import TrainConfig

#: where the tables' changes start: (each table's update count, the PS version) at a snapshot
TableMarks = tuple[list[int], int]


class Snapshots:
    """Takes and restores snapshots of one PS's state (under the core's caller's lock)."""

    def __init__(self, config: TrainConfig, master: torch.nn.Parameter, optimizer: FlatOptimizer,
                 tables: Sequence[EmbeddingTable], policy: UpdatePolicy, members: Membership, log: RunLog) -> None:
        self.config = config
        self.master = master
        self.optimizer = optimizer
        self.tables = list(tables)
        self.policy = policy
        self.members = members
        self.log = log
        #: executor-hosted shards: periodic snapshots carry only the table rows changed since the previous one
        self.table_changes_only = False
        #: versions at which a snapshot becomes due: multiples of any of these (checkpoint files, shard snapshots)
        self.every: tuple[int, ...] = (config.checkpoint_every,) if config.checkpoint_dir else ()
        self._marks: TableMarks = ([table.steps for table in self.tables], 0)
        self._due_marks = self._marks     # where the due snapshot's changes start
        self._start_marks = self._marks   # where this PS started (its final changes start there)
        self._due: dict | None = None

    def after_update(self, version: int) -> None:
        """An update made ``version``: a snapshot becomes due at the versions ``every`` names."""
        if not any(version % every == 0 for every in self.every):
            return
        if self.table_changes_only:
            if self._due is not None:
                # replaced before it was taken out, so never sent: the new one's changes start where its did
                self._marks = self._due_marks
            self._due_marks = self._marks
        self._due = self.take("changed" if self.table_changes_only else "whole")

    def take_due(self) -> dict | None:
        """The snapshot a completed update made due for writing, once (written outside the lock)."""
        due, self._due = self._due, None
        return due

    def take(self, tables: str = "whole", table_optimizer_state: bool = True) -> dict:
        """A copy of everything a checkpoint holds.

        ``tables``: ``"whole"`` copies every table; ``"changed"`` takes only the rows changed since the
        previous ``"changed"`` snapshot, ``"since_start"`` those changed since this PS started (restored);
        then ``tables_after`` is the version those changes start from, and the changed rows come without
        their optimizer state unless ``table_optimizer_state``.
        """
        stats = self.log.stats
        state = {"version": self.policy.version, "weights": self.master.detach().clone(),
                 "optimizer": copy.deepcopy(self.optimizer.state_dict()), "updates": stats.updates,
                 "applied_gradients": stats.applied_gradients, "policy": self.config.policy,
                 "num_params": self.master.numel(), "consumed": self.members.positions(), "time_s": self.log.now(),
                 "samples_consumed": self.members.samples_consumed,
                 # the run log's rows at this snapshot: a run resumed from it drops the later ones
                 "log_rows": list(self.log.row_counts()[:3])}
        if tables == "whole":
            state["tables"] = [table.state_dict() for table in self.tables]
            return state
        if tables not in ("changed", "since_start"):
            raise ValueError(f"tables must be 'whole', 'changed' or 'since_start', not {tables!r}")
        steps, after = self._marks if tables == "changed" else self._start_marks
        state["tables"] = [table.changes_since(mark, table_optimizer_state)
                           for table, mark in zip(self.tables, steps, strict=True)]
        state["tables_after"] = after
        if tables == "changed":
            self._marks = ([table.steps for table in self.tables], self.policy.version)
        return state

    def restore(self, checkpoint: dict) -> None:
        """Continue from a checkpoint: weights, optimizer state, version, data positions."""
        num_params = self.master.numel()
        if checkpoint["num_params"] != num_params:
            raise ValueError(f"the checkpoint holds {checkpoint['num_params']} parameters, the model has "
                             f"{num_params}: it belongs to another model")
        positions = checkpoint.get("consumed", [])
        slots = self.members.slots
        if len(positions) != len(slots):
            raise ValueError(f"the checkpoint was written by a run with {len(positions)} workers; resume with "
                             f"num_workers={len(positions)}")
        tables = checkpoint.get("tables", [])
        if [t["weight"].shape for t in tables] != [t.weight.shape for t in self.tables]:
            raise ValueError(f"the checkpoint holds embedding tables of {[tuple(t['weight'].shape) for t in tables]}, "
                             f"the model has {[tuple(t.weight.shape) for t in self.tables]}: it belongs to another model")
        self.master.data.copy_(checkpoint["weights"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        for table, state in zip(self.tables, tables, strict=True):
            table.load_state_dict(state)
        self._marks = self._due_marks = self._start_marks = (
            [table.steps for table in self.tables], int(checkpoint["version"]))
        self.policy.version = int(checkpoint["version"])
        self.log.stats.updates = int(checkpoint.get("updates", 0))
        self.log.stats.applied_gradients = int(checkpoint.get("applied_gradients", 0))
        for slot, consumed in zip(slots, positions, strict=True):
            slot.consumed = int(consumed)
        self.members.samples_consumed = int(checkpoint.get("samples_consumed", 0))
        self.log.event("resumed", self.policy.version, path=checkpoint.get("path", ""))
