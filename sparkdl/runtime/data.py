"""Partition rows -> numpy arrays -> tensors, and the per-epoch mini-batch order."""
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


def labels_for_loss(labels: np.ndarray, loss: object) -> np.ndarray:
    """Class indices (int64) for cross-entropy, float32 targets otherwise."""
    if loss == "cross_entropy":
        return labels.astype(np.int64, copy=False)
    return labels.astype(np.float32, copy=False)


def epoch_order(n: int, epoch: int, seed: int, worker: int, shuffle: bool, length: int) -> torch.Tensor:
    """``length`` sample indices for one epoch: a seeded permutation of ``range(n)``, wrapped around."""
    if shuffle:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + worker) * 1_009 + epoch)
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    if length > n:
        order = order.repeat((length + n - 1) // n)
    return order[:length]
