"""Where a worker keeps its shard while it trains: in memory, or spilled to executor-local disk.

The partition arrives from Spark in chunks (Arrow batches, or a few thousand RDD rows) and
is never held whole unless it stays in memory.  ``TrainConfig.data_cache``:

- ``"memory"``: the chunks are joined into one array, on the training device when the rows
  are numeric (the fastest; needs about twice the shard in host memory while it loads);
- ``"disk"``: every chunk is appended, as it arrives, to files under Spark's local
  directories, which the loader then reads through memory maps (resident memory: a few
  batches, whatever the shard's size);
- ``"auto"``: memory while the shard stays under :func:`memory_budget`, disk once it grows
  past it (the chunks held so far are written out, then streaming continues).

The spill files live in a private directory (mode 0700) that is removed when the task ends;
a retried task writes its own.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..training.batches import DeviceShard, DiskShard, HostShard, Shard, SpillLayout
from ..ps.limits import available_memory_bytes
from ..training.losses import targets_for_loss

#: one piece of a partition: features (float32 [k, *row shape], or an object array of k bytes rows), labels
Chunk = tuple[np.ndarray, "np.ndarray | None"]
#: partition input (Arrow batches or RDD rows) -> its chunks
ChunksFn = Callable[[Iterator[Any]], Iterator[Chunk]]

#: "auto" keeps a shard in memory up to this fraction of the memory it may use (loading needs ~2x, plus
#: the model, its optimizer and the batches)
MEMORY_FRACTION = 0.25


def memory_budget(tasks_on_host: int, device: torch.device) -> int:
    """Shard bytes that ``"auto"`` keeps in memory.

    A quarter of this task's share of the host's available memory (``MemAvailable`` divided by
    the run's tasks on this host), of ``spark.executor.pyspark.memory`` when it is set, and, on
    a GPU, of the device's memory.
    """
    # unreadable (not Linux): assume 4 GiB per task, a modest executor
    share = (available_memory_bytes() or (4 << 30) * tasks_on_host) / max(1, tasks_on_host)
    pyspark_mb = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    if pyspark_mb:
        share = min(share, int(pyspark_mb) * (1 << 20) / max(1, tasks_on_host))
    if device.type == "cuda":
        share = min(share, torch.cuda.get_device_properties(device).total_memory)
    return int(share * MEMORY_FRACTION)


def spill_root() -> str:
    """The first of Spark's local directories (cleaned by Spark with the executor), else the temp dir."""
    local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
    return local_dirs[0] if local_dirs else tempfile.gettempdir()


def _nbytes(features: np.ndarray) -> int:
    if features.dtype == object:
        return sum(len(row) for row in features)
    return features.nbytes


class SpillWriter:
    """Appends chunks to a shard's files in a private directory; :meth:`finish` gives their layout."""

    def __init__(self, root: str, first: Chunk) -> None:
        features, labels = first
        self.directory = tempfile.mkdtemp(prefix="sparkdl-shard-", dir=root)   # mode 0700
        self.encoded = features.dtype == object
        self.row_shape = None if self.encoded else tuple(features.shape[1:])
        self.label_dtype = None if labels is None else labels.dtype
        self.rows = 0
        self._files = {}
        try:
            if self.encoded:
                self._open("values.bin")
                self._open("offsets.i64").write(np.zeros(1, np.int64).tobytes())
                self._next_offset = 0
            else:
                self._open("features.f32")
            if labels is not None:
                self._open("labels")
        except BaseException:
            self.discard()
            raise

    def _open(self, name: str) -> Any:
        handle = open(os.path.join(self.directory, name), "wb")
        self._files[name] = handle
        return handle

    def write(self, chunk: Chunk) -> None:
        features, labels = chunk
        if self.encoded != (features.dtype == object) or (not self.encoded and features.shape[1:] != self.row_shape):
            raise ValueError(f"rows {self.rows} onwards of the partition have features of another shape or kind "
                             f"({features.shape[1:]}) than the rows before ({self.row_shape or 'bytes'})")
        if self.encoded:
            lengths = np.fromiter((len(row) for row in features), np.int64, len(features))
            self._files["values.bin"].write(b"".join(bytes(row) for row in features))
            offsets = self._next_offset + np.cumsum(lengths)
            self._files["offsets.i64"].write(offsets.tobytes())
            self._next_offset = int(offsets[-1]) if len(offsets) else self._next_offset
        else:
            # arrays are written through the buffer protocol: no bytes copy of a chunk
            self._files["features.f32"].write(np.ascontiguousarray(features, np.float32).data)
        if labels is not None:
            self._files["labels"].write(np.ascontiguousarray(labels, self.label_dtype).data)
        self.rows += len(features)

    def finish(self) -> SpillLayout:
        for handle in self._files.values():
            handle.close()
        return SpillLayout(self.directory, self.rows, self.row_shape,
                           None if self.label_dtype is None else self.label_dtype.str)

    def discard(self) -> None:
        for handle in self._files.values():
            handle.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class CachedShard:
    """A worker's shard and where it was kept."""

    shard: Shard
    cache: str                 # "memory" | "disk"
    nbytes: int                # the features' bytes
    directory: str | None = None

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _in_memory(chunks: list[Chunk], device: torch.device) -> Shard:
    if not chunks:
        return DeviceShard(torch.zeros(0, dtype=torch.float32, device=device), None)
    features = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
    has_labels = chunks[0][1] is not None
    labels = (np.concatenate([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]) if has_labels else None
    if features.dtype == object:
        return HostShard(features, labels)
    # Arrow-backed arrays are read-only; torch wants writable memory
    x = torch.from_numpy(np.require(features, np.float32, requirements=["W"])).to(device)
    y = None if labels is None else torch.from_numpy(np.require(labels, requirements=["W"])).to(device)
    return DeviceShard(x, y)


def cache_shard(chunks: Iterator[Chunk], mode: str, loss: Any, device: torch.device, budget: int,
                root: str | None = None) -> CachedShard:
    """Read a partition's chunks into a shard kept as ``mode`` says ("memory", "disk" or "auto").

    Labels become the loss's targets here, chunk by chunk.  An error while reading leaves no
    spill files behind.
    """
    held: list[Chunk] = []
    held_bytes = 0
    writer: SpillWriter | None = None
    try:
        for features, labels in chunks:
            if not len(features):
                continue
            chunk = (features, None if labels is None else targets_for_loss(labels, loss))
            if writer is None:
                size = _nbytes(features)
                if mode == "memory" or (mode == "auto" and held_bytes + size <= budget):
                    held.append(chunk)
                    held_bytes += size
                    continue
                writer = SpillWriter(root or spill_root(), held[0] if held else chunk)
                for earlier in held:
                    writer.write(earlier)
                held, held_bytes = [], 0
            writer.write(chunk)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    if writer is None:
        return CachedShard(_in_memory(held, device), "memory", held_bytes)
    layout = writer.finish()
    nbytes = os.path.getsize(layout.path("features.f32" if layout.row_shape is not None else "values.bin"))
    return CachedShard(DiskShard(layout), "disk", nbytes, layout.directory)


@contextlib.contextmanager
def cached_shard(chunks: Iterator[Chunk], mode: str, loss: Any, device: torch.device, tasks_on_host: int
                 ) -> Iterator[CachedShard]:
    """:func:`cache_shard` for the length of a task: spill files are removed when it ends, however it ends."""
    budget = memory_budget(tasks_on_host, device) if mode == "auto" else 0
    cached = cache_shard(chunks, mode, loss, device, budget)
    try:
        yield cached
    finally:
        cached.close()
