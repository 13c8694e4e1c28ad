"""Versioned snapshots of the parameter server's state, on a local path or any Hadoop-compatible URI.

Where checkpoints go is a :class:`CheckpointFiles` store.  On a local path (:class:`LocalFiles`)
a checkpoint is written to a temporary file in the same directory, flushed to disk and renamed
into place, so a crash mid-write never leaves a half-written ``ckpt-*.pt``.  Stores without an
atomic rename (object stores behind ``s3a:``, ``abfss:`` ...; ``sparkdl._internal.spark.hadoop_files``)
write the checkpoint, then a small manifest beside it: a checkpoint counts only once its manifest
says it is whole.  Either way the previous checkpoints stay loadable, and older ones are pruned
to ``keep``.
"""
from __future__ import annotations

import io
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from sparkdl.errors import ParameterServerError

log = logging.getLogger(__name__)

NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


def checkpoint_name(version: int) -> str:
    return f"ckpt-{version:012d}.pt"


class CheckpointFiles(Protocol):
    """Where a run's checkpoints live: publish one whole or not at all, list the whole ones, read, remove."""

    def publish(self, directory: str, name: str, state: dict[str, Any]) -> str:
        """Write ``state`` as ``directory/name``, visible to :meth:`complete` only once whole; its location."""
        ...

    def complete(self, directory: str) -> list[str]:
        """Names of the whole checkpoints in ``directory`` (none if it does not exist), oldest first."""
        ...

    def read(self, directory: str, name: str) -> dict[str, Any]:
        ...

    def remove(self, directory: str, name: str) -> None:
        ...

    def location(self, directory: str, name: str) -> str:
        ...


def local_path(location: str) -> Path:
    """A directory of this machine: a plain path, or the path of a ``file:`` URI."""
    return Path(urlparse(location).path) if location.startswith("file:") else Path(location)


class LocalFiles:
    """Checkpoints in a directory of this machine: written to a temporary file, renamed into place."""

    def publish(self, directory: str, name: str, state: dict[str, Any]) -> str:
        folder = local_path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, folder / name)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return str(folder / name)

    def complete(self, directory: str) -> list[str]:
        folder = local_path(directory)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME.match(p.name))

    def read(self, directory: str, name: str) -> dict[str, Any]:
        return torch.load(local_path(directory) / name, map_location="cpu", weights_only=False)

    def remove(self, directory: str, name: str) -> None:
        (local_path(directory) / name).unlink(missing_ok=True)

    def location(self, directory: str, name: str) -> str:
        return str(local_path(directory) / name)


#: plain paths (and ``file:`` URIs under Spark Connect, where the client writes them itself)
LOCAL = LocalFiles()


def state_bytes(state: dict[str, Any]) -> bytes:
    """A checkpoint's bytes, for stores that take whole files."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def checkpoint_path(directory: str | os.PathLike[str], version: int) -> Path:
    return Path(directory) / checkpoint_name(version)


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any], keep: int = 3,
                    files: CheckpointFiles = LOCAL) -> str:
    """Write ``state`` (must hold ``version``) whole or not at all; prune to the newest ``keep``."""
    folder = os.fspath(directory)
    written = files.publish(folder, checkpoint_name(int(state["version"])), state)
    for old in files.complete(folder)[:-keep]:
        files.remove(folder, old)
    return written


def list_checkpoints(directory: str | os.PathLike[str], files: CheckpointFiles = LOCAL) -> list[str]:
    """Locations of the whole checkpoints in the directory, oldest first."""
    folder = os.fspath(directory)
    return [files.location(folder, name) for name in files.complete(folder)]


def load_latest_checkpoint(directory: str | os.PathLike[str], files: CheckpointFiles = LOCAL) -> dict[str, Any] | None:
    """The newest checkpoint that loads (a damaged newest one falls back to the one before)."""
    folder = os.fspath(directory)
    for name in reversed(files.complete(folder)):
        try:
            state = files.read(folder, name)
        except Exception:   # a damaged file (disk full, copied half-way): try the previous one
            continue
        state["path"] = files.location(folder, name)
        return state
    return None


def write_run_checkpoint(directory: str, snapshot: dict[str, Any], keep: int, final: bool, owner: str,
                         files: CheckpointFiles = LOCAL) -> Exception | None:
    """Write a run's checkpoint; returns the error of a periodic write that failed (logged), else None.

    A periodic write that fails (disk full, say) must not stop the run: the previous
    checkpoints stay intact, since a write is whole or absent.  The final write raises, so a run
    never reports success without its last checkpoint.
    """
    try:
        save_checkpoint(directory, snapshot, keep=keep, files=files)
        return None
    except Exception as exc:
        if final:
            raise ParameterServerError(f"could not write the final checkpoint to {directory!r}: {exc}") from exc
        log.warning("%s: checkpoint at version %s not written: %s", owner, snapshot["version"], exc)
        return exc
