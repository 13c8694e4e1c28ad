"""A weight column across workers: under sync the PS (under allreduce and fsdp the workers) averages the workers' gradients by their rows' weight sums,
so two workers whose batches weigh differently train as one process's weighted big-batch SGD."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.modes import launcher
from sparkdl.config import TrainConfig
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage

ROWS, BATCH, FEATURES = 16, 4, 3


def model_fn() -> nn.Module:
    return nn.Linear(FEATURES, 1)


def partitions() -> list[list[tuple[np.ndarray, float, float]]]:
    """Two workers' (features, label, weight) rows; the second worker's rows weigh far more than the first's."""
    rng = np.random.default_rng(2)
    return [[(rng.normal(size=FEATURES).astype(np.float32), float(rng.normal()), float(scale * rng.uniform(0.1, 2)))
             for _ in range(ROWS)] for scale in (1.0, 10.0)]


def weighted_big_batch_sgd(config: TrainConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(config.seed)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    parts = partitions()
    for _ in range(config.epochs):
        for step in range(ROWS // BATCH):
            rows = [row for part in parts for row in part[step * BATCH:(step + 1) * BATCH]]
            x = torch.from_numpy(np.stack([r[0] for r in rows]))
            y = torch.tensor([r[1] for r in rows])
            w = torch.tensor([r[2] for r in rows])
            optimizer.zero_grad()
            ((model(x)[:, 0] - y) ** 2 * w).sum().div(w.sum()).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("policy", ["sync", "allreduce", "fsdp"])
def test_each_workers_gradient_weighs_its_rows_weight_sum(monkeypatch, policy):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    config = TrainConfig(num_workers=2, policy=policy, epochs=2, batch_size=BATCH, loss="mse", optimizer="sgd",
                         learning_rate=0.1, shuffle=False, seed=6, timeout_s=60, verbose=False)
    result = launcher._train(LocalBackend(), model_fn, config, local_barrier_stage(partitions()), row_chunks)
    expected = weighted_big_batch_sgd(config)
    for name, value in expected.items():
        assert float((result.state_dict[name] - value).abs().max()) < 1e-5, name
