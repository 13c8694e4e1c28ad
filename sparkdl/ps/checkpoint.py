"""Atomic, versioned snapshots of the parameter server's state.

A checkpoint is written to a temporary file in the same directory, flushed to disk and
renamed into place, so a crash mid-write never leaves a half-written ``ckpt-*.pt``; the
previous checkpoints stay loadable.  Older snapshots are pruned to ``keep``.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ParameterServerError

log = logging.getLogger(__name__)

NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


def checkpoint_path(directory: str | os.PathLike[str], version: int) -> Path:
    return Path(directory) / f"ckpt-{version:012d}.pt"


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` (must hold ``version``) atomically; prune to the newest ``keep``."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, int(state["version"]))
    fd, temporary = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in the directory, oldest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if NAME.match(p.name)), key=lambda p: p.name)


def load_latest_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest checkpoint that loads (a damaged newest one falls back to the one before)."""
    for path in reversed(list_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:   # a damaged file (disk full, copied half-way): try the previous one
            continue
        state["path"] = str(path)
        return state
    return None


def write_run_checkpoint(directory: str, snapshot: dict[str, Any], keep: int, final: bool, owner: str
                         ) -> Exception | None:
    """Write a run's checkpoint; returns the error of a periodic write that failed (logged), else None.

    A periodic write that fails (disk full, say) must not stop the run: the previous
    checkpoints stay intact, since a write is atomic.  The final write raises, so a run never
    reports success without its last checkpoint.
    """
    try:
        save_checkpoint(directory, snapshot, keep=keep)
        return None
    except Exception as exc:
        if final:
            raise ParameterServerError(f"could not write the final checkpoint to {directory!r}: {exc}") from exc
        log.warning("%s: checkpoint at version %s not written: %s", owner, snapshot["version"], exc)
        return exc
