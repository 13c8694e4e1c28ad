"""A third-party trainer through TorchDistributor: PyTorch Lightning's DDP across two Spark tasks (local[2])."""
from __future__ import annotations

import math

import pytest

import sparkdl

pl = pytest.importorskip("pytorch_lightning")

BATCH_SIZE = 32


def digits_split():
    """scikit-learn digits scaled to [0, 1], the conftest's stratified 80/20 split (each rank loads its own)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=0, stratify=y)


def lightning_fit(root_dir: str, epochs: int, seed: int = 0) -> dict:
    """A plain Lightning script: one LightningModule, a Trainer sized from the torchrun variables, fit."""
    import logging
    import os
    import warnings

    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class DigitsMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    x_train, x_test, y_train, y_test = digits_split()
    torch.manual_seed(seed)
    model = DigitsMLP()
    # a plain shuffled loader: under DDP Lightning replaces its sampler with a DistributedSampler
    loader = DataLoader(TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
                        batch_size=BATCH_SIZE, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), strategy="ddp", max_epochs=epochs,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, default_root_dir=root_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # "few dataloader workers" and the like
            trainer.fit(model, loader)
        # every rank's view, collected over the process group Lightning formed
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        views = [None] * trainer.world_size
        dist.all_gather_object(views, (trainer.global_rank, float(params.sum()), float(params.norm())))
        with torch.no_grad():
            predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
        return {"global_rank": trainer.global_rank, "world_size": trainer.world_size,
                "environment": type(trainer.strategy.cluster_environment).__name__,
                "batches_per_epoch": trainer.num_training_batches, "views": views,
                "accuracy": float((predicted == y_test).mean()),
                "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    finally:
        if dist.is_initialized():                 # Spark reuses its Python workers
            dist.destroy_process_group()


def test_lightning_trains_with_ddp_across_two_spark_tasks(spark, tmp_path):
    x_train = digits_split()[0]
    one_process = math.ceil(len(x_train) / BATCH_SIZE)                      # 45 batches
    per_rank = math.ceil(math.ceil(len(x_train) / 2) / BATCH_SIZE)          # 23: the DistributedSampler's half

    result = sparkdl.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        lightning_fit, str(tmp_path), 5)

    # one DDP run across the two tasks, not two single-process runs
    assert result["environment"] == "TorchElasticEnvironment"
    assert (result["global_rank"], result["world_size"]) == (0, 2)
    assert result["batches_per_epoch"] == per_rank < one_process
    ranks = [view[0] for view in result["views"]]
    assert ranks == [0, 1]
    # every rank ends with the same weights, as DDP keeps them
    assert all(view[1:] == pytest.approx(result["views"][0][1:], rel=1e-6) for view in result["views"])
    # the model learns: 0.947 measured on the held-out 20% (5 epochs, seed 0; 0.944-0.953 over seeds 0-2)
    assert result["accuracy"] >= 0.85
    assert set(result["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert not any(tmp_path.iterdir())          # no logs, no checkpoints
