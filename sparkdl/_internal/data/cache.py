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

from sparkdl._internal.data.block import Ragged, RowBlock, is_encoded
from sparkdl._internal.data.partitions import (
    Column,
    EncodedColumn,
    Partition,
    RaggedColumn,
    SpilledColumn,
    SpillFile,
    TensorColumn,
)
from sparkdl._internal.memory import available_memory_bytes
from sparkdl.errors import DataError

#: partition input (Arrow batches or RDD rows) -> its blocks of rows
ChunksFn = Callable[[Iterator[Any]], Iterator[RowBlock]]

#: "auto" keeps a partition in memory up to this fraction of the memory it may use (loading needs ~2x, plus
#: the model, its optimizer and the batches)
MEMORY_FRACTION = 0.25


def targets_for_loss(labels: np.ndarray, loss: Any) -> np.ndarray:
    """Class indices (int64) for cross-entropy, float32 targets otherwise (scalars or vectors alike)."""
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


def _check_same_kinds(block: RowBlock, kinds: Any, rows_before: int) -> None:
    """Every block of a partition must have the first block's inputs, dtypes and row shapes."""
    if block.kinds() != kinds:
        raise DataError(f"rows {rows_before} onwards of the partition have inputs or labels of another shape, dtype "
                        f"or kind ({block.kinds()}) than the rows before ({kinds}); every row needs the same")


class SpillWriter:
    """Appends blocks of rows to a partition's files; :meth:`finish` gives the :class:`Partition` reading them.

    One file per input (dense rows back to back, or a ragged input's elements with its offsets
    kept in memory), plus the labels and weights, read back into memory at the end.  The files
    are unlinked as soon as they are created (and their private 0700 directory removed): nothing
    is left on disk after the task, however it ends, SIGKILL and the OOM killer included.  The
    kernel frees the space when the last descriptor closes.
    """

    def __init__(self, root: str, first: RowBlock) -> None:
        self.kinds = first.kinds()
        self.first = first.take(np.zeros(0, np.int64))    # no rows: holding the block would keep its memory
        self.rows = 0
        self.written_bytes = 0          # the inputs' bytes
        self._ends = [0] * len(first.inputs)     # elements (bytes for encoded rows) written per input
        self._offsets: list[list[np.ndarray]] = [[np.zeros(1, np.int64)] for _ in first.inputs]
        self._files: dict[str, Any] = {}
        names = [f"input{i}" for i in range(len(first.inputs))]
        names += (["labels"] if first.labels is not None else []) + (["weights"] if first.weights is not None else [])
        directory = tempfile.mkdtemp(prefix="sparkdl-partition-", dir=root)   # mode 0700
        try:
            for name in names:
                path = os.path.join(directory, name)
                self._files[name] = open(path, "w+b")
                os.unlink(path)
        except BaseException:
            self.discard()
            raise
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def write(self, block: RowBlock) -> None:
        _check_same_kinds(block, self.kinds, self.rows)
        for i, field in enumerate(block.inputs):
            handle = self._files[f"input{i}"]
            if isinstance(field, Ragged) or is_encoded(field):
                if isinstance(field, Ragged):
                    lengths, values = field.lengths, np.ascontiguousarray(field.values)
                    handle.write(values.data)
                    self.written_bytes += values.nbytes
                else:
                    lengths = np.fromiter((len(row) for row in field), np.int64, len(field))
                    data = b"".join(bytes(row) for row in field)
                    handle.write(data)
                    self.written_bytes += len(data)
                offsets = self._ends[i] + np.cumsum(lengths)
                self._offsets[i].append(offsets)        # 8 bytes a row, held like the labels
                self._ends[i] = int(offsets[-1]) if len(offsets) else self._ends[i]
            else:
                # arrays are written through the buffer protocol: no bytes copy of a block
                rows = np.ascontiguousarray(field)
                handle.write(rows.data)
                self.written_bytes += rows.nbytes
        for name, column in (("labels", block.labels), ("weights", block.weights)):
            if column is not None:
                self._files[name].write(np.ascontiguousarray(column).data)
        self.rows += len(block)

    def _read_back(self, name: str, like: np.ndarray) -> torch.Tensor:
        handle = self._files[name]
        data = os.pread(handle.fileno(), os.fstat(handle.fileno()).st_size, 0)
        return torch.from_numpy(np.frombuffer(data, like.dtype).reshape(self.rows, *like.shape[1:]).copy())

    def finish(self) -> Partition:
        """Flush, read the labels and weights back into memory, and hand over the inputs' files for reading."""
        for handle in self._files.values():
            handle.flush()
        columns: list[Column] = []
        for i, field in enumerate(self.first.inputs):
            handle = self._files[f"input{i}"]
            file = SpillFile(os.dup(handle.fileno()), f"input {i}")
            if isinstance(field, Ragged) or is_encoded(field):
                columns.append(SpilledColumn(file, self.rows, np.dtype(np.uint8) if is_encoded(field) else field.dtype,
                                             offsets=np.concatenate(self._offsets[i]), encoded=is_encoded(field)))
            else:
                columns.append(SpilledColumn(file, self.rows, field.dtype, tuple(field.shape[1:])))
        partition = Partition(tuple(columns),
                              None if self.first.labels is None else self._read_back("labels", self.first.labels),
                              None if self.first.weights is None else self._read_back("weights", self.first.weights))
        self.discard()
        return partition

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
    nbytes: int                # the inputs' bytes

    def close(self) -> None:
        """Free the spill files now rather than when the garbage collector gets to them."""
        self.partition.close()


def _writable(values: np.ndarray) -> torch.Tensor:
    # Arrow-backed arrays are read-only; torch wants writable memory
    return torch.from_numpy(np.require(values, requirements=["W"]))


def in_memory_partition(blocks: list[RowBlock], device: torch.device) -> Partition:
    """Blocks joined into one partition: numbers on ``device``, encoded rows in host memory."""
    if not blocks:
        return Partition((TensorColumn(torch.zeros(0, dtype=torch.float32, device=device)),))
    for k, block in enumerate(blocks[1:], start=1):   # RDD rows are checked block by block; blocks must agree too
        _check_same_kinds(block, blocks[0].kinds(), sum(len(b) for b in blocks[:k]))
    joined = RowBlock.concat(blocks)
    columns: list[Column] = []
    for field in joined.inputs:
        if isinstance(field, Ragged):
            columns.append(RaggedColumn(_writable(field.values).to(device), torch.from_numpy(field.offsets).to(device)))
        elif is_encoded(field):
            columns.append(EncodedColumn(field))
        else:
            columns.append(TensorColumn(_writable(field).to(device)))
    return Partition(tuple(columns), None if joined.labels is None else _writable(joined.labels).to(device),
                     None if joined.weights is None else _writable(joined.weights).to(device))


def cache_partition(chunks: Iterator[RowBlock], mode: str, loss: Any, device: torch.device,
                    budget: MemoryBudget | int, root: str | None = None) -> CachedPartition:
    """Read a partition's chunks into a partition kept as ``mode`` says ("memory", "disk" or "auto").

    Labels become the loss's targets here, chunk by chunk.  An error while reading leaves no
    spill files behind.
    """
    if isinstance(budget, int):
        budget = MemoryBudget(budget)
    held: list[RowBlock] = []
    held_bytes = 0
    writer: SpillWriter | None = None
    try:
        for block in chunks:
            if not len(block):
                continue
            chunk = block if block.labels is None else RowBlock(block.inputs, targets_for_loss(block.labels, loss),
                                                                block.weights)
            if writer is None:
                size = block.nbytes
                encoded = any(is_encoded(field) for field in block.inputs)
                if mode == "memory" or (mode == "auto" and budget.allows(held_bytes + size, encoded)):
                    held.append(chunk)
                    held_bytes += size
                    continue
                writer = SpillWriter(root or spill_root(), held[0] if held else chunk)
                while held:           # popped as written: no earlier chunk stays referenced
                    writer.write(held.pop(0))
                held_bytes = 0
            writer.write(chunk)
            del block, chunk     # written: not held while the next chunk is read (it may share an Arrow batch's memory)
        if writer is None:
            return CachedPartition(in_memory_partition(held, device), "memory", held_bytes)
        return CachedPartition(writer.finish(), "disk", writer.written_bytes)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise


@contextlib.contextmanager
def cached_partition(chunks: Iterator[RowBlock], mode: str, loss: Any, device: torch.device, tasks_on_host: int
                 ) -> Iterator[CachedPartition]:
    """:func:`cache_partition` for the length of a task: spill files are removed when it ends, however it ends."""
    budget = memory_budget(tasks_on_host, device) if mode == "auto" else MemoryBudget(0)
    cached = cache_partition(chunks, mode, loss, device, budget)
    try:
        yield cached
    finally:
        cached.close()
