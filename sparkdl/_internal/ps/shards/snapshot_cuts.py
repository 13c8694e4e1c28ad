"""Consistent cuts of executor-hosted PS shards: the bookkeeping of the driver's coordinator.  No I/O.

Every shard sends a snapshot of its key range every ``shard_snapshot_every`` updates of its own.
A *consistent cut* is one snapshot per shard, all at the same version; the newest one is what a
retried barrier stage restarts every shard from (and what a periodic checkpoint merges).  A
shard's snapshot waits here until every other shard has sent one of the same version.

Embedding tables are too large to copy at every snapshot: a shard's snapshot carries only the
rows changed since its previous one (``tables_after`` names that one's version), and the cut's
tables are kept here, one state per shard, with each completed cut's changes laid over them.  A
cut completes only when every shard's chain of changes from the previous cut to it has arrived
(two snapshots of a shard can arrive out of order: they are sent by different handler threads).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from sparkdl._internal.ps.shards.ranges import apply_table_changes, check_table_changes, split_snapshot
from sparkdl.errors import ProtocolError


class ConsistentCuts:
    """The newest consistent cut of ``shards`` snapshots, and the snapshots still waiting for their cut."""

    def __init__(self, spans: list[tuple[int, int]], resume: dict | None = None,
                 tables: Sequence[torch.Tensor] = ()) -> None:
        """``tables``: the embedding tables' initial rows (a fresh start), whose every S-th row from row i
        on is shard i's; the cut's tables are written through into them."""
        self.shards = len(spans)
        parts = split_snapshot(resume, spans) if resume is not None else None
        #: the newest cut: one snapshot per shard, all at :attr:`version` (None: no cut yet)
        # a checkpoint's log rows count another run's log: this run's starts empty
        self.cut: list[dict] | None = ([{**part, "log_rows": [0, 0, 0]} for part in parts]
                                       if parts is not None else None)
        #: per shard, per table: its rows and row-wise optimizer state at the cut (or the start)
        self.tables: list[list[dict]] = (
            [part["tables"] for part in parts] if parts is not None
            else [[{"weight": rows[shard::self.shards], "steps": 0} for rows in tables] for shard in range(self.shards)])
        self.version = int(resume["version"]) if resume is not None else 0
        #: the version a resumed run started from (None: a fresh run)
        self.resumed_from: int | None = self.version if resume is not None else None
        self._pending: dict[int, dict[int, dict]] = {}

    def offer(self, shard: int, version: int, snapshot: dict) -> list[int]:
        """Keep shard ``shard``'s snapshot at ``version``; returns the versions of the cuts it lets form, oldest
        first (each formed by :meth:`advance`, which lays it over the tables the one before left).

        A snapshot no newer than the current cut is dropped (it can complete no newer cut).
        """
        if not 0 <= shard < self.shards:
            raise ProtocolError(f"shard {shard} is outside [0, {self.shards})")
        if int(snapshot.get("version", -1)) != version:
            raise ProtocolError(f"shard {shard} sent a snapshot labelled {version} of version {snapshot.get('version')}")
        after = snapshot.get("tables_after")
        if not isinstance(after, int) or not 0 <= after < version:
            raise ProtocolError(f"shard {shard}'s snapshot at version {version} says its changed rows start at "
                                f"version {after!r}")
        self._check_changes(shard, snapshot, f"snapshot at version {version}")
        if version <= self.version and self.cut is not None:
            return []
        self._pending.setdefault(version, {})[shard] = snapshot
        return self.formable()

    def formable(self) -> list[int]:
        """The versions of the cuts whose snapshots have all arrived, oldest first (nothing changes)."""
        versions, reached = [], self.version
        for candidate in sorted(self._pending):
            if self._chains(candidate, reached) is not None:
                versions.append(candidate)
                reached = candidate
        return versions

    def advance(self) -> list[dict] | None:
        """Form the oldest cut whose snapshots have all arrived (it becomes the current one), else None: so
        no cut, a checkpoint's among them, is skipped when one snapshot completes two."""
        for candidate in sorted(self._pending):
            chains = self._chains(candidate, self.version)
            if chains is not None:
                return self._complete(candidate, chains)
        return None

    def _check_changes(self, shard: int, snapshot: dict, what: str) -> None:
        """A ProtocolError unless every table's changes in ``snapshot`` fit shard ``shard``'s (checked before any is
        kept, so a malformed report changes nothing)."""
        changes = snapshot.get("tables", [])
        if not isinstance(changes, list) or len(changes) != len(self.tables[shard]):
            raise ProtocolError(f"shard {shard}'s {what} holds {len(changes)} tables' changed rows, "
                                f"not {len(self.tables[shard])}")
        try:
            for state, change in zip(self.tables[shard], changes, strict=True):
                check_table_changes(state, change)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"shard {shard}'s {what}: {exc}") from None

    def check_final(self, shard: int, final: dict) -> None:
        """A ProtocolError unless shard ``shard``'s final state's changed rows fit it (checked when it arrives)."""
        if "tables_after" in final:
            self._check_changes(shard, final, "final state")

    def _chains(self, version: int, start: int) -> list[list[dict]] | None:
        """Per shard, its snapshots from version ``start`` to ``version`` in order, when all of them have arrived."""
        arrived = self._pending[version]
        if len(arrived) < self.shards:
            return None
        chains = []
        for shard in range(self.shards):
            by_start = {s["tables_after"]: s for v, group in self._pending.items() if v <= version
                        for i, s in group.items() if i == shard}
            chain, reached = [], start
            while reached != version:
                link = by_start.get(reached)
                if link is None:
                    return None
                chain.append(link)
                reached = int(link["version"])
            chains.append(chain)
        return chains

    def _complete(self, version: int, chains: list[list[dict]]) -> list[dict]:
        for shard, chain in enumerate(chains):
            for link in chain:
                for state, change in zip(self.tables[shard], link["tables"], strict=True):
                    apply_table_changes(state, change)
        self.cut = [{**_without_link(self._pending[version][shard]), "tables": self.tables[shard]}
                    for shard in range(self.shards)]
        self.version = version
        self._pending = {v: s for v, s in self._pending.items() if v > version}
        return self.cut

    def newest_pending(self) -> int:
        """The newest version any shard reached in a snapshot not yet part of a cut (0: none)."""
        return max(self._pending, default=0)

    def forget_pending(self) -> None:
        """A new barrier-stage attempt restarts every shard from the cut: snapshots past it are void."""
        self._pending.clear()

    def start_state(self, shard: int) -> dict | None:
        """What shard ``shard`` restarts from: its snapshot in the newest cut (None: a fresh start), its tables'
        rows made contiguous (they may be views of the whole tables); not a copy otherwise: encode it under the
        lock that guards the cut, whose tables change in place."""
        if self.cut is None:
            return None
        return {**self.cut[shard], "tables": [_contiguous(state) for state in self.tables[shard]]}

    def final_snapshot(self, shard: int, final: dict) -> dict:
        """Shard ``shard``'s final snapshot with whole tables: the rows it changed since it started laid over
        the cut's (every row it did not change is the cut's, or the start's, still); once the run is over."""
        if "tables_after" not in final:   # already whole
            return final
        tables = []
        for state, change in zip(self.tables[shard], final["tables"], strict=True):   # checked on arrival
            apply_table_changes(state, change)
            # a final state taken without optimizer state (no final checkpoint): the cut's would be older
            tables.append({key: value for key, value in state.items() if key in ("weight", "steps") or key in change})
        return {**_without_link(final), "tables": tables}


def _without_link(snapshot: dict) -> dict:
    return {key: value for key, value in snapshot.items() if key != "tables_after"}


def _contiguous(state: dict) -> dict:
    return {key: value.contiguous() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
