"""Consistent cuts of executor-hosted PS shards: the bookkeeping of the driver's coordinator.  No I/O.

Every shard sends a snapshot of its key range every ``shard_snapshot_every`` updates of its own.
A *consistent cut* is one snapshot per shard, all at the same version; the newest one is what a
retried barrier stage restarts every shard from (and what a periodic checkpoint merges).  A
shard's snapshot waits here until every other shard has sent one of the same version.
"""
from __future__ import annotations

from ..errors import ProtocolError
from .shards import split_snapshot


class ConsistentCuts:
    """The newest consistent cut of ``shards`` snapshots, and the snapshots still waiting for their cut."""

    def __init__(self, spans: list[tuple[int, int]], resume: dict | None = None) -> None:
        self.shards = len(spans)
        #: the newest cut: one snapshot per shard, all at :attr:`version` (None: no cut yet)
        # a checkpoint's log rows count another run's log: this run's starts empty
        self.cut: list[dict] | None = ([{**part, "log_rows": [0, 0, 0]} for part in split_snapshot(resume, spans)]
                                       if resume is not None else None)
        self.version = int(resume["version"]) if resume is not None else 0
        #: the version a resumed run started from (None: a fresh run)
        self.resumed_from: int | None = self.version if resume is not None else None
        self._pending: dict[int, dict[int, dict]] = {}

    def offer(self, shard: int, version: int, snapshot: dict) -> list[dict] | None:
        """Shard ``shard``'s snapshot at ``version``; returns the new cut when it completes one, else None.

        A snapshot no newer than the current cut is dropped (it can complete no newer cut).
        """
        if not 0 <= shard < self.shards:
            raise ProtocolError(f"shard {shard} is outside [0, {self.shards})")
        if int(snapshot.get("version", -1)) != version:
            raise ProtocolError(f"shard {shard} sent a snapshot labelled {version} of version {snapshot.get('version')}")
        if version <= self.version and self.cut is not None:
            return None
        arrived = self._pending.setdefault(version, {})
        arrived[shard] = snapshot
        if len(arrived) < self.shards:
            return None
        cut = [arrived[i] for i in range(self.shards)]
        self.cut, self.version = cut, version
        self._pending = {v: s for v, s in self._pending.items() if v > version}
        return cut

    def newest_pending(self) -> int:
        """The newest version any shard reached in a snapshot not yet part of a cut (0: none)."""
        return max(self._pending, default=0)

    def forget_pending(self) -> None:
        """A new barrier-stage attempt restarts every shard from the cut: snapshots past it are void."""
        self._pending.clear()

    def start_state(self, shard: int) -> dict | None:
        """What shard ``shard`` restarts from: its snapshot in the newest cut (None: a fresh start)."""
        return None if self.cut is None else self.cut[shard]
