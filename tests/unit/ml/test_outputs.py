"""What a scored batch adds, by output kind: values from a real model's output, and their Arrow columns."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl.ml._outputs import OutputSpec, dense_vectors, fixed_width_lists

LOGITS = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.2, 2.9], [-1.0, -2.0, 4.0, 0.0]])


def test_a_classifier_adds_prediction_probability_raw_output_and_the_top_classes_in_order():
    spec = OutputSpec("multiclass", "prediction", "probability", "rawPrediction", top_k=3, top_k_col="top")
    values = spec.columns_of(LOGITS)
    assert spec.names == ["prediction", "probability", "rawPrediction", "top"]
    assert values["prediction"].tolist() == [1.0, 0.0, 2.0]
    assert torch.allclose(values["probability"], torch.softmax(LOGITS.double(), dim=1))
    assert values["rawPrediction"].tolist() == LOGITS.double().tolist()
    assert values["top"].tolist() == [[1, 3, 0], [0, 3, 2], [2, 3, 0]]


def test_an_embedding_is_the_raw_output_in_float32_whatever_its_dtype():
    spec = OutputSpec("embedding", "embedding")
    half = LOGITS.to(torch.bfloat16)
    values = spec.columns_of(half.reshape(3, 2, 2))               # flattened per row
    assert values["embedding"].dtype == torch.float32
    assert values["embedding"].tolist() == half.float().tolist()
    column = spec.to_arrow({k: v.numpy() for k, v in values.items()}, None)[0]
    assert column.type == pa.list_(pa.field("element", pa.float32(), nullable=False))
    assert column.to_pylist() == half.float().tolist()


def test_several_outputs_go_to_their_named_columns_by_position_or_by_key():
    spec = OutputSpec("embedding", "prediction", output_cols=("pooled", "tokens"))
    by_position = spec.columns_of((LOGITS[:, :2], LOGITS.reshape(3, 2, 2)))
    assert by_position["pooled"].tolist() == LOGITS[:, :2].tolist()
    assert by_position["tokens"].tolist() == LOGITS.tolist()
    by_key = spec.columns_of({"tokens": LOGITS, "pooled": LOGITS[:, :1], "unused": LOGITS})
    assert by_key["pooled"].tolist() == LOGITS[:, :1].tolist() and spec.names == ["pooled", "tokens"]
    with pytest.raises(ValueError, match=r"outputCols names \['tokens'\], which the model's output does not have"):
        OutputSpec("embedding", "p", output_cols=("pooled", "tokens")).columns_of({"pooled": LOGITS})
    with pytest.raises(ValueError, match="returned 3 outputs and outputCols names 2"):
        spec.columns_of((LOGITS, LOGITS, LOGITS))


def test_a_single_output_kind_reads_the_first_of_several_outputs():
    values = OutputSpec("multiclass", "prediction").columns_of({"logits": LOGITS, "hidden": -LOGITS})
    assert values["prediction"].tolist() == [1.0, 0.0, 2.0]


def test_settings_that_do_not_fit_the_kind_are_refused():
    with pytest.raises(ValueError, match="topK ranks classes"):
        OutputSpec("regression", "prediction", top_k=2)
    with pytest.raises(ValueError, match="outputCols names the outputs of an 'embedding' model"):
        OutputSpec("multiclass", "prediction", output_cols=("a",))
    with pytest.raises(ValueError, match="outputKind must be one of"):
        OutputSpec("classes", "prediction")


def test_missing_rows_are_null_in_their_places():
    valid = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    missing = np.array([False, True, False, True])
    lists = fixed_width_lists(valid, missing)
    assert lists.to_pylist() == [[1.0, 2.0], None, [3.0, 4.0], None]
    vectors = dense_vectors(valid.astype(np.float64), missing)
    assert vectors.is_null().to_pylist() == missing.tolist()
    assert [v["values"] for v in vectors.to_pylist() if v] == [[1.0, 2.0], [3.0, 4.0]]
    spec = OutputSpec("regression", "prediction")
    prediction, = spec.to_arrow({"prediction": np.array([0.5, 1.5])}, missing)
    assert np.isnan(prediction.to_numpy()[[1, 3]]).all() and prediction.to_numpy()[[0, 2]].tolist() == [0.5, 1.5]
