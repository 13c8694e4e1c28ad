"""A worker's partition and the mini-batches drawn from it: in device memory, in host memory, or on disk.

Three places a partition can live, one interface (:class:`Partition`):

- :class:`DevicePartition`: numeric features as one tensor on the training device (the fastest
  when the partition fits; a batch is an index into it);
- :class:`HostPartition`: rows that cannot be one tensor (encoded image bytes) held in host memory;
- :class:`DiskPartition`: the rows in files on executor-local disk, read row by row with positional
  reads, so the worker's resident memory stays at a few batches whatever the partition's size (the
  data stays in the kernel's page cache, which the kernel can drop).

:class:`PartitionBatches` serves an epoch's mini-batches in the loop's order.  For host and disk
partitions a background thread reads, transforms (``batch_transform``) and copies the next batches
to the device (pinned memory, non-blocking) while the current one trains.
"""
from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..transforms import BatchTransform

#: a batch of features before the transform: a tensor, or the encoded rows of a binary column
RawFeatures = Any

#: batches prepared ahead of the one training
PREFETCH_BATCHES = 3


class Partition(Protocol):
    """The rows of one worker's partition."""

    @property
    def rows(self) -> int: ...

    @property
    def has_labels(self) -> bool:
        """The rows hold labels (training) or not (scoring)."""

    def gather(self, index: torch.Tensor) -> tuple[RawFeatures, torch.Tensor | None]:
        """Features and labels of the rows ``index`` (a 1-D int64 tensor), in that order."""

    def subset(self, rows: torch.Tensor) -> Partition:
        """The partition restricted to ``rows`` (sorted indices)."""


@dataclass
class DevicePartition:
    """Numeric rows as tensors on the training device; ``selection`` (on the device) picks a subset."""

    features: torch.Tensor
    labels: torch.Tensor | None
    selection: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.features) if self.selection is None else len(self.selection)

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        index = index.to(self.features.device)
        if self.selection is not None:
            index = self.selection[index]
        return self.features[index], None if self.labels is None else self.labels[index]

    def subset(self, rows: torch.Tensor) -> DevicePartition:
        # an index, not a copy: a hold-out split must not double the partition in device memory
        rows = rows.to(self.features.device)
        return DevicePartition(self.features, self.labels, rows if self.selection is None else self.selection[rows])


@dataclass
class HostPartition:
    """Rows in host memory: a numpy matrix, or an object array of encoded ``bytes`` rows."""

    features: np.ndarray
    labels: np.ndarray | None

    @property
    def rows(self) -> int:
        return len(self.features)

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    def gather(self, index: torch.Tensor) -> tuple[RawFeatures, torch.Tensor | None]:
        picked = index.cpu().numpy()
        rows = self.features[picked]
        features = list(rows) if rows.dtype == object else torch.from_numpy(rows)
        return features, None if self.labels is None else torch.from_numpy(self.labels[picked])

    def subset(self, rows: torch.Tensor) -> HostPartition:
        picked = rows.cpu().numpy()
        return HostPartition(self.features[picked], None if self.labels is None else self.labels[picked])


class SpillFile:
    """An open, already unlinked file read with positional reads (thread-safe).

    The spill files have no name from the moment they are created, so the kernel frees their
    space when the last descriptor closes: when the partition is closed, or when the process dies,
    SIGKILL included.
    """

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self._closer = weakref.finalize(self, os.close, fd)
        if hasattr(os, "posix_fadvise"):     # rows are read in shuffled order: no readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read_into(self, buffer: np.ndarray, offset: int) -> None:
        if os.preadv(self.fd, [buffer],  # type: ignore[list-item]  # numpy#26783: no __buffer__ <3.12
                     offset) != buffer.nbytes:
            raise OSError(f"the spilled partition's {self.name} file is shorter than expected")

    def read(self, size: int, offset: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise OSError(f"the spilled partition's {self.name} file is shorter than expected")
        return data

    def close(self) -> None:
        self._closer()


@dataclass(frozen=True)
class SpillLayout:
    """A spilled partition (written by ``data.cache``): its rows' file and what is held in memory."""

    rows: int
    #: float32 features: the shape of one row; None for encoded (binary) rows
    row_shape: tuple[int, ...] | None
    #: the features (float32 rows back to back) or the encoded rows' bytes
    values: SpillFile
    #: encoded rows: where row i's bytes start (rows + 1 entries); None for float rows
    offsets: np.ndarray | None
    labels: np.ndarray | None        # None: no labels


class DiskPartition:
    """Rows read from a :class:`SpillLayout` with positional reads; ``rows`` may select a subset.

    Features are read row by row with ``pread`` into the batch's own buffer, never through a
    memory map: mapped file pages count in the process's resident memory (whole large folios of
    them per fault), read ones stay in the kernel's page cache only.  The labels (and, for
    encoded rows, their offsets) are small next to the features and are held in memory.
    """

    def __init__(self, layout: SpillLayout, rows: np.ndarray | None = None) -> None:
        self.layout = layout
        self._selection = rows
        self._row_bytes = 4 * int(np.prod(layout.row_shape)) if layout.row_shape is not None else 0

    @property
    def rows(self) -> int:
        return self.layout.rows if self._selection is None else len(self._selection)

    @property
    def has_labels(self) -> bool:
        return self.layout.labels is not None

    def gather(self, index: torch.Tensor) -> tuple[RawFeatures, torch.Tensor | None]:
        picked = index.cpu().numpy()
        if self._selection is not None:
            picked = self._selection[picked]
        layout = self.layout
        if layout.offsets is None:
            assert layout.row_shape is not None   # float rows (no offsets) always have a row shape
            out = np.empty((len(picked), *layout.row_shape), np.float32)
            rows = out.reshape(len(picked), -1)
            for j, i in enumerate(picked.tolist()):
                layout.values.read_into(rows[j], i * self._row_bytes)
            features: RawFeatures = torch.from_numpy(out)
        else:
            starts, ends = layout.offsets[picked].tolist(), layout.offsets[picked + 1].tolist()
            features = [layout.values.read(end - start, start) for start, end in zip(starts, ends, strict=True)]
        return features, None if layout.labels is None else torch.from_numpy(layout.labels[picked])

    def subset(self, rows: torch.Tensor) -> DiskPartition:
        picked = rows.cpu().numpy()
        return DiskPartition(self.layout, picked if self._selection is None else self._selection[picked])


def batch_seed(seed: int, worker: int, epoch: int, step: int) -> int:
    """The transform's seed for one mini-batch: the same on a retried task as in an undisturbed run.

    Mixed into 64 bits (``torch.Generator.manual_seed``'s range) whatever the seed's size.
    """
    return int(np.random.SeedSequence([seed & (2**64 - 1), worker, epoch, step]).generate_state(1, np.uint64)[0])


class PartitionBatches:
    """Mini-batches of a partition on the training device, with the optional ``batch_transform`` applied."""

    def __init__(self, partition: Partition, device: torch.device, transform: BatchTransform | None = None,
                 seed: int = 0, worker: int = 0) -> None:
        self.partition = partition
        self.device = device
        self.transform = transform
        self.seed = seed
        self.worker = worker

    @property
    def rows(self) -> int:
        return self.partition.rows

    @property
    def has_labels(self) -> bool:
        return self.partition.has_labels

    def subset(self, rows: torch.Tensor) -> PartitionBatches:
        return PartitionBatches(self.partition.subset(rows), self.device, self.transform, self.seed, self.worker)

    def _prepare(self, index: torch.Tensor, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        features, labels = self.partition.gather(index)
        if self.transform is not None:
            features = self.transform(features, generator)
            if not isinstance(features, torch.Tensor):
                raise TypeError(f"batch_transform must return a torch.Tensor, got {type(features).__name__}")
        elif not isinstance(features, torch.Tensor):
            raise ValueError("the features are encoded bytes: set batch_transform to decode them")
        return _to_device(features, self.device), None if labels is None else _to_device(labels, self.device)

    def batches(self, indices: Sequence[torch.Tensor], epoch: int | None, first_step: int = 0
                ) -> Generator[tuple[torch.Tensor, torch.Tensor | None], None, None]:
        """The batches of ``indices`` in order; ``epoch`` None: evaluation (the transform's random parts off).

        ``first_step`` is the step number of ``indices[0]`` in its epoch (seeds the transform).
        """
        def prepare(k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            generator = None
            if self.transform is not None and epoch is not None:
                generator = torch.Generator().manual_seed(batch_seed(self.seed, self.worker, epoch, first_step + k))
            return self._prepare(indices[k], generator)

        if isinstance(self.partition, DevicePartition) and self.transform is None:
            # already on the device: an index per batch, nothing to overlap
            for k in range(len(indices)):
                yield prepare(k)
            return
        yield from _prefetched(prepare, len(indices))


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


_DONE = object()


def _prefetched(prepare: Callable[[int], Any], count: int) -> Iterator[Any]:
    """``prepare(0..count-1)`` run ahead in a background thread, yielded in order.

    An exception in the thread is raised here, at the batch it belongs to; leaving the
    iterator early stops the thread.
    """
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH_BATCHES)
    stop = threading.Event()

    def offer(item: Any) -> bool:
        """Queue ``item`` unless the consumer has left; False when it has."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for k in range(count):
                if not offer((prepare(k), None)):
                    return
        except BaseException as exc:      # handed to the consumer with its traceback
            offer((None, exc))
            return
        offer((_DONE, None))

    thread = threading.Thread(target=produce, name="sparkdl-batches", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
