"""Plain SGD in one process: the reference that a synchronous pipeline's replicas must reproduce exactly.

Shared by tests/integration/test_pipeline.py and the script tests/e2e/pipeline_run.py.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn


def single_process_sgd(model_fn: Callable[[], nn.Module], parts: list[tuple[np.ndarray, np.ndarray]], batch: int,
                       steps: int, epochs: int, learning_rate: float, seed: int) -> tuple[dict, dict]:
    """The model's initial and final weights after plain SGD over ``epochs`` x ``steps`` steps, step k on
    batch k of every part side by side (one part per replica, each read in order)."""
    torch.manual_seed(seed)
    model = model_fn()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in parts]
    for _ in range(epochs):
        for k in range(steps):
            optimizer.zero_grad()
            xb = torch.cat([x[k * batch:(k + 1) * batch] for x, _ in tensors])
            yb = torch.cat([y[k * batch:(k + 1) * batch] for _, y in tensors])
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return initial, model.state_dict()


def largest_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' tensors of the same names."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)
