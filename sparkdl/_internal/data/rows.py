"""RDD partition rows -> typed blocks of rows, chunk by chunk.

A row is ``(features, label)`` or ``(features, label, weight)``.  ``features`` is one input
(a vector: list, numpy array, tensor or pyspark Vector, as float32; or encoded ``bytes``), or a
``tuple`` of inputs, each in its own dtype: a scalar per row (int -> int64, bool, float ->
float32) or a sequence per row (of any length: ragged, padded per mini-batch).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from sparkdl._internal.data.block import Field, Ragged, RowBlock
from sparkdl._internal.data.checks import DataRules, check_block, check_finite
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl.errors import DataError


def _as_vector(value: Any) -> np.ndarray:
    if hasattr(value, "toArray"):          # pyspark.ml.linalg / mllib vectors, dense or sparse
        value = value.toArray()
    elif isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


#: RDD rows converted at a time: bounds the worker's memory while a partition streams in
CHUNK_ROWS = 4096
_ENCODED = (bytes, bytearray, memoryview)


def rows_to_arrays(rows: Iterable[Any], first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Turn ``(features, label)`` rows into a float32 feature matrix and a label vector.

    Features given as ``bytes`` (encoded images) become an object array of bytes rows, for a
    ``batch_transform`` to decode.  ``first_row`` is the partition position of the first row
    (for error messages).
    """
    features: list[Any] = []
    labels: list[Any] = []
    for i, row in enumerate(rows, start=first_row):
        x, y = _pair(row, i)
        if features and isinstance(x, _ENCODED) != isinstance(features[0], bytes):
            raise DataError(f"row {i} mixes encoded bytes and numeric features; every row needs the same kind")
        if isinstance(x, _ENCODED):
            features.append(bytes(x))
            labels.append(y)
            continue
        vec = _as_vector(x)
        if features and vec.shape != features[0].shape:
            raise DataError(f"row {i} has features of shape {vec.shape}, but earlier rows have "
                             f"{features[0].shape}; every row needs the same shape")
        features.append(vec)
        labels.append(y)
    if not features:
        return np.zeros((0,), dtype=np.float32), np.zeros((0,), dtype=np.float32)
    label_array = np.asarray(labels)
    if isinstance(features[0], bytes):
        matrix = np.empty(len(features), dtype=object)
        matrix[:] = features
        check_finite(np.zeros((len(features), 0), np.float32), label_array, first_row)
        return matrix, label_array
    matrix = np.stack(features)
    check_finite(matrix, label_array, first_row)
    return matrix, label_array


def _typed_input(values: list[Any], position: int, first_row: int) -> Field:
    """One input of several (a tuple position across rows) -> its typed field."""
    first = values[0]
    if isinstance(first, _ENCODED):
        rows = np.empty(len(values), dtype=object)
        rows[:] = [bytes(v) for v in values]
        return rows
    if hasattr(first, "toArray"):         # Vectors: float32 rows of one size
        try:
            return np.stack([_as_vector(v) for v in values])
        except ValueError:
            raise DataError(f"input {position} holds Vectors of unequal size in rows {first_row} to "
                            f"{first_row + len(values) - 1}") from None
    arrays = [v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values]
    if any(a.ndim > 1 for a in arrays):
        raise DataError(f"input {position} of rows {first_row} onwards holds arrays of {arrays[0].ndim} dimensions; "
                        "give each row a scalar or a flat sequence")
    if all(a.ndim == 0 for a in arrays):
        return _typed_dtype(np.asarray(arrays), position)
    if any(a.ndim == 0 for a in arrays):
        raise DataError(f"input {position} mixes scalars and sequences in rows {first_row} to "
                        f"{first_row + len(values) - 1}")
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    filled = [a for a in arrays if a.size]
    # empty rows (np.asarray([]) is float64) take the others' dtype; all empty: ids, the usual ragged input
    dtype = np.result_type(*filled) if filled else np.dtype(np.int64)
    flat = np.concatenate([a.astype(dtype, copy=False) for a in arrays])
    return Ragged(_typed_dtype(flat, position), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def _typed_dtype(values: np.ndarray, position: int) -> np.ndarray:
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    if values.dtype.kind == "b":
        return values
    if values.dtype.kind == "f" or (values.size == 0 and values.dtype.kind == "O"):
        return values.astype(np.float32)
    raise DataError(f"input {position} holds {values.dtype} values; inputs must hold numbers or booleans")


def rows_to_block(rows: list[Any], first_row: int = 0, rules: DataRules | None = None) -> RowBlock:
    """``(features, label[, weight])`` rows -> one :class:`RowBlock` (checked: nulls, NaN/Inf, negative ids)."""
    if not rows:
        return RowBlock((np.zeros((0,), dtype=np.float32),), np.zeros((0,), dtype=np.float32))
    width = len(rows[0]) if isinstance(rows[0], (tuple, list)) else 0
    if width == 3:
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, (tuple, list)) or len(row) != 3), None)
        if bad is not None:
            raise DataError(f"row {first_row + bad} of the partition has no weight, but row {first_row} has one: "
                            "give every row (features, label) or every row (features, label, weight)")
        weights = np.asarray([row[2] for row in rows], dtype=np.float64)
        rows = [(row[0], row[1]) for row in rows]
    else:
        weights = None
    if not isinstance(rows[0], (tuple, list)) or not rows[0] or not isinstance(rows[0][0], tuple):
        features, labels = rows_to_arrays(rows, first_row)
        block = RowBlock((features,), labels, None if weights is None else weights.astype(np.float32))
        if weights is not None:
            check_block(block, _RDD_SPEC, DataRules(), first_row)
        return block
    count = len(rows[0][0])
    inputs: list[list[Any]] = [[] for _ in range(count)]
    labels_list: list[Any] = []
    for i, row in enumerate(rows, start=first_row):
        x, y = _pair(row, i)
        if not isinstance(x, tuple) or len(x) != count:
            raise DataError(f"row {i} of the partition has {len(x) if isinstance(x, tuple) else 1} inputs, "
                            f"row {first_row} has {count}; every row needs the same inputs")
        for position, value in enumerate(x):
            if value is None:
                raise DataError(f"row {i} of the partition has a null input {position}")
            inputs[position].append(value)
        labels_list.append(y)
    fields = tuple(_typed_input(values, position, first_row) for position, values in enumerate(inputs))
    spec = ColumnSpec(input_cols=tuple(f"input {k}" for k in range(count)), label_col="label", weight_col="weight")
    block = RowBlock(fields, np.asarray(labels_list), None if weights is None else weights.astype(np.float32))
    check_block(block, spec, rules or DataRules(), first_row)
    return block


def _pair(row: Any, i: int) -> tuple[Any, Any]:
    try:
        x, y = row
    except (TypeError, ValueError):
        shown = " ".join(repr(row).split())     # one line (a numpy repr wraps)
        raise DataError(f"row {i} of the partition is not a (features, label) pair: {shown:.200}") from None
    if x is None or y is None:
        raise DataError(f"row {i} of the partition has a null {'features' if x is None else 'label'}")
    return x, y


def row_chunks(rows: Iterable[Any], chunk_rows: int = CHUNK_ROWS, rules: DataRules | None = None
               ) -> Iterator[RowBlock]:
    """A partition's ``(features, label[, weight])`` rows as blocks of at most ``chunk_rows`` rows each
    (``rules``: the run's bounds, e.g. ``sequence_length``)."""
    iterator = iter(rows)
    first_row = 0
    while True:
        piece = list(itertools.islice(iterator, chunk_rows))
        if not piece:
            return
        yield rows_to_block(piece, first_row, rules)
        first_row += len(piece)



#: the names a one-input RDD row's checks use in their messages
_RDD_SPEC = ColumnSpec(features_col="features", label_col="label", weight_col="weight")
