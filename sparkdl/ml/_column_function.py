"""TorchModel as a SQL column function: usable in ``withColumn``, ``select`` and, once registered, Spark SQL.

The function takes the model's input columns (``featuresCol``, ``featuresCols`` or ``inputCols``, in that
order) as its arguments and returns what ``transform`` adds: one column as its value, several as a struct
of them, with Vectors as ``array<double>`` (Spark's columnar Arrow evaluation, used over Parquet and other
columnar sources, refuses a UDT result).  It is an Arrow UDF (``pyspark.sql.functions.arrow_udf``, pyspark
4.1 and newer), scoring each Arrow batch with the same per-worker model as ``transform``.  A column function
cannot drop rows: ``handleInvalid="skip"`` is refused, and ``"keep"`` gives invalid rows a null.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl._internal.spark.backend import SparkBackend
from sparkdl.ml._scoring import BatchScorer, ScoringSpec, share_model


def return_type(spec: ScoringSpec) -> T.DataType:
    """The function's result: the one added column's type, or a struct of the added columns (Vectors as
    ``array<double>``: Spark's columnar Arrow evaluation refuses a UDT result)."""
    fields = spec.outputs.fields(vectors_as_arrays=True)
    return fields[0].dataType if len(fields) == 1 else T.StructType(fields)


def column_function(spec: ScoringSpec, backend: SparkBackend) -> Any:
    """The model as an Arrow UDF of its input columns (see the module docstring)."""
    arrow_udf = getattr(F, "arrow_udf", None)
    if arrow_udf is None:
        import pyspark

        raise RuntimeError(f"TorchModel.udf() needs pyspark 4.1 or newer (its arrow_udf); this is pyspark "
                           f"{pyspark.__version__}: score with transform(), or upgrade pyspark")
    if spec.handle_invalid == "skip":
        raise ValueError("a column function cannot drop rows, so handleInvalid='skip' does not apply to it: set "
                         "handleInvalid='keep' (invalid rows give null) or 'error' (they fail the query), or score "
                         "with transform(), which can leave rows out")
    from pyspark.util import PythonEvalType

    model, light = share_model(spec, backend)
    names, outputs = spec.columns.input_columns, spec.outputs
    single = len(outputs.names) == 1

    def score(batches: Iterator[Any]) -> Iterator[pa.Array]:
        scorer = BatchScorer(model, light)
        for arguments in batches:
            columns = [arguments] if isinstance(arguments, pa.Array) else list(arguments)
            batch = pa.RecordBatch.from_arrays(columns, names=names)
            invalid, values = scorer.score(batch)
            missing = invalid if invalid.any() else None
            added = outputs.to_arrow(values, missing, null_numbers=True, vectors_as_arrays=True)
            yield added[0] if single else pa.StructArray.from_arrays(
                added, names=outputs.names, mask=None if missing is None else pa.array(missing))

    return arrow_udf(score, return_type(spec), PythonEvalType.SQL_SCALAR_ARROW_ITER_UDF)
