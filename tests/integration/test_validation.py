"""Bad DataFrames are refused with a ValueError naming the column, before any barrier stage."""
from __future__ import annotations

import pytest
from pyspark.ml.linalg import Vectors, VectorUDT
from pyspark.sql.types import LongType, StructField, StructType

from sparkdl import TorchEstimator

from ..conftest import DIGITS_MLP


def fit(spark, rows, schema, **params):
    settings = dict(model=DIGITS_MLP, epochs=1, numWorkers=2)
    settings.update(params)
    return TorchEstimator(**settings).fit(spark.createDataFrame(rows, schema))


GOOD = [([0.5] * 64, 1), ([0.1] * 64, 2)]
NAN, INF = float("nan"), float("inf")
VECTORS = StructType([StructField("features", VectorUDT()), StructField("label", LongType())])
#: the start of every NaN/Inf message; the row is the third of three, the second of partition 1 under local[2]
NONFINITE = (r"has 1 rows with NaN or infinite values; the first is row 1 of partition 1 \(its position in the "
             r"DataFrame's partition order\), holding ")


@pytest.mark.parametrize("rows, schema, params, message", [
    (GOOD, "x array<float>, label long", {}, r"column 'features' not found in the DataFrame; its columns are \['label', 'x'\]"),
    (GOOD, "features array<float>, y long", {}, r"column 'label' not found"),
    ([("a", 1)], "features string, label long", {}, r"column 'features' has the unsupported type string"),
    ([(["a"] * 64, 1)], "features array<string>, label long", {}, r"feature arrays must hold numbers"),
    (GOOD + [(None, 3)], "features array<float>, label long", {}, r"column 'features' has 1 null rows"),
    (GOOD + [([0.1] * 63 + [None], 3)], "features array<float>, label long", {}, r"'features' has 1 arrays with null elements"),
    (GOOD + [([0.1] * 60, 3)], "features array<float>, label long", {}, r"column 'features' holds arrays of unequal length \(60 to 64\)"),
    (GOOD + [([0.1] * 64, None)], "features array<float>, label long", {}, r"label column 'label' has 1 null rows"),
    (GOOD + [([0.1] * 64, 10)], "features array<float>, label long", {}, r"label column 'label' has values in \[1, 10\], outside \[0, 10\)"),
    (GOOD + [([0.1] * 64, -1)], "features array<float>, label long", {}, r"outside \[0, 10\)"),
    ([([0.5] * 64, 1.5)], "features array<float>, label double", {}, r"non-integer values"),
    (GOOD, "features array<float>, label string", {}, r"label column 'label' is string; labels must be numeric"),
    (GOOD, "features array<float>, label long", {"featuresShape": [1, 7, 7]}, r"featuresShape \[1, 7, 7\] needs 49"),
    ([([0.5] * 10, 1)], "features array<float>, label long", {}, r"the model does not accept feature rows of shape \[10\]"),
    ([], "features array<float>, label long", {}, r"the DataFrame is empty"),
    # NaN/Inf would train "successfully" on skipped gradients: refused with the first offending row
    (GOOD + [([0.1] * 2 + [NAN] + [0.1] * 61, 3)], "features array<float>, label long", {},
     r"column 'features' " + NONFINITE + r"features=\[0\.1, 0\.1, NaN, 0\.1, .*0\.1 \.\.\.\(truncated\)\. Drop"),
    (GOOD + [([0.1] * 63 + [-INF], 3)], "features array<double>, label long", {}, r"column 'features' " + NONFINITE),
    ([(0.5, 1.0, 1), (0.5, 2.0, 1), (INF, 1.0, 2)], "a double, b double, label long", {"featuresCols": ["a", "b"]},
     r"column 'a' " + NONFINITE + r"a=Infinity, b=1\.0, label=2\. Drop, clip or impute"),
    ([(Vectors.dense([0.5] * 64), 1), (Vectors.sparse(64, [3], [0.5]), 2), (Vectors.sparse(64, [3], [NAN]), 3)],
     VECTORS, {}, r"column 'features' " + NONFINITE + r"features=\[0\.0, 0\.0, 0\.0, NaN, 0\.0,"),
    ([([0.5] * 64, 1.0), ([0.1] * 64, 2.0), ([0.1] * 64, NAN)], "features array<float>, label double", {"loss": "mse"},
     r"label column 'label' " + NONFINITE + r"label=NaN, features=\[0\.1, .*\(truncated\)\. Drop"),
])
def test_bad_input_is_refused_before_launch(spark, rows, schema, params, message):
    # ValueError, not a SparkDLError/WorkerError: refused by the checks, not by a failed stage
    with pytest.raises(ValueError, match=message) as info:
        fit(spark, rows, schema, **params)
    assert type(info.value) is ValueError


def test_transform_refuses_an_existing_output_column(spark, digits):
    x_train, _, y_train, _ = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train[:200], y_train[:200])],
                                  "features array<float>, label long")
    model = TorchEstimator(model=DIGITS_MLP, epochs=1, updatePolicy="async").fit(frame)
    with pytest.raises(ValueError, match="output column 'label' already exists"):
        model.setPredictionCol("label").transform(frame)
