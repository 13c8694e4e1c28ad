"""A worker's partition and the mini-batches drawn from it: in device memory, in host memory, or on disk.

A :class:`Partition` holds one *column* per model input, each where it fits best:

- :class:`TensorColumn` / :class:`RaggedColumn`: numbers as a tensor on the training device (the
  fastest when the partition fits; a batch is an index into it), ragged rows as their elements
  and offsets, padded per mini-batch to the batch's longest row;
- :class:`EncodedColumn`: encoded rows (image bytes) held in host memory;
- :class:`SpilledColumn`: the rows in a file on executor-local disk, read row by row with
  positional reads, so the worker's resident memory stays at a few batches whatever the
  partition's size (the data stays in the kernel's page cache, which the kernel can drop).

:class:`PartitionBatches` serves an epoch's mini-batches in the loop's order.  For host and disk
columns a background thread reads, transforms (``batch_transform``) and copies the next batches
to the device (pinned memory, on a copy stream: :class:`DeviceCopies`) while the current one trains.
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

from sparkdl._internal.data.block import Batch
from sparkdl.transforms import BatchTransform

#: batches prepared ahead of the one training
PREFETCH_BATCHES = 3


@dataclass(frozen=True)
class Padding:
    """How ragged rows become a rectangle: the pad value, and a fixed length (None: the batch's longest row)."""

    value: float = 0.0
    length: int | None = None

    def width(self, lengths: np.ndarray | torch.Tensor) -> int:
        if self.length is not None:
            return self.length
        return int(lengths.max()) if len(lengths) else 0


#: the pad value 0, to the longest row of each mini-batch
DEFAULT_PADDING = Padding()


class Column(Protocol):
    """One model input's rows."""

    def __len__(self) -> int: ...

    def take(self, index: torch.Tensor, padding: Padding) -> tuple[Any, torch.Tensor | None]:
        """(the rows ``index`` in that order, their mask or None): a tensor, or a list of ``bytes``."""

    def on(self, device: torch.device) -> bool:
        """Whether its rows already live on ``device`` as tensors (no loader thread needed)."""

    def close(self) -> None: ...


@dataclass
class TensorColumn:
    """Rows of one shape and dtype, as one tensor ``[rows, *shape]``."""

    values: torch.Tensor

    def __len__(self) -> int:
        return len(self.values)

    def take(self, index: torch.Tensor, padding: Padding) -> tuple[torch.Tensor, None]:
        return self.values[index.to(self.values.device)], None

    def on(self, device: torch.device) -> bool:
        return self.values.device == device

    def close(self) -> None:
        pass


def pad_rows(values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, padding: Padding
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``values[starts[i]:starts[i] + lengths[i]]`` as ``[rows, width]`` with ``padding``, and their mask."""
    width = padding.width(lengths)
    steps = torch.arange(width, device=values.device)
    mask = steps[None, :] < lengths[:, None]
    if not len(values):
        return torch.full((len(lengths), width), padding.value, dtype=values.dtype, device=values.device), mask
    positions = (starts[:, None] + steps[None, :]).clamp_(max=len(values) - 1)
    return values[positions].masked_fill_(~mask, padding.value), mask


@dataclass
class RaggedColumn:
    """Rows of varying length: their elements back to back and ``offsets`` (rows + 1), on one device."""

    values: torch.Tensor
    offsets: torch.Tensor

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def take(self, index: torch.Tensor, padding: Padding) -> tuple[torch.Tensor, torch.Tensor]:
        index = index.to(self.offsets.device)
        starts = self.offsets[index]
        return pad_rows(self.values, starts, self.offsets[index + 1] - starts, padding)

    def on(self, device: torch.device) -> bool:
        return self.values.device == device

    def close(self) -> None:
        pass


@dataclass
class EncodedColumn:
    """Encoded rows (``bytes``) in host memory: the transform decodes them."""

    rows: np.ndarray    # object array

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, index: torch.Tensor, padding: Padding) -> tuple[list[bytes], None]:
        return list(self.rows[index.cpu().numpy()]), None

    def on(self, device: torch.device) -> bool:
        return False

    def close(self) -> None:
        pass


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


class SpilledColumn:
    """One input's rows in a spill file (written by ``data.cache``), read with positional reads.

    Rows are read one by one with ``pread`` into the batch's own buffer, never through a memory
    map: mapped file pages count in the process's resident memory (whole large folios of them per
    fault), read ones stay in the kernel's page cache only.  Ragged and encoded rows keep their
    ``offsets`` (8 bytes a row) in memory; dense rows sit at ``row * row bytes``.
    """

    def __init__(self, file: SpillFile, rows: int, dtype: np.dtype, row_shape: tuple[int, ...] = (),
                 offsets: np.ndarray | None = None, encoded: bool = False) -> None:
        self.file, self.rows, self.dtype, self.row_shape = file, rows, np.dtype(dtype), row_shape
        self.offsets, self.encoded = offsets, encoded     # offsets: in elements (bytes for encoded rows)
        self._row_bytes = self.dtype.itemsize * int(np.prod(row_shape))

    def __len__(self) -> int:
        return self.rows

    def take(self, index: torch.Tensor, padding: Padding) -> tuple[Any, torch.Tensor | None]:
        picked = index.cpu().numpy().tolist()
        if self.offsets is None:        # dense rows
            out = np.empty((len(picked), *self.row_shape), self.dtype)
            flat = out.reshape(len(picked), -1)
            for j, i in enumerate(picked):
                self.file.read_into(flat[j], i * self._row_bytes)
            return torch.from_numpy(out), None
        starts, ends = self.offsets[picked], self.offsets[np.asarray(picked, np.int64) + 1]
        if self.encoded:
            return [self.file.read(int(e - s), int(s)) for s, e in zip(starts, ends, strict=True)], None
        lengths = ends - starts
        width = padding.width(lengths)
        out = np.full((len(picked), width), padding.value, self.dtype)
        for j, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            if length:
                self.file.read_into(out[j, :length], start * self.dtype.itemsize)
        return torch.from_numpy(out), torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])

    def on(self, device: torch.device) -> bool:
        return False

    def close(self) -> None:
        self.file.close()


@dataclass
class Partition:
    """The rows of one worker's partition: a column per input, the labels and weights; ``selection`` picks rows."""

    columns: tuple[Column, ...]
    labels: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    selection: torch.Tensor | None = None     # CPU int64: the rows of the columns this partition holds

    @property
    def rows(self) -> int:
        return len(self.columns[0]) if self.selection is None else len(self.selection)

    @property
    def has_labels(self) -> bool:
        """The rows hold labels (training) or not (scoring)."""
        return self.labels is not None

    def on(self, device: torch.device) -> bool:
        return all(column.on(device) for column in self.columns)

    def gather(self, index: torch.Tensor, padding: Padding = DEFAULT_PADDING) -> Batch:
        """The rows ``index`` (a 1-D int64 tensor), in that order: inputs as the columns hold them."""
        if self.selection is not None:
            index = self.selection[index.cpu()]
        inputs: tuple[Any, ...]
        masks: tuple[torch.Tensor | None, ...]
        if len(self.columns) == 1:       # one input: no per-input lists to build (the hot path)
            values, mask = self.columns[0].take(index, padding)
            inputs, masks = (values,), (mask,)
        else:
            taken = [column.take(index, padding) for column in self.columns]
            inputs, masks = tuple(t[0] for t in taken), tuple(t[1] for t in taken)

        def rows_of(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[index.to(values.device)]

        return Batch(inputs, masks, rows_of(self.labels), rows_of(self.weights))

    def subset(self, rows: torch.Tensor) -> Partition:
        """The partition restricted to ``rows`` (sorted indices): an index, not a copy of the rows."""
        rows = rows.cpu()
        return Partition(self.columns, self.labels, self.weights,
                         rows if self.selection is None else self.selection[rows])

    def close(self) -> None:
        """Free the spill files now rather than when the garbage collector gets to them."""
        for column in self.columns:
            column.close()


def batch_seed(seed: int, worker: int, epoch: int, step: int) -> int:
    """The transform's seed for one mini-batch: the same on a retried task as in an undisturbed run.

    Mixed into 64 bits (``torch.Generator.manual_seed``'s range) whatever the seed's size.
    """
    return int(np.random.SeedSequence([seed & (2**64 - 1), worker, epoch, step]).generate_state(1, np.uint64)[0])


class PartitionBatches:
    """Mini-batches of a partition on the training device, with the optional ``batch_transform`` applied.

    A one-input transform receives that input (a tensor, or a list of ``bytes``) and returns a
    tensor; with several inputs it receives their tuple and returns a tensor or a tuple of them
    (the masks of ragged inputs pass through when it returns as many inputs as it received).
    """

    def __init__(self, partition: Partition, device: torch.device, transform: BatchTransform | None = None,
                 seed: int = 0, worker: int = 0, padding: Padding = DEFAULT_PADDING) -> None:
        self.partition = partition
        self.device = device
        self.transform = transform
        self.seed = seed
        self.worker = worker
        self.padding = padding

    @property
    def rows(self) -> int:
        return self.partition.rows

    @property
    def has_labels(self) -> bool:
        return self.partition.has_labels

    def subset(self, rows: torch.Tensor) -> PartitionBatches:
        return PartitionBatches(self.partition.subset(rows), self.device, self.transform, self.seed, self.worker,
                                self.padding)

    def _prepare(self, index: torch.Tensor, generator: torch.Generator | None) -> Batch:
        batch = self.partition.gather(index, self.padding)
        inputs, masks = batch.inputs, batch.masks
        if self.transform is not None:
            inputs, masks = transformed(self.transform, inputs, masks, generator)
        elif not all(isinstance(value, torch.Tensor) for value in inputs):
            raise ValueError("the features are encoded bytes: set batch_transform to decode them")
        return Batch(tuple(inputs), tuple(masks), batch.labels, batch.weights)

    def batches(self, indices: Sequence[torch.Tensor], epoch: int | None, first_step: int = 0
                ) -> Generator[Batch, None, None]:
        """The batches of ``indices`` in order; ``epoch`` None: evaluation (the transform's random parts off).

        ``first_step`` is the step number of ``indices[0]`` in its epoch (seeds the transform).
        """
        def prepare(k: int) -> Batch:
            generator = None
            if self.transform is not None and epoch is not None:
                generator = torch.Generator().manual_seed(batch_seed(self.seed, self.worker, epoch, first_step + k))
            return self._prepare(indices[k], generator)

        if self.partition.on(self.device) and self.transform is None:
            # already on the device: an index per batch, nothing to overlap
            for k in range(len(indices)):
                yield prepare(k)
            return
        if self.device.type != "cuda":
            yield from run_ahead(prepare(k) for k in range(len(indices)))
            return
        copies = DeviceCopies(self.device)
        for moved in run_ahead(copies.send(prepare(k)) for k in range(len(indices))):
            yield copies.receive(*moved)


def transformed(transform: BatchTransform, inputs: tuple[Any, ...], masks: tuple[torch.Tensor | None, ...],
                generator: torch.Generator | None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """The transform applied to a batch's inputs (see :class:`PartitionBatches`): the model's inputs and masks."""
    out = transform(inputs[0] if len(inputs) == 1 else inputs, generator)
    values = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    bad = [type(v).__name__ for v in values if not isinstance(v, torch.Tensor)]
    if bad or not values:
        raise TypeError(f"batch_transform must return a torch.Tensor or a tuple of them, got {type(out).__name__}"
                        + (f" holding {bad}" if bad and isinstance(out, (tuple, list)) else ""))
    return values, masks if len(values) == len(masks) else (None,) * len(values)


class DeviceCopies:
    """Host batches copied to a CUDA device on a stream of their own, so that the next batch's copy overlaps the
    current batch's kernels (on the compute stream, a copy would wait for them and they for it).

    :meth:`send` runs on the loader's thread: the batch is pinned, copied without blocking on the copy stream,
    and an event marks the copy's end.  :meth:`receive` runs on the training thread: its stream waits for that
    event on the device (the host does not), and each tensor is recorded as used by that stream, so the
    caching allocator never hands its memory to the copy stream while the compute stream still reads it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def send(self, batch: Batch) -> tuple[Batch, torch.cuda.Event]:
        # the current device is per thread: the loader's would otherwise be GPU 0 (a context there)
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            moved = _map_tensors(batch, lambda t: t if t.device == self.device
                                 else t.pin_memory().to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return moved, copied

    def receive(self, batch: Batch, copied: torch.cuda.Event) -> Batch:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)

        def used_by_compute(tensor: torch.Tensor) -> torch.Tensor:
            tensor.record_stream(compute)
            return tensor

        return _map_tensors(batch, used_by_compute)


def _map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    return Batch(tuple(fn(value) for value in batch.inputs),
                 tuple(None if mask is None else fn(mask) for mask in batch.masks),
                 None if batch.labels is None else fn(batch.labels),
                 None if batch.weights is None else fn(batch.weights))


_DONE = object()


def run_ahead(items: Iterator[Any], depth: int = PREFETCH_BATCHES) -> Iterator[Any]:
    """``items`` produced by a background thread up to ``depth`` ahead of the consumer, yielded in order.

    An exception in the thread is raised here, at the item it belongs to; leaving the
    iterator early stops the thread.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
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
            for item in items:
                if not offer((item, None)):
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
