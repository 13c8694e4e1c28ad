"""TorchModel as a SQL column function, and ``transform`` built on it.

The function takes the model's input columns (``featuresCol``, ``featuresCols`` or ``inputCols``, in that
order) as its arguments and returns what ``transform`` adds: one column as its value, several as a struct
of them, with Vectors as ``array<double>`` (Spark's columnar Arrow evaluation, used over Parquet and other
columnar sources, refuses a UDT result).  It is an Arrow UDF (``pyspark.sql.functions.arrow_udf``, pyspark
4.1 and newer), scoring each Arrow batch with the same per-worker model as ``transform``.  A column function
cannot drop rows: ``handleInvalid="skip"`` is refused, and ``"keep"`` gives invalid rows a null.

``transform`` uses the same function where pyspark has it (:func:`scored_frame`): only the input columns
travel to Python and only the added columns come back, where ``mapInArrow`` would send every column of the
row back to the JVM (for 784-wide rows, most of the floor's cost).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl._internal.spark.backend import SparkBackend
from sparkdl.ml._scoring import BatchScorer, ScoringSpec, SharedModels, share_model


def has_arrow_udf() -> bool:
    """Whether this pyspark has ``arrow_udf`` (4.1 and newer)."""
    return hasattr(F, "arrow_udf")


def return_type(spec: ScoringSpec, as_struct: bool = False) -> T.DataType:
    """The function's result: the one added column's type, or a struct of the added columns (Vectors as
    ``array<double>``: Spark's columnar Arrow evaluation refuses a UDT result)."""
    fields = spec.outputs.fields(vectors_as_arrays=True)
    return fields[0].dataType if len(fields) == 1 and not as_struct else T.StructType(fields)


def column_function(spec: ScoringSpec, backend: SparkBackend, shared_models: SharedModels | None = None) -> Any:
    """The model as an Arrow UDF of its input columns (see the module docstring)."""
    if not has_arrow_udf():
        import pyspark

        raise RuntimeError(f"TorchModel.udf() needs pyspark 4.1 or newer (its arrow_udf); this is pyspark "
                           f"{pyspark.__version__}: score with transform(), or upgrade pyspark")
    if spec.handle_invalid == "skip":
        raise ValueError("a column function cannot drop rows, so handleInvalid='skip' does not apply to it: set "
                         "handleInvalid='keep' (invalid rows give null) or 'error' (they fail the query), or score "
                         "with transform(), which can leave rows out")
    return _scoring_udf(spec, backend, shared_models, for_transform=False)


def scored_frame(dataset: DataFrame, spec: ScoringSpec, backend: SparkBackend,
                 shared_models: SharedModels | None = None) -> DataFrame:
    """``dataset`` with the columns ``spec.outputs`` names, scored by the column function (needs
    :func:`has_arrow_udf`): a struct of the outputs per row, unpacked into columns, Vectors made from arrays on
    the JVM (``array_to_vector``); under ``handleInvalid="skip"`` the rows whose struct is null are left out."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.ml.linalg import VectorUDT

    scored_column = "__sparkdl_scored"
    while scored_column in dataset.columns:
        scored_column += "_"
    function = _scoring_udf(spec, backend, shared_models, for_transform=True)
    if spec.handle_invalid == "skip":
        # else the optimizer pushes the filter below the projection and copies the function there: every row
        # would be scored twice
        function = function.asNondeterministic()
    scored = dataset.withColumn(scored_column, function(*(dataset[name] for name in spec.columns.input_columns)))
    if spec.handle_invalid == "skip":
        scored = scored.where(F.col(scored_column).isNotNull())

    def added(field: T.StructField) -> Column:
        value = F.col(scored_column)[field.name]
        if isinstance(field.dataType, VectorUDT):    # array_to_vector fails on a null array: kept null
            value = F.when(value.isNotNull(), array_to_vector(value))
        return value.alias(field.name)

    return scored.select("*", *map(added, spec.outputs.fields())).drop(scored_column)


def _scoring_udf(spec: ScoringSpec, backend: SparkBackend, shared_models: SharedModels | None,
                 for_transform: bool) -> Any:
    """The Arrow UDF behind :func:`column_function` and, ``for_transform``, :func:`scored_frame`: there it
    always returns the struct, invalid rows keep transform's values under "keep" (a NaN prediction, null
    others) and are a null struct under "skip"."""
    from pyspark.util import PythonEvalType

    model, light = share_model(spec, backend, shared_models)
    names, outputs = spec.columns.input_columns, spec.outputs
    single = len(outputs.names) == 1 and not for_transform
    null_rows = not for_transform or spec.handle_invalid == "skip"

    def score(batches: Iterator[Any]) -> Iterator[pa.Array]:
        scorer = BatchScorer(model, light)
        arrow_batches = (pa.RecordBatch.from_arrays([arguments] if isinstance(arguments, pa.Array)
                                                    else list(arguments), names=names) for arguments in batches)
        for _, invalid, values in scorer.score_all(arrow_batches):
            missing = invalid if invalid.any() else None
            added = outputs.to_arrow(values, missing, null_numbers=not for_transform, vectors_as_arrays=True)
            mask = pa.array(missing) if missing is not None and null_rows else None
            yield added[0] if single else pa.StructArray.from_arrays(added, names=outputs.names, mask=mask)

    with warnings.catch_warnings():    # pyspark prefers type hints to the evaluation type; it is the same UDF
        warnings.simplefilter("ignore", UserWarning)
        arrow_udf: Any = F.arrow_udf     # the overloads want type hints; the evaluation type is the same UDF
        return arrow_udf(score, return_type(spec, as_struct=for_transform), PythonEvalType.SQL_SCALAR_ARROW_ITER_UDF)
