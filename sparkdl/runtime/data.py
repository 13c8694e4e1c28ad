"""RDD partition rows -> numpy feature and label arrays."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch


def _as_vector(value: Any) -> np.ndarray:
    if hasattr(value, "toArray"):          # pyspark.ml.linalg / mllib vectors, dense or sparse
        value = value.toArray()
    elif isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def rows_to_arrays(rows: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Turn ``(features, label)`` rows into a float32 feature matrix and a label vector."""
    features: list[np.ndarray] = []
    labels: list[Any] = []
    for i, row in enumerate(rows):
        try:
            x, y = row
        except (TypeError, ValueError):
            raise ValueError(f"row {i} of the partition is not a (features, label) pair: {row!r:.200}") from None
        if x is None or y is None:
            raise ValueError(f"row {i} of the partition has a null {'features' if x is None else 'label'}")
        vec = _as_vector(x)
        if features and vec.shape != features[0].shape:
            raise ValueError(f"row {i} has features of shape {vec.shape}, but earlier rows have "
                             f"{features[0].shape}; every row needs the same shape")
        features.append(vec)
        labels.append(y)
    if not features:
        return np.zeros((0,), dtype=np.float32), np.zeros((0,), dtype=np.float32)
    matrix, label_array = np.stack(features), np.asarray(labels)
    _check_finite(matrix, label_array)
    return matrix, label_array


def _check_finite(features: np.ndarray, labels: np.ndarray) -> None:
    """Refuse NaN/Inf in features or labels, naming the first offending row of the partition.

    One vectorized pass over the stacked arrays; a non-finite row would otherwise only show up
    as gradients the parameter server skips, and the run would "succeed" on part of the data.
    """
    finite_rows = np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if not finite_rows.all():
        i = int(np.argmin(finite_rows))
        values = np.array2string(features[i].reshape(-1), threshold=8, edgeitems=3)
        raise ValueError(f"row {i} of the partition has NaN or infinite feature values (as float32) "
                         f"({int((~finite_rows).sum())} such rows in this partition; row {i}: {values}); "
                         "drop, clip or impute them before training")
    if labels.dtype.kind in "fc":          # integer and boolean labels are always finite
        finite_labels = np.isfinite(labels.reshape(len(labels), -1)).all(axis=1)
        if not finite_labels.all():
            i = int(np.argmin(finite_labels))
            raise ValueError(f"row {i} of the partition has a NaN or infinite label ({labels[i].tolist()!r}; "
                             f"{int((~finite_labels).sum())} such rows in this partition); drop or fix them "
                             "before training")
