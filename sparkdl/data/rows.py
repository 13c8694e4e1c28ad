"""RDD partition rows -> numpy feature and label arrays, chunk by chunk."""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import DataError


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
        try:
            x, y = row
        except (TypeError, ValueError):
            shown = " ".join(repr(row).split())     # one line (a numpy repr wraps)
            raise DataError(f"row {i} of the partition is not a (features, label) pair: {shown:.200}") from None
        if x is None or y is None:
            raise DataError(f"row {i} of the partition has a null {'features' if x is None else 'label'}")
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


def row_chunks(rows: Iterable[Any], chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A partition's ``(features, label)`` rows as arrays of at most ``chunk_rows`` rows each."""
    iterator = iter(rows)
    first_row = 0
    while True:
        piece = list(itertools.islice(iterator, chunk_rows))
        if not piece:
            return
        yield rows_to_arrays(piece, first_row)
        first_row += len(piece)


def check_finite(features: np.ndarray, labels: np.ndarray, first_row: int = 0) -> None:
    """Refuse NaN/Inf in features or labels, naming the first offending row of the partition (or partition).

    One vectorized pass over the stacked arrays; a non-finite row would otherwise only show up
    as gradients the parameter server skips, and the run would "succeed" on part of the data.
    """
    finite_rows = np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if not finite_rows.all():
        i = int(np.argmin(finite_rows))
        # one line: the driver reads a task's error from the last line of its traceback
        values = np.array2string(features[i].reshape(-1), threshold=8, edgeitems=3, max_line_width=1 << 30)
        raise DataError(f"row {first_row + i} of the partition has NaN or infinite feature values (as float32) "
                         f"({int((~finite_rows).sum())} such rows among its rows {first_row} to "
                         f"{first_row + len(features) - 1}; row {first_row + i}: {values}); "
                         "drop, clip or impute them before training")
    if labels.dtype.kind in "fc":          # integer and boolean labels are always finite
        finite_labels = np.isfinite(labels.reshape(len(labels), -1)).all(axis=1)
        if not finite_labels.all():
            i = int(np.argmin(finite_labels))
            raise DataError(f"row {first_row + i} of the partition has a NaN or infinite label "
                             f"({labels[i].tolist()!r}; {int((~finite_labels).sum())} such rows among its rows "
                             f"{first_row} to {first_row + len(labels) - 1}); drop or fix them "
                             "before training")
