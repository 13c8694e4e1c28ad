"""Embedding tables trained through the launcher on a local barrier stage (no Spark): lazy Adam over 2 and 3 PS
shards equals torch.optim.SparseAdam and the driver's single PS, over steps where some shards get no rows, and a
sharded run resumed from a checkpoint continues as the undisturbed one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.modes import launcher
from sparkdl._internal.ps.server.checkpoint import checkpoint_path
from sparkdl.config import TrainConfig
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage

WORKERS, BATCH, STEPS, IDS = 3, 4, 6, 600   # 3,600 table values: enough for 3 shards


class Pairs(nn.Module):
    """A score from a user and an item id (carried as float features), each looked up in a sparse table."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(IDS, 3, sparse=True)
        self.items = nn.Embedding(IDS, 3, sparse=True)
        self.out = nn.Linear(3, 1)

    def forward(self, x):
        return self.out(self.users(x[:, 0].long()) * self.items(x[:, 1].long()))[:, 0]


def partitions() -> list[list[tuple[np.ndarray, float]]]:
    """Every worker's rows; in odd steps every id is a multiple of 6, so shards 1 (of 2) and 1, 2 (of 3) get none."""
    rng = np.random.default_rng(11)
    parts = []
    for _ in range(WORKERS):
        rows = []
        for step in range(STEPS):
            pool = np.arange(0, IDS, 6) if step % 2 else np.arange(IDS)
            for _ in range(BATCH):
                ids = rng.choice(pool, size=2).astype(np.float32)
                rows.append((ids, float(rng.normal())))
        parts.append(rows)
    return parts


def config(**settings) -> TrainConfig:
    return TrainConfig(**{"num_workers": WORKERS, "policy": "sync", "epochs": 1, "batch_size": BATCH, "loss": "mse",
                          "optimizer": "adam", "learning_rate": 0.05, "embedding_optimizer": "lazy_adam",
                          "shuffle": False, "seed": 4, "timeout_s": 60, "verbose": False, **settings})


def train_locally(monkeypatch, run_config: TrainConfig):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    return launcher._train(LocalBackend(), Pairs, run_config, local_barrier_stage(partitions()), row_chunks)


def sparse_adam_reference(run_config: TrainConfig) -> dict[str, torch.Tensor]:
    """One process: each step on the workers' batches side by side, SparseAdam on the tables, Adam on the rest."""
    torch.manual_seed(run_config.seed)
    model = Pairs()
    tables = [model.users.weight, model.items.weight]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    optimizers = [torch.optim.SparseAdam(tables, lr=run_config.learning_rate),
                  torch.optim.Adam(dense, lr=run_config.learning_rate)]
    parts = partitions()
    for step in range(STEPS):
        rows = [row for part in parts for row in part[step * BATCH:(step + 1) * BATCH]]
        x = torch.from_numpy(np.stack([features for features, _ in rows]))
        y = torch.tensor([label for _, label in rows], dtype=torch.float32)
        for optimizer in optimizers:
            optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for optimizer in optimizers:
            optimizer.step()
    return model.state_dict()


def largest_difference(state: dict, reference: dict, names: tuple[str, ...]) -> float:
    return max(float((state[name] - reference[name]).abs().max()) for name in names)


TABLES = ("users.weight", "items.weight")
DENSE = ("out.weight", "out.bias")


@pytest.mark.slow
def test_lazy_adam_over_shards_equals_sparse_adam_and_the_single_ps(monkeypatch):
    reference = sparse_adam_reference(config())
    single = train_locally(monkeypatch, config())
    assert largest_difference(single.state_dict, reference, TABLES) < 1e-6
    assert largest_difference(single.state_dict, reference, DENSE) < 1e-5
    for shards in (2, 3):
        sharded = train_locally(monkeypatch, config(ps_hosts="executors", ps_shards=shards))
        assert sharded.summary["ps_shards"] == shards and sharded.summary["updates"] == STEPS
        assert largest_difference(sharded.state_dict, single.state_dict, TABLES + DENSE) < 1e-6, shards


@pytest.mark.slow
def test_a_sharded_lazy_adam_run_resumed_from_a_checkpoint_continues_as_the_undisturbed_one(monkeypatch, tmp_path):
    sharded = config(ps_hosts="executors", ps_shards=2)
    whole = train_locally(monkeypatch, sharded.replace(checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=3))
    (tmp_path / "mid").mkdir()
    checkpoint_path(tmp_path / "mid", 3).write_bytes(checkpoint_path(tmp_path / "whole", 3).read_bytes())
    resumed = train_locally(monkeypatch, sharded.replace(resume_from=str(tmp_path / "mid")))
    assert resumed.summary["resumed_from_version"] == 3
    assert largest_difference(resumed.state_dict, whole.state_dict, TABLES + DENSE) < 1e-6
