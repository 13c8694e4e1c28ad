"""Small model factories used by the jobs, benchmarks and examples."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["mlp", "lenet", "AsImages", "BiasedMF", "BagOfEmbeddings", "TabularEmbeddings", "MODELS"]


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


class BiasedMF(nn.Module):
    """Biased matrix factorisation (Koren, Bell & Volinsky 2009): rating = mu + b_u + b_i + p_u . q_i.

    ``forward(user, item)`` takes int64 ids ``[batch]`` and returns ``[batch]`` predictions.
    """

    def __init__(self, users: int, items: int, dim: int = 32, mean: float = 0.0, sparse: bool = False) -> None:
        """``sparse``: the four tables are embedding tables the parameter server holds as rows (only the rows a
        batch touches are pulled and pushed)."""
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim, sparse=sparse), nn.Embedding(items, dim, sparse=sparse)
        self.user_bias, self.item_bias = nn.Embedding(users, 1, sparse=sparse), nn.Embedding(items, 1, sparse=sparse)
        nn.init.normal_(self.user.weight, std=0.05)
        nn.init.normal_(self.item.weight, std=0.05)
        nn.init.zeros_(self.user_bias.weight)
        nn.init.zeros_(self.item_bias.weight)
        self.mean = nn.Parameter(torch.tensor(float(mean)))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        dot = (self.user(user) * self.item(item)).sum(dim=1)
        return dot + self.user_bias(user)[:, 0] + self.item_bias(item)[:, 0] + self.mean


class BagOfEmbeddings(nn.Module):
    """Text classifier: the mean of a sequence's token embeddings (padding masked out), then an MLP.

    ``forward(ids, ids_mask=None)``: ``ids`` int64 ``[batch, length]`` padded per batch; the mask is
    True at real tokens (without it, id 0 counts as padding).
    """

    def __init__(self, vocabulary: int, dim: int = 64, hidden: int = 64, num_classes: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, ids: torch.Tensor, ids_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = (ids != 0) if ids_mask is None else ids_mask
        weights = mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        pooled = (self.embedding(ids) * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        return self.head(pooled)


class TabularEmbeddings(nn.Module):
    """Categorical columns through one embedding each, concatenated with the numeric features, then an MLP.

    ``forward(*categories, numeric)``: one int64 ``[batch]`` id tensor per entry of ``cardinalities``,
    then a float ``[batch, numeric_features]`` tensor.
    """

    def __init__(self, cardinalities: Sequence[int], numeric_features: int, dim: int = 8,
                 hidden: Sequence[int] = (64, 32), num_classes: int = 1) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, dim) for n in cardinalities)
        self.head = mlp(dim * len(cardinalities) + numeric_features, hidden, num_classes)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *categories, numeric = inputs
        parts = [embedding(ids) for embedding, ids in zip(self.embeddings, categories, strict=True)]
        return self.head(torch.cat([*parts, numeric.to(parts[0].dtype)], dim=1))


MODELS = {"mlp": mlp, "lenet": lenet, "biased_mf": BiasedMF, "bag_of_embeddings": BagOfEmbeddings,
          "tabular_embeddings": TabularEmbeddings}
