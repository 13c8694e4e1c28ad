"""Arrow columns -> typed blocks of rows, on the executors: which columns hold what, conversion, row checks.

Two ways to name the model's inputs:

- ``featuresCol`` / ``featuresCols``: one float32 input, the columns glued into one row
  (``array<float|double|int...>``, ``pyspark.ml.linalg.Vector`` dense or sparse, numeric
  columns, or one ``binary`` column of encoded rows decoded by a ``batch_transform``);
- ``inputCols``: one input per column, in its own dtype (see :mod:`sparkdl._internal.data.block`):
  integers as int64 exactly, booleans as bool, floating values and Vectors as float32; a
  scalar column as ``[rows]``, an array column as ragged rows, padded per mini-batch.

Labels are integer or floating scalars, arrays or Vectors (multi-label, multi-output); an
optional weight column gives every row its weight.  Numeric Arrow buffers become numpy
arrays without per-row Python objects.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl._internal.data.block import Field, Ragged, RowBlock
from sparkdl._internal.data.checks import DataRules, check_block
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl.errors import DataError

#: Arrow's fixed-width number types and their numpy dtypes (``DataType.to_pandas_dtype`` imports pandas
#: in older pyarrow)
_NUMPY_DTYPES: dict[int, np.dtype] = {kind.id: np.dtype(dtype) for kind, dtype in (
    (pa.int8(), np.int8), (pa.int16(), np.int16), (pa.int32(), np.int32), (pa.int64(), np.int64),
    (pa.uint8(), np.uint8), (pa.uint16(), np.uint16), (pa.uint32(), np.uint32), (pa.uint64(), np.uint64),
    (pa.float16(), np.float16), (pa.float32(), np.float32), (pa.float64(), np.float64))}


def _numbers(array: pa.Array) -> np.ndarray:
    """An Arrow array as numpy: a read-only view of its buffer where it holds fixed-width numbers without nulls,
    the unpacked bits where it holds booleans without nulls (null masks among them).

    pyarrow's ``to_numpy`` goes through its pandas conversion layer, which imports pandas (0.3 s and about
    95 MB in each fresh Python worker, counted in that task's memory); these are read from their buffers
    instead, the numbers as ``to_numpy`` would without a copy.  Arrays with nulls, which the data path
    refuses or masks first, still go through pyarrow.
    """
    kind = array.type
    # by type id: extension types need not be hashable
    dtype = _NUMPY_DTYPES.get(kind.id)
    if array.null_count == 0 and dtype is not None:
        if len(array) == 0:
            return np.empty(0, dtype)
        view = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
        view.flags.writeable = False    # Arrow's memory: whoever needs to write copies it (as after to_numpy)
        return view
    if array.null_count == 0 and pa.types.is_boolean(kind):
        if len(array) == 0:
            return np.empty(0, bool)
        # one bit per value, least significant first, from the array's offset on
        bits = np.unpackbits(np.frombuffer(array.buffers()[1], dtype=np.uint8), count=array.offset + len(array),
                             bitorder="little")
        return bits[array.offset:].view(bool)
    return array.to_numpy(zero_copy_only=False)


def _list_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return _numbers(array.flatten()).reshape(len(array), width)
    lengths = _numbers(array.value_lengths())
    if len(lengths) and (lengths != lengths[0]).any():
        raise DataError(f"column {name!r} holds arrays of unequal length "
                         f"({int(lengths.min())} to {int(lengths.max())}); every row needs the same length")
    values = array.flatten()
    if values.null_count:
        raise DataError(f"column {name!r} has null elements inside its arrays")
    width = int(lengths[0]) if len(lengths) else 0
    return _numbers(values).reshape(len(array), width)


def _vector_to_matrix(array: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML vectors (struct<type, size, indices, values>) -> dense rows."""
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    kind = _numbers(array.field("type"))
    values = array.field("values")
    value_lengths = _numbers(values.value_lengths())
    sizes = _numbers(array.field("size").fill_null(-1)).astype(np.int64)
    dense = kind == 1
    widths = np.where(dense, value_lengths, sizes)
    if len(widths) and (widths != widths[0]).any():
        raise DataError(f"column {name!r} holds vectors of unequal size "
                         f"({int(widths.min())} to {int(widths.max())}); every row needs the same size")
    n, width = len(array), int(widths[0]) if len(widths) else 0
    flat_values = _numbers(values.flatten())
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
    index_lengths = _numbers(indices.value_lengths().fill_null(0))
    flat_indices = _numbers(indices.flatten())
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
        matrix = _numbers(array).reshape(-1, 1)
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
            mask |= _numbers(column.is_null())
        kind = column.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            values = column.flatten()     # the values of the non-null rows, in order
            if values.null_count:
                lengths = _numbers(pc.list_value_length(column).fill_null(0))
                parents = np.repeat(np.arange(len(column)), lengths)
                mask[parents[_numbers(values.is_null())]] = True
    return mask


def _element_dtype(kind: pa.DataType, name: str) -> np.dtype:
    """The dtype a typed input's numbers reach the model in: int64, bool or float32."""
    if pa.types.is_integer(kind):
        return np.dtype(np.int64)
    if pa.types.is_boolean(kind):
        return np.dtype(np.bool_)
    if pa.types.is_floating(kind):
        return np.dtype(np.float32)
    raise DataError(f"column {name!r} holds {kind}; model inputs must hold numbers or booleans")


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_vector(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) and {f.name for f in kind} >= {"type", "size", "indices", "values"}


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):    # beyond float32: inf, which the finiteness checks refuse
        return values.astype(dtype, copy=False)


def column_to_field(array: pa.Array, name: str, shape: tuple[int, ...] | None = None) -> Field:
    """One Arrow column -> one typed model input (see :mod:`sparkdl._internal.data.block`); ``shape``: one row's shape."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    kind = array.type
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null rows")
    if is_binary(kind):
        return _binary_rows(array, name)
    if _is_vector(kind):
        field: np.ndarray = _vector_to_matrix(array, name).astype(np.float32)
    elif _is_list(kind):
        values = array.flatten()
        if values.null_count:
            raise DataError(f"column {name!r} has null elements inside its arrays")
        dtype = _element_dtype(values.type, name)
        flat = _cast(_numbers(values), dtype)
        offsets = (np.arange(len(array) + 1, dtype=np.int64) * kind.list_size if pa.types.is_fixed_size_list(kind)
                   else _numbers(array.offsets).astype(np.int64))
        ragged = Ragged(flat, offsets - offsets[0])
        if shape is None:
            return ragged
        field = _dense_rows(ragged, name, shape)
    else:
        field = _cast(_numbers(array), _element_dtype(kind, name))
    if shape is not None and field.shape[1:] != shape:
        width = int(np.prod(field.shape[1:]))
        if width != int(np.prod(shape)):
            raise DataError(f"the row shape {list(shape)} of column {name!r} needs {int(np.prod(shape))} values per "
                            f"row, its rows have {width}")
        field = field.reshape(len(field), *shape)
    return field


def _dense_rows(ragged: Ragged, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Ragged rows that must all hold ``prod(shape)`` elements, as ``[rows, *shape]``."""
    expected = int(np.prod(shape))
    lengths = ragged.lengths
    if len(lengths) and (lengths != expected).any():
        i = int(np.argmax(lengths != expected))
        raise DataError(f"row {i} of column {name!r} holds {int(lengths[i])} values; its row shape {list(shape)} "
                        f"needs {expected}")
    return ragged.values.reshape(len(lengths), *shape)


def _label_values(array: pa.Array, name: str) -> np.ndarray:
    """Labels: scalars ``[rows]``, or arrays and Vectors of one length ``[rows, k]`` (multi-label, multi-output)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null labels")
    if _is_vector(array.type):
        return _vector_to_matrix(array, name)
    if _is_list(array.type):
        return _list_to_matrix(array, name)
    return _numbers(array)


def _weights(array: pa.Array | pa.ChunkedArray, name: str) -> np.ndarray:
    """A weight column: one float32 number per row."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise DataError(f"weight column {name!r} has {array.null_count} null rows")
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        raise DataError(f"weight column {name!r} holds {array.type}; weights must be numbers")
    return _cast(_numbers(array), np.dtype(np.float32))


def arrow_to_block(batches: Iterable[pa.RecordBatch], spec: ColumnSpec, rules: DataRules | None = None,
                   first_row: int = 0) -> RowBlock:
    """All of a partition's Arrow batches -> one :class:`RowBlock` (labels and weights when the spec names them).

    With ``rules`` the rows are checked as well: nulls, NaN/Inf, the width, ids, lengths, the
    class labels (``first_row``: the partition position of the first row, for the messages).
    """
    batch_list = [b for b in batches if b.num_rows]
    if not batch_list:
        return _empty_block(spec)
    table = pa.Table.from_batches(batch_list)
    if spec.typed:
        inputs = tuple(column_to_field(table.column(name), name, spec.shape_of(i))
                       for i, name in enumerate(spec.input_columns))
    else:
        inputs = (_features(table, spec),)
    labels = _label_values(table.column(spec.label_col), spec.label_col) if spec.label_col else None
    weights = None
    if spec.weight_col:
        weights = _weights(table.column(spec.weight_col), spec.weight_col)
    block = RowBlock(inputs, labels, weights)
    if rules is not None:
        check_block(block, spec, rules, first_row)
    return block


def _empty_block(spec: ColumnSpec) -> RowBlock:
    if spec.typed:
        return RowBlock(tuple(np.zeros(0, np.float32) for _ in spec.input_columns), np.zeros(0))
    width = int(np.prod(spec.features_shape)) if spec.features_shape else 0
    return RowBlock((np.zeros((0, *(spec.features_shape or (width,))), np.float32),), np.zeros(0))


def _features(table: pa.Table, spec: ColumnSpec) -> np.ndarray:
    """featuresCol/featuresCols: one float32 matrix (or encoded rows), shaped by featuresShape."""
    parts = [column_to_matrix(table.column(name), name) for name in spec.input_columns]
    features = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    if features.dtype == object or not spec.features_shape:   # encoded rows: the batch transform's business
        return features
    expected = int(np.prod(spec.features_shape))
    if features.shape[1] != expected:
        raise DataError(f"featuresShape {list(spec.features_shape)} needs {expected} values per row, "
                        f"the features have {features.shape[1]}")
    return np.ascontiguousarray(features.reshape(len(features), *spec.features_shape))


def arrow_chunks(batches: Iterable[pa.RecordBatch], spec: ColumnSpec, rules: DataRules | None = None
                 ) -> Iterator[RowBlock]:
    """A partition's Arrow batches as :class:`RowBlock` s, one batch at a time (checked with ``rules``)."""
    first_row = 0
    for batch in batches:
        if batch.num_rows:
            block = arrow_to_block([batch], spec, rules, first_row)
            first_row += batch.num_rows
            # the block may share the batch's buffers: hold neither while the consumer reads the next batch
            del batch
            yield block
            del block
