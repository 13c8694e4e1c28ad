"""DataFrame columns checked on the driver: schema and first-row checks before launch, the scan that names bad rows.

These run before a fit launches (from the schema, and one ``first()`` job where the schema does not fix the
rows' shape) and, after a task found bad data, in one Spark aggregation that names the column, the count and
the first row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from sparkdl._internal.data.columns import ColumnSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType


def first_features(df: DataFrame, spec: ColumnSpec) -> tuple[Any, ...] | None:
    """The first row's feature values (None: the DataFrame is empty).

    One small Spark job: ``first()`` reads only as much of the data as it takes to find a row.
    """
    from pyspark.sql import functions as F

    row = df.select(*[F.col(f"`{name}`") for name in spec.input_columns]).first()
    return None if row is None else tuple(row)


def schema_sample(df: DataFrame, spec: ColumnSpec) -> tuple[Any, ...] | None:
    """A row of zeros shaped as the schema fixes every feature column, with no Spark job (None: it does not).

    The schema fixes a numeric or boolean column, a Vector whose metadata gives its size (a
    ``VectorAssembler``'s output does), and a flat numeric array whose row shape a Param gives
    (``featuresShape`` for the one ``featuresCol``, ``inputShapes`` per input column).  The values have
    the Python types ``first()`` would give, so the row goes the same way as a real one.
    """
    from pyspark.ml.linalg import DenseVector, VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f for f in df.schema.fields}
    row: list[Any] = []
    for index, name in enumerate(spec.input_columns):
        field = fields[name]
        kind = field.dataType
        shape = spec.shape_of(index) if spec.typed else spec.features_shape or None
        if isinstance(kind, T.BooleanType):
            row.append(False)
        elif isinstance(kind, T.NumericType):
            row.append(0 if isinstance(kind, T.IntegralType) else 0.0)
        elif isinstance(kind, VectorUDT):
            size = field.metadata.get("ml_attr", {}).get("num_attrs")
            if not size and shape and len(spec.input_columns) == 1:
                size = int(np.prod(shape))
            if not size:
                return None
            row.append(DenseVector(np.zeros(int(size))))
        elif (isinstance(kind, T.ArrayType) and isinstance(kind.elementType, (T.NumericType, T.BooleanType))
              and shape and (spec.typed or len(spec.input_columns) == 1)):
            element = kind.elementType
            zero: Any = (False if isinstance(element, T.BooleanType) else 0 if isinstance(element, T.IntegralType)
                         else 0.0)
            row.append([zero] * int(np.prod(shape)))
        else:       # encoded bytes, or an array whose length only a row tells
            return None
    return tuple(row)


def feature_width(values: tuple[Any, ...]) -> int | None:
    """Feature values per row, from one row's values (None for encoded bytes: known once decoded)."""
    width = 0
    for value in values:
        if isinstance(value, (bytes, bytearray)):
            return None
        if hasattr(value, "toArray"):          # a pyspark.ml Vector, dense or sparse
            width += int(value.size)
        elif isinstance(value, (list, tuple)):
            width += len(value)
        else:
            width += 1
    return width


def check_features_shape(spec: ColumnSpec, width: int | None) -> None:
    """``featuresShape`` must hold exactly the row's ``width`` values (None or 0: not known yet)."""
    if spec.features_shape and width and int(np.prod(spec.features_shape)) != width:
        raise ValueError(f"featuresShape {list(spec.features_shape)} needs {int(np.prod(spec.features_shape))} "
                         f"values per row, but the features have {width}")


def validate_columns(df, spec: ColumnSpec, decoder: bool = False) -> None:
    """Schema checks only (no Spark job): the columns exist and have supported types.

    ``decoder``: a ``batch_transform`` is set, so a binary feature column can be decoded.
    """
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    for name in spec.columns:
        if name not in fields:
            raise ValueError(f"column {name!r} not found in the DataFrame; its columns are {sorted(fields)}")
        kind = fields[name]
        if isinstance(kind.elementType if isinstance(kind, T.ArrayType) else kind, T.DecimalType):
            raise ValueError(f"column {name!r} is {kind.simpleString()}; cast decimals to float or double first "
                             f"(F.col({name!r}).cast('double'))")
    numeric = (T.NumericType, T.BooleanType)
    if spec.typed:
        _validate_inputs(fields, spec, decoder)
    for name in [] if spec.typed else spec.input_columns:
        kind = fields[name]
        if isinstance(kind, T.ArrayType):
            if not isinstance(kind.elementType, T.NumericType):
                raise ValueError(f"column {name!r} is {kind.simpleString()}; feature arrays must hold numbers")
        elif isinstance(kind, numeric):
            if not spec.features_cols:
                raise ValueError(f"column {name!r} is a single number; use featuresCols=[...] to assemble "
                                 "numeric columns, or a VectorAssembler")
        elif isinstance(kind, T.BinaryType):
            if spec.features_cols:
                raise ValueError(f"column {name!r} is binary; encoded rows must be the only feature column "
                                 "(featuresCol), not one of featuresCols")
            if not decoder:
                raise ValueError(f"column {name!r} holds encoded bytes; set batchTransform (batch_transform) to a "
                                 "callable that decodes a batch of them into a float tensor, e.g. "
                                 "sparkdl.transforms.DecodeImages()")
        elif not isinstance(kind, VectorUDT):
            raise ValueError(f"column {name!r} has the unsupported type {kind.simpleString()}; use "
                             "array<float|double>, a pyspark.ml Vector, numeric columns (featuresCols), or "
                             "encoded bytes (binary, with batchTransform)")
    if spec.label_col:
        label = fields[spec.label_col]
        element = label.elementType if isinstance(label, T.ArrayType) else label
        if not (isinstance(element, numeric) or isinstance(label, VectorUDT)):
            raise ValueError(f"label column {spec.label_col!r} is {label.simpleString()}; labels must be numbers, "
                             "arrays of numbers or Vectors (multi-label, multi-output)")
    if spec.weight_col and not isinstance(fields[spec.weight_col], T.NumericType):
        raise ValueError(f"weight column {spec.weight_col!r} is {fields[spec.weight_col].simpleString()}; weights "
                         "must be numbers")


def _string_hint(name: str) -> str:
    indexed = f"{name}_index"
    return (f"column {name!r} holds strings; model inputs must be numbers. Index it first, e.g. inside a "
            f"pyspark.ml.Pipeline: StringIndexer(inputCol={name!r}, outputCol={indexed!r}, "
            f"handleInvalid='keep') and then inputCols=[..., {indexed!r}, ...] (an int id for an nn.Embedding; cast "
            f"it with F.col({indexed!r}).cast('int')); for text, RegexTokenizer and an id per token")


def _validate_inputs(fields: dict[str, Any], spec: ColumnSpec, decoder: bool) -> None:
    """inputCols: numbers, booleans, arrays of them, Vectors, or encoded bytes (with a batch transform)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    numeric = (T.NumericType, T.BooleanType)
    for name in spec.input_columns:
        kind = fields[name]
        element = kind.elementType if isinstance(kind, T.ArrayType) else kind
        if isinstance(element, T.StringType):
            raise ValueError(_string_hint(name))
        if isinstance(kind, T.ArrayType) and isinstance(element, T.ArrayType):
            raise ValueError(f"column {name!r} is {kind.simpleString()}; an input column holds numbers or flat "
                             "arrays of them (flatten nested arrays and give inputShapes)")
        if isinstance(kind, T.BinaryType):
            if not decoder:
                raise ValueError(f"column {name!r} holds encoded bytes; set batchTransform to a callable that decodes "
                                 "them (it receives the tuple of inputs)")
            continue
        if not (isinstance(element, numeric) or isinstance(kind, VectorUDT)):
            raise ValueError(f"column {name!r} has the unsupported type {kind.simpleString()}; input columns hold "
                             "numbers, booleans, arrays of them, or pyspark.ml Vectors")


@dataclass(frozen=True)
class DataStats:
    """What one aggregation over the training data found."""

    rows: int
    width: int                        # feature values per row
    label_min: float | None = None
    label_max: float | None = None
    fractional_labels: int = 0


#: characters of a row's values quoted in an error message
_ROW_PREVIEW_CHARS = 200
#: monotonically_increasing_id() puts the partition index above the low 33 bits
_PARTITION_SHIFT = 33


def _array_checks(column: Column, element: DataType) -> tuple[Column, Column | None]:
    """Per-row flags for an array column: (holds a null element, holds NaN/+Inf/-Inf or None).

    For floating elements one code-generated pass finds both: ``arrays_overlap`` with
    ``[NaN, +Inf, -Inf]`` is true when the array holds one of them (Spark compares NaN equal to
    NaN there), null when it holds a null element but none of them, and false otherwise.  An
    array holding both a null element and NaN/Inf is reported for the latter.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not isinstance(element, (T.FloatType, T.DoubleType)):
        return F.exists(column, lambda v: v.isNull()), None        # integers cannot be NaN/Inf
    specials = F.array(*[F.lit(v).cast(element) for v in (float("nan"), float("inf"), float("-inf"))])
    special = F.arrays_overlap(column, specials)
    return special.isNull() & column.isNotNull(), F.coalesce(special, F.lit(False))


def _nonfinite_number(column: Column) -> Column:
    """Per-row flag of a floating column: the value is NaN or +/-Inf (false for nulls)."""
    from pyspark.sql import functions as F

    return F.coalesce(F.isnan(column) | (F.abs(column) == float("inf")), F.lit(False))


def _nonfinite_error(df: DataFrame, spec: ColumnSpec, name: str, bad: Column, count: int,
                     is_label: bool = False) -> ValueError:
    """The error for a column with NaN/Inf values: how many rows, where the first one is, what it holds.

    Runs one more (small) Spark job, on this failure path only: keeping the first offending row's
    values in the validation aggregation would need a string buffer, which turns Spark's code-generated
    hash aggregation into a slower sort aggregation for every fit.
    """
    from pyspark.sql import functions as F

    shown = [name] + [c for c in spec.columns if c != name]      # the offending column first
    preview = F.concat_ws(", ", *[F.concat(F.lit(f"{c}="), F.col(f"`{c}`").cast("string")) for c in shown])
    # positions are taken before the filter, so they count every row of each partition
    first = (df.select("*", F.monotonically_increasing_id().alias("@position")).filter(bad)
             .orderBy("@position").select("@position", preview.alias("@values")).first())
    what = f"label column {name!r}" if is_label else f"column {name!r}"
    message = f"{what} has {count} rows with NaN or infinite values"
    if first is not None:          # None only if the data changed between the two jobs
        values = first["@values"]
        if len(values) > _ROW_PREVIEW_CHARS:
            values = values[:_ROW_PREVIEW_CHARS].rstrip(", ") + " ...(truncated)"
        at = int(first["@position"])
        message += (f"; the first is row {at & ((1 << _PARTITION_SHIFT) - 1)} of partition {at >> _PARTITION_SHIFT}"
                    f" (its position in the DataFrame's partition order), holding {values}")
    return ValueError(message + ". Drop, clip or impute these rows before fitting: they can only produce "
                      "non-finite gradients")


def validate_dataframe(df: DataFrame, spec: ColumnSpec, decoder: bool = False) -> DataStats:
    """Check columns, types, nulls, lengths and NaN/Inf values with one Spark aggregation (no barrier stage).

    A fit runs it only when its tasks found bad rows (:class:`DataRules`): a scan of the whole
    DataFrame then says what is wrong in the DataFrame's own terms.

    Raises ``ValueError`` naming the column and the problem (finding the first row with NaN/Inf
    values for the message takes a second job, only when there is one).
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    validate_columns(df, spec, decoder)
    fields = {f.name: f.dataType for f in df.schema.fields}
    # Vectors become arrays once per row, in a projection: their sizes, NaN/Inf checks and the
    # error preview all read that one conversion.
    framed = df.select(*[(vector_to_array(F.col(f"`{name}`")) if isinstance(fields[name], VectorUDT)
                          else F.col(f"`{name}`")).alias(name) for name in spec.columns])
    nonfinite: dict[str, Column] = {}       # column ("@label" for the label) -> row has NaN/Inf
    checks = _input_checks(spec, fields, nonfinite) + _label_checks(spec, fields, nonfinite)
    checks += [F.sum(F.when(bad, 1).otherwise(0)).alias(f"{name}|nonfinite") for name, bad in nonfinite.items()]
    row = framed.agg(*checks, F.count(F.lit(1)).alias("@rows")).collect()[0].asDict()
    if row["@rows"] == 0:
        raise ValueError("the DataFrame is empty; there is nothing to train on")
    width = _checked_input_width(row, spec, framed, nonfinite)
    check_features_shape(spec, width)
    if not spec.label_col:
        return DataStats(row["@rows"], width)
    if row["@label|nulls"]:
        raise ValueError(f"label column {spec.label_col!r} has {row['@label|nulls']} null rows; drop them "
                         f"(e.g. df.na.drop(subset=[{spec.label_col!r}]))")
    if row.get("@label|nonfinite"):
        raise _nonfinite_error(framed, spec, spec.label_col, nonfinite["@label"], row["@label|nonfinite"],
                               is_label=True)
    return DataStats(row["@rows"], width, row["@label|min"], row["@label|max"], row["@label|fractional"])


def _input_checks(spec: ColumnSpec, fields: dict[str, DataType], nonfinite: dict[str, Column]) -> list[Column]:
    """The aggregations that check the input columns (nulls, sizes, ids); their NaN/Inf tests go to ``nonfinite``."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    checks: list[Column] = []
    for name in spec.input_columns:
        kind = fields[name]
        column = F.col(f"`{name}`")
        if isinstance(kind, (T.ArrayType, VectorUDT)):
            element = kind.elementType if isinstance(kind, T.ArrayType) else T.DoubleType()
            null_elements, special = _array_checks(column, element)
            checks.append(F.sum(F.when(null_elements, 1).otherwise(0)).alias(f"{name}|null_elements"))
            if special is not None:
                nonfinite[name] = special
        elif isinstance(kind, (T.FloatType, T.DoubleType)):
            nonfinite[name] = _nonfinite_number(column)
        if isinstance(kind, T.BinaryType):      # encoded rows: only nulls can be checked before decoding
            checks.append(F.sum(F.when(column.isNull(), 1).otherwise(0)).alias(f"{name}|nulls"))
            continue
        size = F.lit(1) if isinstance(kind, (T.NumericType, T.BooleanType)) else F.size(column)
        checks += [F.sum(F.when(column.isNull(), 1).otherwise(0)).alias(f"{name}|nulls"),
                   F.min(size).alias(f"{name}|min_size"), F.max(size).alias(f"{name}|max_size")]
        element = kind.elementType if isinstance(kind, T.ArrayType) else kind
        if spec.typed and isinstance(element, T.IntegralType):     # ids: an nn.Embedding index, >= 0
            smallest = F.array_min(column) if isinstance(kind, T.ArrayType) else column
            checks.append(F.min(smallest).alias(f"{name}|min_id"))
    return checks


def _label_checks(spec: ColumnSpec, fields: dict[str, DataType], nonfinite: dict[str, Column]) -> list[Column]:
    """The aggregations that check the label (nulls, range, fractional values); its NaN/Inf test goes to
    ``nonfinite["@label"]`` ('@': a feature may share the name)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not spec.label_col:
        return []
    label_kind = fields[spec.label_col]
    if isinstance(label_kind, (T.ArrayType, VectorUDT)):     # multi-label, multi-output
        label = F.col(f"`{spec.label_col}`")
        element = label_kind.elementType if isinstance(label_kind, T.ArrayType) else T.DoubleType()
        _, special = _array_checks(label, element)
        if special is not None:
            nonfinite["@label"] = special
        return [F.sum(F.when(label.isNull(), 1).otherwise(0)).alias("@label|nulls"),
                F.lit(None).cast("double").alias("@label|min"), F.lit(None).cast("double").alias("@label|max"),
                F.lit(0).alias("@label|fractional")]
    label = F.col(f"`{spec.label_col}`").cast("double")
    if isinstance(label_kind, (T.FloatType, T.DoubleType)):
        nonfinite["@label"] = _nonfinite_number(label)
    return [F.sum(F.when(label.isNull(), 1).otherwise(0)).alias("@label|nulls"),
            F.min(label).alias("@label|min"), F.max(label).alias("@label|max"),
            F.sum(F.when(label != F.floor(label), 1).otherwise(0)).alias("@label|fractional")]


def _checked_input_width(row: dict[str, Any], spec: ColumnSpec, framed: DataFrame, nonfinite: dict[str, Column]) -> int:
    """The features' width read off the aggregation's ``row``, raising on the first input column it condemns."""
    width = 0
    for name in spec.input_columns:
        if row[f"{name}|nulls"]:
            raise ValueError(f"column {name!r} has {row[f'{name}|nulls']} null rows; drop or fill them "
                             f"(e.g. df.na.drop(subset=[{name!r}]))")
        if row.get(f"{name}|null_elements"):
            raise ValueError(f"column {name!r} has {row[f'{name}|null_elements']} arrays with null elements; "
                             "fill them first")
        if f"{name}|min_size" not in row:       # a binary column: its width is known once decoded
            continue
        low, high = row[f"{name}|min_size"], row[f"{name}|max_size"]
        if row.get(f"{name}|min_id") is not None and row[f"{name}|min_id"] < 0:
            raise ValueError(f"column {name!r} holds the id {row[f'{name}|min_id']}; integer inputs reach the model "
                             "as int64 ids (an nn.Embedding index), which must be >= 0: map them with StringIndexer, "
                             "or cast the column to double if it is a number rather than an id")
        if spec.typed:       # arrays of any length: ragged rows, padded per mini-batch
            if row.get(f"{name}|nonfinite"):
                raise _nonfinite_error(framed, spec, name, nonfinite[name], row[f"{name}|nonfinite"])
            continue
        if low != high:
            raise ValueError(f"column {name!r} holds arrays of unequal length ({low} to {high}); every row "
                             "needs the same length")
        if row.get(f"{name}|nonfinite"):
            raise _nonfinite_error(framed, spec, name, nonfinite[name], row[f"{name}|nonfinite"])
        width += int(low)
    return width


def check_class_labels(stats: DataStats, label_col: str, num_classes: int) -> None:
    """Class labels must be integers in [0, num_classes)."""
    if stats.fractional_labels:
        raise ValueError(f"label column {label_col!r} has {stats.fractional_labels} non-integer values; class "
                         f"labels must be integers in [0, {num_classes})")
    # label_min and label_max come from one aggregation: both None (no rows) or both set
    if stats.label_min is not None and (stats.label_min < 0 or cast(float, stats.label_max) >= num_classes):
        raise ValueError(f"label column {label_col!r} has values in [{stats.label_min:g}, {stats.label_max:g}], "
                         f"outside [0, {num_classes}) for a model with {num_classes} outputs")


def explain_bad_rows(df: DataFrame, spec: ColumnSpec, decoder: bool, classes: int | None) -> None:
    """Raise the ``ValueError`` that says what is wrong with the rows in the DataFrame's own terms
    (column, count, first row): one scan, run once the tasks found bad rows.  Returns if it finds none."""
    stats = validate_dataframe(df, spec, decoder)
    if classes is not None and spec.label_col:
        check_class_labels(stats, spec.label_col, classes)
