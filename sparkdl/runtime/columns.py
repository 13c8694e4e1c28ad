"""DataFrame columns -> training arrays: validation on the driver, Arrow conversion on executors.

Feature columns may be ``array<float|double|int...>``, ``pyspark.ml.linalg.Vector`` (dense or
sparse), or several numeric columns; labels integer or floating.  Arrow buffers become numpy
arrays without per-row Python objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa


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


# ---------------------------------------------------------------------------- executor side
def _list_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    if array.null_count:
        raise ValueError(f"column {name!r} has {array.null_count} null rows")
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), width)
    lengths = array.value_lengths().to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"column {name!r} holds arrays of unequal length "
                         f"({int(lengths.min())} to {int(lengths.max())}); every row needs the same length")
    values = array.flatten()
    if values.null_count:
        raise ValueError(f"column {name!r} has null elements inside its arrays")
    width = int(lengths[0]) if len(lengths) else 0
    return values.to_numpy(zero_copy_only=False).reshape(len(array), width)


def _vector_to_matrix(array: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML vectors (struct<type, size, indices, values>) -> dense rows."""
    if array.null_count:
        raise ValueError(f"column {name!r} has {array.null_count} null rows")
    kind = array.field("type").to_numpy(zero_copy_only=False)
    values = array.field("values")
    value_lengths = values.value_lengths().to_numpy(zero_copy_only=False)
    sizes = array.field("size").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    dense = kind == 1
    widths = np.where(dense, value_lengths, sizes)
    if len(widths) and (widths != widths[0]).any():
        raise ValueError(f"column {name!r} holds vectors of unequal size "
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


def column_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    """One Arrow feature column -> a 2-D float32 matrix (rows x width)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        matrix = _list_to_matrix(array, name)
    elif pa.types.is_struct(kind) and {f.name for f in kind} >= {"type", "size", "indices", "values"}:
        matrix = _vector_to_matrix(array, name)
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        if array.null_count:
            raise ValueError(f"column {name!r} has {array.null_count} null rows")
        matrix = array.to_numpy(zero_copy_only=False).reshape(-1, 1)
    else:
        raise ValueError(f"column {name!r} has the unsupported Arrow type {kind}")
    return matrix.astype(np.float32, copy=False)


def arrow_to_arrays(batches: Iterable[pa.RecordBatch], spec: ColumnSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """All of a partition's Arrow batches -> (features [n, *shape] float32, labels [n] or None)."""
    batch_list = [b for b in batches if b.num_rows]
    if not batch_list:
        width = int(np.prod(spec.features_shape)) if spec.features_shape else 0
        return np.zeros((0, *(spec.features_shape or (width,))), np.float32), np.zeros(0)
    table = pa.Table.from_batches(batch_list)
    parts = [column_to_matrix(table.column(name), name) for name in spec.input_columns]
    features = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    if spec.features_shape:
        expected = int(np.prod(spec.features_shape))
        if features.shape[1] != expected:
            raise ValueError(f"featuresShape {list(spec.features_shape)} needs {expected} values per row, "
                             f"the features have {features.shape[1]}")
        features = features.reshape(len(features), *spec.features_shape)
    labels = None
    if spec.label_col:
        label = table.column(spec.label_col).combine_chunks()
        if label.null_count:
            raise ValueError(f"column {spec.label_col!r} has {label.null_count} null labels")
        labels = label.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(features), labels


# ---------------------------------------------------------------------------- driver side
def validate_columns(df, spec: ColumnSpec) -> None:
    """Schema checks only (no Spark job): the columns exist and have supported types."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    for name in spec.columns:
        if name not in fields:
            raise ValueError(f"column {name!r} not found in the DataFrame; its columns are {sorted(fields)}")
    numeric = (T.NumericType, T.BooleanType)
    for name in spec.input_columns:
        kind = fields[name]
        if isinstance(kind, T.ArrayType):
            if not isinstance(kind.elementType, T.NumericType):
                raise ValueError(f"column {name!r} is {kind.simpleString()}; feature arrays must hold numbers")
        elif isinstance(kind, numeric):
            if not spec.features_cols:
                raise ValueError(f"column {name!r} is a single number; use featuresCols=[...] to assemble "
                                 "numeric columns, or a VectorAssembler")
        elif not isinstance(kind, VectorUDT):
            raise ValueError(f"column {name!r} has the unsupported type {kind.simpleString()}; use "
                             "array<float|double>, a pyspark.ml Vector, or numeric columns (featuresCols)")
    if spec.label_col and not isinstance(fields[spec.label_col], numeric):
        raise ValueError(f"label column {spec.label_col!r} is {fields[spec.label_col].simpleString()}; "
                         "labels must be numeric")


@dataclass(frozen=True)
class DataStats:
    """What one aggregation over the training data found."""

    rows: int
    width: int                        # feature values per row
    label_min: float | None = None
    label_max: float | None = None
    fractional_labels: int = 0


def validate_dataframe(df, spec: ColumnSpec) -> DataStats:
    """Check columns, types, nulls and lengths with one Spark aggregation (no barrier stage).

    Raises ``ValueError`` naming the column and the problem.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    validate_columns(df, spec)
    fields = {f.name: f.dataType for f in df.schema.fields}
    checks = []
    for name in spec.input_columns:
        kind = fields[name]
        column = F.col(f"`{name}`")
        if isinstance(kind, T.ArrayType):
            size = F.size(column)
            checks.append(F.sum(F.when(F.exists(column, lambda v: v.isNull()), 1).otherwise(0))
                          .alias(f"{name}|null_elements"))
        elif isinstance(kind, VectorUDT):
            size = F.size(vector_to_array(column))
        else:
            size = F.lit(1)
        checks += [F.sum(F.when(column.isNull(), 1).otherwise(0)).alias(f"{name}|nulls"),
                   F.min(size).alias(f"{name}|min_size"), F.max(size).alias(f"{name}|max_size")]
    if spec.label_col:
        label = F.col(f"`{spec.label_col}`").cast("double")
        checks += [F.sum(F.when(label.isNull() | F.isnan(label), 1).otherwise(0)).alias("@label|nulls"),
                   F.min(label).alias("@label|min"), F.max(label).alias("@label|max"),
                   F.sum(F.when(label != F.floor(label), 1).otherwise(0)).alias("@label|fractional")]
    row = df.agg(*checks, F.count(F.lit(1)).alias("@rows")).collect()[0].asDict()
    if row["@rows"] == 0:
        raise ValueError("the DataFrame is empty; there is nothing to train on")
    width = 0
    for name in spec.input_columns:
        if row[f"{name}|nulls"]:
            raise ValueError(f"column {name!r} has {row[f'{name}|nulls']} null rows; drop or fill them "
                             f"(e.g. df.na.drop(subset=[{name!r}]))")
        if row.get(f"{name}|null_elements"):
            raise ValueError(f"column {name!r} has {row[f'{name}|null_elements']} arrays with null elements; "
                             "fill them first")
        low, high = row[f"{name}|min_size"], row[f"{name}|max_size"]
        if low != high:
            raise ValueError(f"column {name!r} holds arrays of unequal length ({low} to {high}); every row "
                             "needs the same length")
        width += int(low)
    if spec.features_shape and int(np.prod(spec.features_shape)) != width:
        raise ValueError(f"featuresShape {list(spec.features_shape)} needs {int(np.prod(spec.features_shape))} "
                         f"values per row, but the features have {width}")
    if not spec.label_col:
        return DataStats(row["@rows"], width)
    if row["@label|nulls"]:
        raise ValueError(f"label column {spec.label_col!r} has {row['@label|nulls']} null/NaN rows; drop them")
    return DataStats(row["@rows"], width, row["@label|min"], row["@label|max"], row["@label|fractional"])


def check_class_labels(stats: DataStats, label_col: str, num_classes: int) -> None:
    """Class labels must be integers in [0, num_classes)."""
    if stats.fractional_labels:
        raise ValueError(f"label column {label_col!r} has {stats.fractional_labels} non-integer values; class "
                         f"labels must be integers in [0, {num_classes})")
    if stats.label_min is not None and (stats.label_min < 0 or stats.label_max >= num_classes):
        raise ValueError(f"label column {label_col!r} has values in [{stats.label_min:g}, {stats.label_max:g}], "
                         f"outside [0, {num_classes}) for a model with {num_classes} outputs")
