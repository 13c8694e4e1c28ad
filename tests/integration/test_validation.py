"""Bad DataFrames are refused with a ValueError naming the column, before any update.

The schema, an empty DataFrame, featuresShape and the model's input are checked on the driver
before launch (from the schema where it fixes the rows' shape, else from the first row); the tasks check every row as they load it (nulls, lengths,
NaN/Inf, class labels), and then one scan of the DataFrame names the column, row and count.
"""
from __future__ import annotations

import functools
from decimal import Decimal

import pytest
from pyspark.ml.linalg import Vectors, VectorUDT
from pyspark.sql.types import LongType, StructField, StructType
from torch import nn

import sparkdl.ml.estimator as estimator_module
from sparkdl import TorchEstimator
from sparkdl._internal.data.arrow import arrow_chunks
from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.schema import explain_bad_rows, feature_width, first_features
from sparkdl._internal.data.schema import first_features as estimator_module_first_features
from sparkdl.errors import DataError
from sparkdl.models import mlp

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


def arrow_batches(frame) -> list:
    """The DataFrame's rows as Arrow record batches (``toArrow`` from pyspark 4.0; 3.5 has the private collector)."""
    if hasattr(frame, "toArrow"):
        return frame.toArrow().to_batches()
    return frame._collect_as_arrow()


#: decided on the driver before launch: the schema, the first row, the model's input
BEFORE_LAUNCH = [
    (GOOD, "x array<float>, label long", {}, r"column 'features' not found in the DataFrame; its columns are \['label', 'x'\]"),
    (GOOD, "features array<float>, y long", {}, r"column 'label' not found"),
    ([("a", 1)], "features string, label long", {}, r"column 'features' has the unsupported type string"),
    ([(["a"] * 64, 1)], "features array<string>, label long", {}, r"feature arrays must hold numbers"),
    ([(None, 3)] + GOOD, "features array<float>, label long", {}, r"column 'features' has 1 null rows"),
    (GOOD, "features array<float>, label string", {}, r"label column 'label' is string; labels must be numbers"),
    ([([0.5] * 64, Decimal("1.00"))], "features array<float>, label decimal(4,2)", {}, r"cast decimals to float or double"),
    (GOOD, "features array<float>, label long", {"featuresShape": [1, 7, 7]}, r"featuresShape \[1, 7, 7\] needs 49"),
    ([([0.5] * 10, 1)], "features array<float>, label long", {}, r"the model does not accept feature rows of shape \[10\]"),
    ([], "features array<float>, label long", {}, r"the DataFrame is empty"),
]
#: decided by the tasks as they load their rows (before any update); one scan then names the column, row and count
IN_TASK = [
    (GOOD + [(None, 3)], "features array<float>, label long", {}, r"column 'features' has 1 null rows"),
    (GOOD + [([0.1] * 63 + [None], 3)], "features array<float>, label long", {}, r"'features' has 1 arrays with null elements"),
    (GOOD + [([0.1] * 60, 3)], "features array<float>, label long", {}, r"column 'features' holds arrays of unequal length \(60 to 64\)"),
    (GOOD + [([0.1] * 64, None)], "features array<float>, label long", {}, r"label column 'label' has 1 null rows"),
    (GOOD + [([0.1] * 64, 10)], "features array<float>, label long", {}, r"label column 'label' has values in \[1, 10\], outside \[0, 10\)"),
    (GOOD + [([0.1] * 64, -1)], "features array<float>, label long", {}, r"outside \[0, 10\)"),
    ([([0.5] * 64, 1.0), ([0.5] * 64, 1.5)], "features array<float>, label double", {}, r"non-integer values"),
    # NaN/Inf would train "successfully" on skipped gradients: refused with the first offending row
    (GOOD + [([0.1] * 2 + [NAN] + [0.1] * 61, 3)], "features array<float>, label long", {},
     r"column 'features' " + NONFINITE + r"features=\[0\.1, 0\.1, NaN, 0\.1, .*0\.1 \.\.\.\(truncated\)\. Drop"),
    (GOOD + [([0.1] * 63 + [-INF], 3)], "features array<double>, label long", {}, r"column 'features' " + NONFINITE),
    ([(0.5, 1.0, 1), (0.5, 2.0, 1), (INF, 1.0, 2)], "a double, b double, label long",
     {"featuresCols": ["a", "b"], "model": functools.partial(mlp, 2, (4,), 3)},
     r"column 'a' " + NONFINITE + r"a=Infinity, b=1\.0, label=2\. Drop, clip or impute"),
    ([(Vectors.dense([0.5] * 64), 1), (Vectors.sparse(64, [3], [0.5]), 2), (Vectors.sparse(64, [3], [NAN]), 3)],
     VECTORS, {}, r"column 'features' " + NONFINITE + r"features=\[0\.0, 0\.0, 0\.0, NaN, 0\.0,"),
    ([([0.5] * 64, 1.0), ([0.1] * 64, 2.0), ([0.1] * 64, NAN)], "features array<float>, label double", {"loss": "mse"},
     r"label column 'label' " + NONFINITE + r"label=NaN, features=\[0\.1, .*\(truncated\)\. Drop"),
]


@pytest.mark.parametrize("rows, schema, params, message", BEFORE_LAUNCH)
def test_bad_input_is_refused_before_launch(spark, rows, schema, params, message):
    # ValueError, not a SparkDLError/WorkerError: refused by the checks, not by a failed stage
    with pytest.raises(ValueError, match=message) as info:
        fit(spark, rows, schema, **params)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("rows, schema, params, message", IN_TASK)
def test_the_task_checks_refuse_bad_rows_and_the_scan_names_them(spark, rows, schema, params, message):
    """What a fit does in two steps, each checked here on every case: a task's check of the Arrow
    rows it loads raises DataError; the driver's scan then raises the message naming the rows."""
    frame = spark.createDataFrame(rows, schema)
    estimator = TorchEstimator(**{"model": DIGITS_MLP, **params})
    columns = estimator.column_spec(with_label=True)
    classes = None if params.get("loss") == "mse" else 3 if "model" in params else 10
    rules = DataRules(feature_width(first_features(frame, columns)), classes)
    with pytest.raises(DataError):
        list(arrow_chunks(arrow_batches(frame), columns, rules))
    with pytest.raises(ValueError, match=message) as info:
        explain_bad_rows(frame, columns, False, classes)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("case", [4, 7], ids=["label-outside", "nan-features"])
def test_a_fit_on_bad_rows_fails_before_any_update_with_the_scans_message(spark, tmp_path, case):
    rows, schema, params, message = IN_TASK[case]
    with pytest.raises(ValueError, match=message) as info:
        fit(spark, rows, schema, checkpointDir=str(tmp_path), checkpointEvery=1, **params)
    assert type(info.value) is ValueError
    assert not list(tmp_path.iterdir())      # no update was made, so no checkpoint was written


def test_transform_refuses_an_existing_output_column(spark, digits):
    x_train, _, y_train, _ = digits
    frame = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x_train[:200], y_train[:200])],
                                  "features array<float>, label long")
    model = TorchEstimator(model=DIGITS_MLP, epochs=1, updatePolicy="async").fit(frame)
    with pytest.raises(ValueError, match="output column 'label' already exists"):
        model.setPredictionCol("label").transform(frame)


class _ShiftedIds(nn.Module):
    """Looks up id - 1: a row of zeros (id 0) fails, the data's ids (>= 1) do not."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 3)

    def forward(self, ids):
        return self.table(ids - 1)


@pytest.fixture
def no_first_row_job(monkeypatch):
    """Fail the fit if the driver reads a row before launch (the schema should have been enough)."""
    def refuse(*args):
        raise AssertionError("the first row's job ran")
    monkeypatch.setattr(estimator_module, "first_features", refuse)


def test_numeric_columns_fix_the_input_width_so_no_job_reads_a_row_before_launch(spark, no_first_row_job):
    rows = [(float(i % 3), i % 5, i % 3) for i in range(40)]
    model = fit(spark, rows, "a double, b int, label long", featuresCols=["a", "b"],
                model=functools.partial(mlp, 2, (4,), 3))
    assert model.summary["output_width"] == 3 and model.summary["samples"] >= 40


def test_a_vector_columns_size_and_typed_inputs_shapes_come_from_the_schema(spark, no_first_row_job):
    from pyspark.ml.feature import VectorAssembler
    frame = spark.createDataFrame([(float(i), float(-i), i % 2) for i in range(20)], "a double, b double, label long")
    assembled = VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(frame)
    model = TorchEstimator(model=functools.partial(mlp, 2, (4,), 2), epochs=1, numWorkers=2).fit(assembled)
    assert model.summary["output_width"] == 2
    typed = spark.createDataFrame([(i % 8, [float(i)] * 6, i % 4) for i in range(20)],
                                  "id int, pixels array<float>, label long")

    class IdsAndPixels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table, self.dense = nn.Embedding(8, 4), nn.Linear(6, 4)

        def forward(self, ids, pixels):
            return self.table(ids) + self.dense(pixels.flatten(1))

    model = TorchEstimator(model=IdsAndPixels, inputCols=["id", "pixels"], inputShapes={"pixels": [2, 3]}, epochs=1,
                           numWorkers=2).fit(typed)
    assert model.summary["output_width"] == 4


def test_a_model_that_refuses_the_schemas_zeros_is_sized_on_the_first_row(spark, monkeypatch):
    read = []
    monkeypatch.setattr(estimator_module, "first_features",
                        lambda *args: read.append(1) or estimator_module_first_features(*args))
    rows = [(1 + i % 7, i % 3) for i in range(20)]
    model = fit(spark, rows, "id int, label long", inputCols=["id"], model=_ShiftedIds)
    assert read and model.summary["output_width"] == 3


def test_an_empty_dataframe_whose_schema_fixes_the_width_is_refused_after_its_tasks_find_no_row(spark):
    with pytest.raises(ValueError, match="the DataFrame is empty"):
        fit(spark, [], "a double, b double, label long", featuresCols=["a", "b"],
            model=functools.partial(mlp, 2, (4,), 3))


def test_rows_of_another_width_than_featuresShape_fail_in_their_task_and_the_scan_says_why(spark):
    with pytest.raises(ValueError, match=r"featuresShape \[49\] needs 49 values per row, but the features have 64"):
        fit(spark, GOOD, "features array<float>, label long", featuresShape=[49],
            model=functools.partial(mlp, 49, (8,), 10))
