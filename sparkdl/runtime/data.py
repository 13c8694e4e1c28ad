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
    return np.stack(features), np.asarray(labels)
