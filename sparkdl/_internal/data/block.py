"""Typed rows: a block of rows as it leaves Arrow or an RDD, and a mini-batch as the model receives it.

A :class:`RowBlock` holds one *field* per model input, each in its own dtype:

- a numpy array ``[rows, *shape]``: integers as int64, booleans as bool, floating values as
  float32 (a scalar column is ``[rows]``, an array or Vector column ``[rows, length]``);
- a :class:`Ragged` field: rows of varying length (token ids), padded per mini-batch;
- an object array of ``bytes`` rows (encoded images), for a ``batch_transform`` to decode.

A :class:`Batch` is the same rows on the training device: one tensor per input, the mask of
every ragged input (True at real elements), the labels and the per-row weights.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Ragged:
    """Rows of varying length: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``."""

    values: np.ndarray     # every row's elements back to back, in the field's dtype
    offsets: np.ndarray    # int64, rows + 1 entries, starting at 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.offsets.nbytes

    def take(self, index: np.ndarray) -> Ragged:
        """The rows ``index``, in that order."""
        starts, lengths = self.offsets[:-1][index], self.lengths[index]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        # every picked element's position in ``values``: its row's start plus its place in the row
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Ragged(self.values[positions], offsets)

    @staticmethod
    def concat(parts: Sequence[Ragged]) -> Ragged:
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + shift for p, shift in zip(parts, shifts, strict=True)])
        return Ragged(np.concatenate([p.values for p in parts]), offsets.astype(np.int64))


#: one input's rows: dense numbers, ragged numbers, or encoded bytes (an object array)
Field = np.ndarray | Ragged


def is_encoded(field: Field) -> bool:
    return isinstance(field, np.ndarray) and field.dtype == object


def field_nbytes(field: Field) -> int:
    if isinstance(field, np.ndarray) and field.dtype == object:
        return sum(len(row) for row in field.tolist())
    return field.nbytes


def field_kind(field: Field) -> tuple[str, str, tuple[int, ...]]:
    """(kind, dtype, row shape): what a later block's field must match."""
    if isinstance(field, Ragged):
        return "ragged", field.dtype.str, ()
    if is_encoded(field):
        return "encoded", "bytes", ()
    return "dense", field.dtype.str, tuple(field.shape[1:])


def concat_fields(parts: Sequence[Field]) -> Field:
    """The parts joined, rows after rows (every part has the first one's kind)."""
    if len(parts) == 1:
        return parts[0]
    ragged = [p for p in parts if isinstance(p, Ragged)]
    if ragged:
        return Ragged.concat(ragged)
    return np.concatenate([p for p in parts if isinstance(p, np.ndarray)])


def take_field(field: Field, index: np.ndarray) -> Field:
    return field.take(index) if isinstance(field, Ragged) else field[index]


@dataclass(frozen=True)
class RowBlock:
    """Some rows of a partition: one field per model input, the labels and the per-row weights."""

    inputs: tuple[Field, ...]
    labels: np.ndarray | None = None       # None: no labels (scoring)
    weights: np.ndarray | None = None      # float32 [rows]; None: every row weighs 1

    def __len__(self) -> int:
        return len(self.inputs[0])

    @property
    def nbytes(self) -> int:
        """The inputs' bytes (what the cache budgets)."""
        return sum(field_nbytes(field) for field in self.inputs)

    def kinds(self) -> tuple[Any, ...]:
        return (tuple(field_kind(f) for f in self.inputs),
                None if self.labels is None else (self.labels.dtype.str, self.labels.shape[1:]),
                self.weights is not None)

    def take(self, index: np.ndarray) -> RowBlock:
        return RowBlock(tuple(take_field(f, index) for f in self.inputs),
                        None if self.labels is None else self.labels[index],
                        None if self.weights is None else self.weights[index])

    @staticmethod
    def concat(blocks: Sequence[RowBlock]) -> RowBlock:
        if len(blocks) == 1:
            return blocks[0]
        first = blocks[0]
        return RowBlock(tuple(concat_fields([b.inputs[i] for b in blocks]) for i in range(len(first.inputs))),
                        _concat_optional([b.labels for b in blocks]), _concat_optional([b.weights for b in blocks]))


def _concat_optional(parts: list[np.ndarray | None]) -> np.ndarray | None:
    present = [p for p in parts if p is not None]
    return np.concatenate(present) if present else None


@dataclass
class Batch:
    """A mini-batch on the training device, as the model and the loss receive it."""

    #: one entry per input: a tensor (a list of ``bytes`` for encoded rows before the transform)
    inputs: tuple[Any, ...]
    #: per input: a bool tensor [rows, length], True at real elements, for ragged inputs; None for the others
    masks: tuple[torch.Tensor | None, ...]
    labels: torch.Tensor | None
    weights: torch.Tensor | None = None

    def __len__(self) -> int:
        first = self.inputs[0]
        return len(first)

    @property
    def weight_sum(self) -> float:
        """Σ w over the rows (the rows' count without a weight column): the batch's share of a mean."""
        return float(len(self)) if self.weights is None else float(self.weights.sum())
