"""Key-range shards of the flat parameter vector, and whole-model snapshots made of shard snapshots.

ps-lite gives every server one contiguous key range (``Postoffice::GetServerKeyRanges``);
sparkdl does the same over the flat float32 vector: shard i owns ``[lo_i, hi_i)``, the
ranges are contiguous, cover every parameter exactly once and are balanced by bytes (a
range may cut through a tensor).  Each shard runs its own :class:`~sparkdl._internal.ps.server.core.PSCore`
over its range.

A *consistent cut* is one snapshot per shard, all at the same version.  Merged, it has the
layout of a single PS's snapshot, so checkpoints look the same whatever the topology and
``resume_from`` takes either kind.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from sparkdl._internal.ps.tables import ROW_STATE_KEYS

#: a shard holds at least this many parameters (4 KiB): smaller ranges cost more in messages than they save
MIN_SHARD_PARAMS = 1024
#: optimizer state entries that hold one value per parameter (the others, such as Adam's step, are shared)
_PER_PARAMETER_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq")
#: an embedding table's state entries that hold one row per table row
_PER_ROW_STATE = ("weight", *ROW_STATE_KEYS)


def shard_count(num_params: int, requested: int) -> int:
    """How many shards a model of ``num_params`` gets when ``requested`` are asked for (at least one)."""
    return max(1, min(requested, num_params // MIN_SHARD_PARAMS))


def shard_spans(num_params: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous ranges covering ``[0, num_params)``, sizes differing by at most one (all empty when
    there are no values: a model made only of embedding tables, which the shards hold by rows)."""
    if not 1 <= shards <= (num_params or shards):
        raise ValueError(f"cannot cut {num_params} parameters into {shards} shards")
    bounds = [num_params * i // shards for i in range(shards + 1)]
    return list(itertools.pairwise(bounds))


def clip_tensor_sizes(tensor_sizes: list[int], span: tuple[int, int]) -> list[int]:
    """The sizes of the pieces of each tensor that fall in ``span`` (per-tensor quantisation scales)."""
    lo, hi = span
    offsets = [0, *itertools.accumulate(tensor_sizes)]
    pieces = [min(hi, end) - max(lo, start) for start, end in itertools.pairwise(offsets)]
    return [size for size in pieces if size > 0]


def _slice_optimizer(state_dict: dict, span: tuple[int, int]) -> dict:
    state = {index: {key: value[span[0]:span[1]].clone() if key in _PER_PARAMETER_STATE else value
                     for key, value in entry.items()}
             for index, entry in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def table_rows_of(table_state: dict[str, Any], shard: int, shards: int) -> dict[str, Any]:
    """The part of a whole table's state (rows and row-wise optimizer state) that PS shard ``shard`` holds:
    every ``shards``-th row from ``shard`` on (``ps.embedding_table``'s striding)."""
    return {key: value[shard::shards].clone() if key in _PER_ROW_STATE else value
            for key, value in table_state.items()}


def check_table_changes(state: dict[str, Any], changes: dict[str, Any]) -> None:
    """A ValueError unless ``changes`` (``EmbeddingTable.changes_since``) fits the shard's table ``state``."""
    rows, weight = changes["rows"], state["weight"]
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError("a table's changed rows must be a 1-d int64 tensor")
    if not isinstance(changes["steps"], int) or changes["steps"] < 0:
        raise ValueError(f"a table's update count must be a count, not {changes['steps']!r}")
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < len(weight)):
        raise ValueError(f"changed rows outside the shard's {len(weight)} rows")
    for key in _PER_ROW_STATE:
        if key in changes and tuple(changes[key].shape) != (rows.numel(),) + tuple(weight.shape[1:]):
            raise ValueError(f"the changed rows' {key} is {tuple(changes[key].shape)}, not "
                             f"{(rows.numel(),) + tuple(weight.shape[1:])}")


def apply_table_changes(state: dict[str, Any], changes: dict[str, Any]) -> None:
    """Lay a shard's changed rows (and their optimizer state) over its table ``state``, in place: what the
    shard held when it took ``changes``, given ``state`` is what it held at an earlier count of updates.
    ``state["weight"]`` may be a view of a whole table's rows (written through)."""
    check_table_changes(state, changes)
    rows = changes["rows"]
    for key in _PER_ROW_STATE:
        if key in changes:
            if key not in state:    # the first update with this state: the other rows' is zero
                state[key] = torch.zeros(state["weight"].shape, dtype=changes[key].dtype)
            state[key][rows] = changes[key]
    state["steps"] = int(changes["steps"])


def interleaved_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """A whole table's rows from its shards' parts (in shard order): shard i's rows at i, i + S, ..."""
    whole = torch.empty((sum(len(part) for part in parts),) + parts[0].shape[1:], dtype=parts[0].dtype)
    for shard, part in enumerate(parts):
        whole[shard::len(parts)] = part
    return whole


def merged_table(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole table's state from its shards' parts (in shard order); its update count is the largest
    shard's (each shard counts the updates that touched its rows)."""
    merged: dict[str, Any] = {"steps": max(int(part["steps"]) for part in parts)}
    for key in _PER_ROW_STATE:
        if any(key in part for part in parts):
            if not all(key in part for part in parts):   # a shard none of whose rows was updated yet
                template = next(part[key] for part in parts if key in part)
                parts = [part if key in part else {**part, key: torch.zeros((len(part["weight"]),) + template.shape[1:])}
                         for part in parts]
            merged[key] = interleaved_rows([part[key] for part in parts])
    return merged


def split_snapshot(snapshot: dict[str, Any], spans: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """A whole PS's snapshot (a checkpoint) as one snapshot per shard range (tables: every S-th row)."""
    if snapshot["num_params"] != spans[-1][1]:
        raise ValueError(f"the checkpoint holds {snapshot['num_params']} parameters, the model has "
                         f"{spans[-1][1]}: it belongs to another model")
    return [{**snapshot, "weights": snapshot["weights"][lo:hi].clone(), "num_params": hi - lo,
             "optimizer": _slice_optimizer(snapshot["optimizer"], (lo, hi)),
             "tables": [table_rows_of(table, shard, len(spans)) for table in snapshot.get("tables", [])]}
            for shard, (lo, hi) in enumerate(spans)]


def merge_snapshots(snapshots: list[dict[str, Any]], same_version: bool = True) -> dict[str, Any]:
    """One whole-model snapshot from a consistent cut (shard snapshots of one version, in range order).

    ``same_version=False`` merges the shards' final states, whose versions may differ by the
    updates whose gradients one shard refused as too stale and another applied (async).
    """
    versions = {s["version"] for s in snapshots}
    if same_version and len(versions) != 1:
        raise ValueError(f"shard snapshots of different versions {sorted(versions)} are not a consistent cut")
    first = snapshots[0]
    states = [s["optimizer"]["state"].get(0) for s in snapshots]
    if any(state is None for state in states):    # no step yet on some shard: no optimizer state
        merged_state: dict = {}
    else:
        merged_state = {0: {key: torch.cat([s[key] for s in states]) if key in _PER_PARAMETER_STATE else value
                            for key, value in states[0].items()}}
    return {**first, "weights": torch.cat([s["weights"] for s in snapshots]),
            "num_params": sum(s["num_params"] for s in snapshots),
            "optimizer": {"state": merged_state, "param_groups": first["optimizer"]["param_groups"]},
            # positions and counts: every push reaches every shard, so the cut's are shard 0's; time: the latest
            "time_s": max(s["time_s"] for s in snapshots),
            "tables": [merged_table([s["tables"][i] for s in snapshots]) for i in range(len(first.get("tables", [])))]}
