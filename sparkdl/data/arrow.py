"""Arrow columns -> training arrays, on the executors: which columns hold what, conversion, row checks.

Feature columns may be ``array<float|double|int...>``, ``pyspark.ml.linalg.Vector`` (dense or
sparse), several numeric columns, or one ``binary`` column of encoded rows (PNG/JPEG bytes as
Spark's image and binary-file readers give them, decoded by a ``batch_transform``); labels
integer or floating.  Numeric Arrow buffers become numpy arrays without per-row Python objects.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DataError
from .rows import check_finite


@dataclass(frozen=True)
class ColumnSpec:
    """Which columns hold the features and the label, and how to shape a feature row."""

    features_col: str | None = "features"
    features_cols: tuple[str, ...] = ()
    label_col: str | None = "label"
    features_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.features_col and not self.features_cols:
            raise ValueError("set featuresCol or featuresCols")
        if self.features_shape is not None and any(int(d) < 1 for d in self.features_shape):
            raise ValueError(f"featuresShape must hold positive sizes, got {list(self.features_shape)}")

    @property
    def input_columns(self) -> list[str]:
        return list(self.features_cols) if self.features_cols else [self.features_col]  # type: ignore[list-item]

    @property
    def columns(self) -> list[str]:
        return self.input_columns + ([self.label_col] if self.label_col else [])


def _list_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), width)
    lengths = array.value_lengths().to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        raise DataError(f"column {name!r} holds arrays of unequal length "
                         f"({int(lengths.min())} to {int(lengths.max())}); every row needs the same length")
    values = array.flatten()
    if values.null_count:
        raise DataError(f"column {name!r} has null elements inside its arrays")
    width = int(lengths[0]) if len(lengths) else 0
    return values.to_numpy(zero_copy_only=False).reshape(len(array), width)


def _vector_to_matrix(array: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML vectors (struct<type, size, indices, values>) -> dense rows."""
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    kind = array.field("type").to_numpy(zero_copy_only=False)
    values = array.field("values")
    value_lengths = values.value_lengths().to_numpy(zero_copy_only=False)
    sizes = array.field("size").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    dense = kind == 1
    widths = np.where(dense, value_lengths, sizes)
    if len(widths) and (widths != widths[0]).any():
        raise DataError(f"column {name!r} holds vectors of unequal size "
                         f"({int(widths.min())} to {int(widths.max())}); every row needs the same size")
    n, width = len(array), int(widths[0]) if len(widths) else 0
    flat_values = values.flatten().to_numpy(zero_copy_only=False)
    value_rows = np.repeat(np.arange(n), value_lengths)
    out = np.zeros((n, width), dtype=np.float64)
    if dense.all():
        return flat_values.reshape(n, width)
    # dense rows: positions 0..len-1; sparse rows: their indices
    positions = np.empty(len(flat_values), dtype=np.int64)
    dense_entries = dense[value_rows]
    starts = np.concatenate([[0], np.cumsum(value_lengths)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    positions[dense_entries] = (np.arange(len(flat_values)) - starts[value_rows])[dense_entries]
    indices = array.field("indices")
    index_lengths = indices.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    flat_indices = indices.flatten().to_numpy(zero_copy_only=False)
    sparse_entries = ~dense_entries
    # indices of sparse rows appear in the same order as their values
    index_rows = np.repeat(np.arange(n), index_lengths)
    positions[sparse_entries] = flat_indices[~dense[index_rows]] if len(flat_indices) else []
    out[value_rows, positions] = flat_values
    return out


def _binary_rows(array: pa.Array, name: str) -> np.ndarray:
    """A binary column -> an object array of ``bytes`` rows."""
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    rows = np.empty(len(array), dtype=object)
    rows[:] = array.to_pylist()
    return rows


def is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def column_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    """One Arrow feature column -> a 2-D float32 matrix (rows x width), or encoded rows for a binary column."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    kind = array.type
    if is_binary(kind):
        return _binary_rows(array, name)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        matrix = _list_to_matrix(array, name)
    elif pa.types.is_struct(kind) and {f.name for f in kind} >= {"type", "size", "indices", "values"}:
        matrix = _vector_to_matrix(array, name)
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        if array.null_count:
            raise DataError(f"column {name!r} has {array.null_count} null rows")
        matrix = array.to_numpy(zero_copy_only=False).reshape(-1, 1)
    else:
        raise DataError(f"column {name!r} has the unsupported Arrow type {kind}")
    with np.errstate(over="ignore"):    # beyond float32: inf, which the finiteness checks refuse
        return matrix.astype(np.float32, copy=False)


def null_feature_rows(batch: pa.RecordBatch, spec: ColumnSpec) -> np.ndarray:
    """A boolean mask of the rows whose features are null or hold null elements (in arrays)."""
    mask = np.zeros(batch.num_rows, dtype=bool)
    for name in spec.input_columns:
        column = batch.column(name)
        if column.null_count:
            mask |= column.is_null().to_numpy(zero_copy_only=False)
        kind = column.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            values = column.flatten()     # the values of the non-null rows, in order
            if values.null_count:
                lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
                parents = np.repeat(np.arange(len(column)), lengths)
                mask[parents[values.is_null().to_numpy(zero_copy_only=False)]] = True
    return mask


@dataclass(frozen=True)
class DataRules:
    """What the driver learned from the first row and the model, for every task to check its rows against.

    The tasks check their partitions while loading them, before any update: the driver need not scan
    the data first (one Spark job fewer per fit).
    """

    width: int | None = None        # feature values per row
    classes: int | None = None      # a classifier's labels: integers in [0, classes)


def arrow_to_arrays(batches: Iterable[pa.RecordBatch], spec: ColumnSpec, rules: DataRules | None = None,
                    first_row: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """All of a partition's Arrow batches -> (features [n, *shape] float32, labels [n] or None).

    With ``rules`` the rows are checked as well: NaN/Inf, the width, the class labels
    (``first_row``: the partition position of the first row, for the messages).
    """
    batch_list = [b for b in batches if b.num_rows]
    if not batch_list:
        width = int(np.prod(spec.features_shape)) if spec.features_shape else 0
        return np.zeros((0, *(spec.features_shape or (width,))), np.float32), np.zeros(0)
    table = pa.Table.from_batches(batch_list)
    parts = [column_to_matrix(table.column(name), name) for name in spec.input_columns]
    features = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    labels = _labels(table, spec)
    if rules is not None:
        _check_rows(features, labels, rules, first_row)
    if features.dtype == object:        # encoded rows: their shape is the batch transform's business
        return features, labels
    if spec.features_shape:
        expected = int(np.prod(spec.features_shape))
        if features.shape[1] != expected:
            raise DataError(f"featuresShape {list(spec.features_shape)} needs {expected} values per row, "
                             f"the features have {features.shape[1]}")
        features = features.reshape(len(features), *spec.features_shape)
    return np.ascontiguousarray(features), labels


def _check_rows(features: np.ndarray, labels: np.ndarray | None, rules: DataRules, first_row: int) -> None:
    numeric = features.dtype != object
    if numeric and rules.width is not None and features.shape[1] != rules.width:
        raise DataError(f"rows {first_row} to {first_row + len(features) - 1} of the partition have {features.shape[1]} "
                        f"feature values, the first row of the data has {rules.width}")
    check_finite(features if numeric else np.zeros((len(features), 0), np.float32),
                 labels if labels is not None else np.zeros(0), first_row)
    if labels is not None and rules.classes is not None:
        check_class_labels_of(labels, rules.classes, first_row)


def check_class_labels_of(labels: np.ndarray, classes: int, first_row: int = 0) -> None:
    """A classifier's labels must be integers in [0, classes): they index the model's outputs."""
    values = labels.reshape(len(labels), -1)[:, 0].astype(np.float64, copy=False)
    bad = (values != np.floor(values)) | (values < 0) | (values >= classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"row {first_row + i} of the partition has the label {values[i]:g} ({int(bad.sum())} such rows); "
                        f"class labels must be integers in [0, {classes})")


def _labels(table: pa.Table, spec: ColumnSpec) -> np.ndarray | None:
    if not spec.label_col:
        return None
    label = table.column(spec.label_col).combine_chunks()
    if label.null_count:
        raise DataError(f"column {spec.label_col!r} has {label.null_count} null labels")
    return label.to_numpy(zero_copy_only=False)


def arrow_chunks(batches: Iterable[pa.RecordBatch], spec: ColumnSpec, rules: DataRules | None = None
                 ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """A partition's Arrow batches as (features, labels) arrays, one batch at a time (checked with ``rules``)."""
    first_row = 0
    for batch in batches:
        if batch.num_rows:
            yield arrow_to_arrays([batch], spec, rules, first_row)
            first_row += batch.num_rows
