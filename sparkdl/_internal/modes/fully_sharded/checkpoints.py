"""Sharded checkpoints of a fully sharded run, written with ``torch.distributed.checkpoint`` (DCP).

At the end of every epoch each worker writes its own shards of the weights and of the optimizer state
into ``<checkpoint_dir>/fsdp-epoch-NNNNNN/`` (one file per worker), and rank 0 the ``.metadata`` that
maps every parameter's chunks; a checkpoint counts only once its ``.metadata`` exists, which DCP writes
after every worker's files.  The state is stored by parameter name and global shape, not by rank, so a
checkpoint written by N workers loads into M: each worker reads the chunks its own shards overlap.  Rank
0 then removes all but the newest ``checkpoint_keep`` of those this run wrote.  Every worker (and the
driver, which picks the checkpoint to resume from) must reach the directory: a local path in local mode,
or a file system all hosts mount.
"""
from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

_NAME = re.compile(r"^fsdp-epoch-(\d{6})$")
#: DCP's index of a checkpoint, written last by the coordinator (rank 0)
_METADATA = ".metadata"


def local_directory(uri: str) -> Path:
    """The directory a ``checkpoint_dir`` or ``resume_from`` names (a path or a ``file:`` URI)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ValueError(f"fsdp writes its sharded checkpoints from every worker into one directory, which {uri!r} "
                         "(a Hadoop file system URI) is not: give a path all executors share (a local path in "
                         "local mode, a mounted network file system on a cluster)")
    return Path(parsed.path if parsed.scheme else uri)


def complete_checkpoints(directory: Path, since: float | None = None) -> list[tuple[int, Path]]:
    """The whole checkpoints in ``directory``, oldest first, by the epoch they end; with ``since`` (a
    ``time.time()``) only those completed from then on."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in directory.iterdir()
             if (m := _NAME.match(path.name)) and (path / _METADATA).is_file()
             and (since is None or (path / _METADATA).stat().st_mtime >= since)]
    return sorted(found)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, version: int,
           global_batch: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    progress = {"epoch": torch.tensor(epoch), "version": torch.tensor(version),
                "global_batch": torch.tensor(global_batch)}
    return {"model": model_state, "optimizer": optimizer_state, "progress": progress}


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, version: int,
                    global_batch: int, rank: int) -> Path:
    """Every worker's shards after ``epoch`` (a collective: every rank calls it).

    A checkpoint of the same epoch already there (an earlier run's, or an attempt's that failed while writing
    it) is removed first, so no file of it can pass for part of the new one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = directory / f"fsdp-epoch-{epoch:06d}"
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()
    dcp.save(_state(model, optimizer, epoch, version, global_batch), checkpoint_id=str(path))
    return path


def prune(written: list[Path], keep: int) -> None:
    """Remove all but the newest ``keep`` of the checkpoints this run wrote (an earlier run's stay)."""
    for old in written[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    del written[:-keep]


def read_progress(path: Path) -> dict[str, int]:
    """A checkpoint's epoch, version and global batch, read without a process group (on the driver)."""
    import torch.distributed.checkpoint as dcp

    progress = {"epoch": torch.tensor(0), "version": torch.tensor(0), "global_batch": torch.tensor(0)}
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"progress": progress}, checkpoint_id=str(path), no_dist=True)
    return {name: int(value) for name, value in progress.items()}


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Load ``path`` into this worker's shards and optimizer state (a collective); its progress."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer, 0, 0, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {name: int(value) for name, value in state["progress"].items()}
