"""Small model factories used by the jobs, benchmarks and examples."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def mlp(in_features: int = 784, hidden: Sequence[int] = (256, 128), num_classes: int = 10) -> nn.Module:
    """A ReLU multi-layer perceptron, e.g. the 784-256-128-10 MNIST network."""
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class AsImages(nn.Module):
    """Reshape each row to ``shape`` (flat pixel rows and decoded image batches alike)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(len(x), *self.shape)


def lenet(num_classes: int = 10) -> nn.Module:
    """A small convolutional network for 1x28x28 images (flat 784 inputs are reshaped)."""
    return nn.Sequential(
        AsImages(1, 28, 28),
        nn.Conv2d(1, 8, 5, padding=2), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, num_classes),
    )


MODELS = {"mlp": mlp, "lenet": lenet}
