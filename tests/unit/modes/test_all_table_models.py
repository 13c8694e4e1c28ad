"""A model made only of embedding tables (the biased matrix factorisation: user and item embeddings and biases,
the global mean a plain float) trains through the launcher, as the same model with dense embeddings does."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from torch import nn

from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.modes import launcher
from sparkdl.config import TrainConfig
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage

USERS, ITEMS = 300, 400   # 3,500 table values: enough for two PS shards


class BiasedFactorisation(nn.Module):
    """``u . i + b_u + b_i + mean``, every parameter an embedding table."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, 4, sparse=sparse)
        self.items = nn.Embedding(ITEMS, 4, sparse=sparse)
        self.user_bias = nn.Embedding(USERS, 1, sparse=sparse)
        self.item_bias = nn.Embedding(ITEMS, 1, sparse=sparse)
        self.mean = 3.0

    def forward(self, x):
        user, item = x[:, 0].long(), x[:, 1].long()
        return ((self.users(user) * self.items(item)).sum(1) + self.user_bias(user)[:, 0] + self.item_bias(item)[:, 0]
                + self.mean)


def partitions() -> list[list[tuple[np.ndarray, float]]]:
    rng = np.random.default_rng(0)
    return [[(np.array([rng.integers(USERS), rng.integers(ITEMS)], np.float32), float(rng.normal() + 3))
             for _ in range(64)] for _ in range(2)]


def train(monkeypatch, sparse: bool, **settings):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    config = TrainConfig(**{"num_workers": 2, "policy": "sync", "epochs": 2, "batch_size": 8, "loss": "mse",
                            "optimizer": "sgd", "learning_rate": 0.05, "embedding_optimizer": "sgd", "shuffle": False,
                            "seed": 1, "timeout_s": 60, "verbose": False, **settings})
    return launcher._train(LocalBackend(), functools.partial(BiasedFactorisation, sparse), config,
                           local_barrier_stage(partitions()), row_chunks)


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in b)


@pytest.mark.slow
def test_a_model_of_tables_only_trains_as_its_dense_twin_on_the_driver_or_the_executors(monkeypatch):
    dense = train(monkeypatch, sparse=False)
    tables = train(monkeypatch, sparse=True)
    assert tables.summary["updates"] == dense.summary["updates"] > 0
    assert largest_difference(tables.state_dict, dense.state_dict) < 1e-5  # row-wise SGD is SGD
    sharded = train(monkeypatch, sparse=True, ps_hosts="executors", ps_shards=2)
    assert sharded.summary["ps_shards"] == 2 and largest_difference(sharded.state_dict, tables.state_dict) < 1e-6
    learned = train(monkeypatch, sparse=True, policy="async")
    assert learned.summary["updates"] > 0 and largest_difference(learned.state_dict, tables.state_dict) > 0


def test_a_model_with_nothing_to_train_is_refused(monkeypatch):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="the model has no parameters to train"):
        launcher._train(LocalBackend(), nn.ReLU, TrainConfig(num_workers=1), local_barrier_stage([[]]), row_chunks)
