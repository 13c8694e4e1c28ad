"""Where a worker keeps its partition while it trains: in memory, or spilled to executor-local disk.

The partition arrives from Spark in chunks (Arrow batches, or a few thousand RDD rows) and
is never held whole unless it stays in memory.  ``TrainConfig.data_cache``:

- ``"memory"``: the chunks are joined into one array, on the training device when the rows
  are numeric (the fastest; needs about twice the partition in host memory while it loads);
- ``"disk"``: every chunk is appended, as it arrives, to unlinked files under Spark's local
  directories, which the loader then reads row by row with positional reads (resident
  memory: a few batches and the labels, whatever the partition's size);
- ``"auto"``: memory while the partition stays under :func:`memory_budget`, disk once it grows
  past it (the chunks held so far are written out, then streaming continues).

The spill files are created in a private directory (mode 0700) and unlinked at once: they
vanish with the task's process however it ends, and a retried task writes its own.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from ..memory import available_memory_bytes
from .partitions import DevicePartition, DiskPartition, HostPartition, Partition, SpillFile, SpillLayout

#: one piece of a partition: features (float32 [k, *row shape], or an object array of k bytes rows), labels
Chunk = tuple[np.ndarray, "np.ndarray | None"]
#: partition input (Arrow batches or RDD rows) -> its chunks
ChunksFn = Callable[[Iterator[Any]], Iterator[Chunk]]

#: "auto" keeps a partition in memory up to this fraction of the memory it may use (loading needs ~2x, plus
#: the model, its optimizer and the batches)
MEMORY_FRACTION = 0.25


def targets_for_loss(labels: np.ndarray, loss: Any) -> np.ndarray:
    """Class indices (int64) for cross-entropy, float32 targets otherwise."""
    if loss == "cross_entropy":
        return labels.astype(np.int64, copy=False)
    return labels.astype(np.float32, copy=False)


@dataclass(frozen=True)
class MemoryBudget:
    """Partition bytes that ``"auto"`` keeps in memory: on the host, and on the device for numeric rows."""

    host: int
    device: int | None = None      # None: the partition would not live on an accelerator

    def allows(self, nbytes: int, encoded: bool) -> bool:
        if self.device is not None and not encoded:      # numeric rows live on the GPU, encoded ones in host memory
            return nbytes <= min(self.host, self.device)
        return nbytes <= self.host


def memory_budget(tasks_on_host: int, device: torch.device) -> MemoryBudget:
    """A quarter of this task's share of the host's available memory (``MemAvailable`` divided by
    the run's tasks on this host) and of ``spark.executor.pyspark.memory`` when it is set (Spark
    hands each Python worker its share as ``PYSPARK_EXECUTOR_MEMORY_MB``); on a GPU, also a
    quarter of the device's memory.
    """
    # unreadable (not Linux): assume 4 GiB per task, a modest executor
    share = (available_memory_bytes() or (4 << 30) * tasks_on_host) / max(1, tasks_on_host)
    pyspark_mb = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    if pyspark_mb:
        share = min(share, int(pyspark_mb) * (1 << 20))
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return MemoryBudget(int(share * MEMORY_FRACTION), None if gpu is None else int(gpu * MEMORY_FRACTION))


def spill_root() -> str:
    """The first of Spark's local directories (cleaned by Spark with the executor), else the temp dir."""
    local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
    return local_dirs[0] if local_dirs else tempfile.gettempdir()


def _nbytes(features: np.ndarray) -> int:
    if features.dtype == object:
        return sum(len(row) for row in features)
    return features.nbytes


class SpillWriter:
    """Appends chunks to a partition's files; :meth:`finish` gives the :class:`SpillLayout` to read them.

    The files are unlinked as soon as they are created (and their private 0700 directory
    removed): nothing is left on disk after the task, however it ends, SIGKILL and the OOM
    killer included.  The kernel frees the space when the last descriptor closes.
    """

    def __init__(self, root: str, first: Chunk) -> None:
        features, labels = first
        self.encoded = features.dtype == object
        self.row_shape = None if self.encoded else tuple(features.shape[1:])
        self.label_dtype = None if labels is None else labels.dtype
        self.label_shape = None if labels is None else tuple(labels.shape[1:])
        self.rows = 0
        self.written_bytes = 0          # the features' (or encoded rows') bytes
        self._next_offset = 0
        self._offsets: list[np.ndarray] = [np.zeros(1, np.int64)]
        self._files: dict[str, Any] = {}
        directory = tempfile.mkdtemp(prefix="sparkdl-partition-", dir=root)   # mode 0700
        try:
            for name in ["values" if self.encoded else "features"] + (["labels"] if labels is not None else []):
                path = os.path.join(directory, name)
                self._files[name] = open(path, "w+b")
                os.unlink(path)
        except BaseException:
            self.discard()
            raise
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def write(self, chunk: Chunk) -> None:
        features, labels = chunk
        if self.encoded != (features.dtype == object) or (not self.encoded and features.shape[1:] != self.row_shape):
            raise DataError(f"rows {self.rows} onwards of the partition have features of another shape or kind "
                             f"({features.shape[1:]}) than the rows before ({self.row_shape or 'bytes'})")
        if (labels is None) != (self.label_dtype is None) or (labels is not None
                                                              and labels.shape[1:] != self.label_shape):
            raise DataError(f"rows {self.rows} onwards of the partition have labels of another shape than the rows "
                             "before")
        if self.encoded:
            lengths = np.fromiter((len(row) for row in features), np.int64, len(features))
            data = b"".join(bytes(row) for row in features)
            self._files["values"].write(data)
            self.written_bytes += len(data)
            offsets = self._next_offset + np.cumsum(lengths)
            self._offsets.append(offsets)      # 8 bytes a row, held like the labels
            self._next_offset = int(offsets[-1]) if len(offsets) else self._next_offset
        else:
            # arrays are written through the buffer protocol: no bytes copy of a chunk
            rows = np.ascontiguousarray(features, np.float32)
            self._files["features"].write(rows.data)
            self.written_bytes += rows.nbytes
        if labels is not None:
            self._files["labels"].write(np.ascontiguousarray(labels, self.label_dtype).data)
        self.rows += len(features)

    def finish(self) -> SpillLayout:
        """Flush, read the labels back into memory, and hand over the rows' file for reading."""
        labels = None
        for handle in self._files.values():
            handle.flush()
        if "labels" in self._files:
            handle = self._files["labels"]
            assert self.label_shape is not None   # set with the labels file, from the first chunk's labels
            data = os.pread(handle.fileno(), os.fstat(handle.fileno()).st_size, 0)
            labels = np.frombuffer(data, self.label_dtype).reshape(self.rows, *self.label_shape).copy()
        values = self._files["values" if self.encoded else "features"]
        layout = SpillLayout(self.rows, self.row_shape, SpillFile(os.dup(values.fileno()),
                                                                  "values" if self.encoded else "features"),
                             np.concatenate(self._offsets) if self.encoded else None, labels)
        self.discard()
        return layout

    def discard(self) -> None:
        """Close every handle (the unlinked files go with the last one)."""
        for handle in self._files.values():
            try:
                handle.close()
            except OSError:
                pass
        self._files = {}


@dataclass
class CachedPartition:
    """A worker's partition and where it was kept."""

    partition: Partition
    cache: str                 # "memory" | "disk"
    nbytes: int                # the features' bytes

    def close(self) -> None:
        """Free the spill file now rather than when the garbage collector gets to it."""
        if isinstance(self.partition, DiskPartition):
            self.partition.layout.values.close()


def _in_memory(chunks: list[Chunk], device: torch.device) -> Partition:
    if not chunks:
        return DevicePartition(torch.zeros(0, dtype=torch.float32, device=device), None)
    shapes = {(c[0].dtype == object, c[0].shape[1:]) for c in chunks}
    if len(shapes) > 1:     # RDD rows are checked chunk by chunk; chunks must agree too
        raise DataError(f"the partition's rows have features of different shapes or kinds ({sorted(shapes)}); "
                        "every row needs the same shape")
    features = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
    has_labels = chunks[0][1] is not None
    labels = (np.concatenate([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]) if has_labels else None
    if features.dtype == object:
        return HostPartition(features, labels)
    # Arrow-backed arrays are read-only; torch wants writable memory
    x = torch.from_numpy(np.require(features, np.float32, requirements=["W"])).to(device)
    y = None if labels is None else torch.from_numpy(np.require(labels, requirements=["W"])).to(device)
    return DevicePartition(x, y)


def cache_partition(chunks: Iterator[Chunk], mode: str, loss: Any, device: torch.device, budget: MemoryBudget | int,
                root: str | None = None) -> CachedPartition:
    """Read a partition's chunks into a partition kept as ``mode`` says ("memory", "disk" or "auto").

    Labels become the loss's targets here, chunk by chunk.  An error while reading leaves no
    spill files behind.
    """
    if isinstance(budget, int):
        budget = MemoryBudget(budget)
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
                if mode == "memory" or (mode == "auto" and budget.allows(held_bytes + size, features.dtype == object)):
                    held.append(chunk)
                    held_bytes += size
                    continue
                writer = SpillWriter(root or spill_root(), held[0] if held else chunk)
                for earlier in held:
                    writer.write(earlier)
                held, held_bytes = [], 0
            writer.write(chunk)
        if writer is None:
            return CachedPartition(_in_memory(held, device), "memory", held_bytes)
        return CachedPartition(DiskPartition(writer.finish()), "disk", writer.written_bytes)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise


@contextlib.contextmanager
def cached_partition(chunks: Iterator[Chunk], mode: str, loss: Any, device: torch.device, tasks_on_host: int
                 ) -> Iterator[CachedPartition]:
    """:func:`cache_partition` for the length of a task: spill files are removed when it ends, however it ends."""
    budget = memory_budget(tasks_on_host, device) if mode == "auto" else MemoryBudget(0)
    cached = cache_partition(chunks, mode, loss, device, budget)
    try:
        yield cached
    finally:
        cached.close()
