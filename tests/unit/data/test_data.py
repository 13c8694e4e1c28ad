"""RDD rows -> arrays on the executors: shapes and non-finite values are refused with the row index."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors

from sparkdl._internal.data.rows import rows_to_arrays


def test_rows_become_a_float32_matrix_and_labels():
    features, labels = rows_to_arrays([([0.0, 1.0], 0), (np.array([2.0, 3.0]), 1), (torch.tensor([4.0, 5.0]), 2),
                                       (Vectors.sparse(2, [1], [6.0]), 3)])
    assert features.dtype == np.float32
    np.testing.assert_array_equal(features, [[0, 1], [2, 3], [4, 5], [0, 6]])
    np.testing.assert_array_equal(labels, [0, 1, 2, 3])


@pytest.mark.parametrize("bad", [[0.0, float("nan")], np.array([float("inf"), 0.0]), torch.tensor([0.0, -float("inf")]),
                                 Vectors.sparse(2, [1], [float("nan")])])
def test_a_non_finite_feature_names_its_row(bad):
    rows = [([0.0, 1.0], 0), ([1.0, 1.0], 1), (bad, 0), ([0.5, 0.5], 1), (bad, 1)]
    message = r"^row 2 of the partition has NaN or infinite feature values \(as float32\) \(2 such rows"
    with pytest.raises(ValueError, match=message):
        rows_to_arrays(rows)


@pytest.mark.parametrize("label", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_label_names_its_row(label):
    rows = [([0.0, 1.0], 0.5), ([1.0, 1.0], label), ([1.0, 0.0], 1.5)]
    with pytest.raises(ValueError, match=r"^row 1 of the partition has a NaN or infinite label"):
        rows_to_arrays(rows)


def test_integer_labels_and_an_empty_partition_pass():
    features, labels = rows_to_arrays([([1e30, -1e30], 3)])
    assert labels.dtype.kind == "i" and np.isfinite(features).all()
    features, labels = rows_to_arrays([])
    assert features.shape == (0,) and labels.shape == (0,)


def test_row_chunks_convert_a_partition_piece_by_piece_and_name_rows_by_partition_position():
    from sparkdl._internal.data.rows import row_chunks

    rows = [([float(i), 1.0], i % 2) for i in range(10)]
    pieces = list(row_chunks(rows, chunk_rows=4))
    assert [len(piece) for piece in pieces] == [4, 4, 2]
    assert np.concatenate([piece.inputs[0] for piece in pieces])[:, 0].tolist() == list(range(10))
    rows[9] = ([float("nan"), 1.0], 1)
    with pytest.raises(ValueError, match="row 9 of the partition has NaN"):
        list(row_chunks(rows, chunk_rows=4))
