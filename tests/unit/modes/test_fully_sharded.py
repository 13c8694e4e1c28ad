"""Fully sharded data parallelism (policy='fsdp') without Spark: real task bodies in local processes over gloo,
checked against allreduce and single-process SGD, and what each worker and the driver hold."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.mode import Mode
from sparkdl._internal.modes import launcher
from sparkdl._internal.modes.allreduce.driver import drive_allreduce
from sparkdl._internal.modes.fully_sharded.driver import drive_fully_sharded
from sparkdl._internal.modes.launch import Launch
from sparkdl._internal.training.fully_sharded import shard_blocks
from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError
from tests.reference import largest_difference, single_process_sgd
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage
from tests.unit.modes.test_drivers import BATCH, CLASSES, FEATURES, ROWS, SETTINGS, data_parts, launch_of, model_fn, rows_of

FSDP = {**SETTINGS, "policy": "fsdp"}


class Scale(nn.Module):
    """A layer with a parameter and no reset_parameters(): the meta device cannot initialise it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def scaled_model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 3))


def wide_model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 64), nn.Tanh(), nn.Linear(64, 3))


@pytest.mark.parametrize("settings, tolerance", [
    ({"optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-3, "learning_rate": 0.05}, 1e-5),
    ({"optimizer": "adamw", "weight_decay": 0.1, "learning_rate": 0.01, "grad_clip_norm": 0.3}, 1e-4),
    ({"optimizer": "sgd", "momentum": 0.9, "learning_rate": 0.1, "lr_schedule": "cosine", "lr_warmup_updates": 5,
      "lr_scaling": "linear"}, 1e-5)],
    ids=["sgd-momentum", "adamw-decay-clipped", "sgd-cosine-warmup-scaled"])
def test_fully_sharded_takes_the_steps_allreduce_takes(settings, tolerance):
    """Same model, data and seed: 48 steps fully sharded and with allreduce agree (the issue's 1e-5 and 1e-4), the
    learning-rate schedule included."""
    epochs = 12
    parts = data_parts(2)
    runs = {}
    for policy, driver in (("fsdp", drive_fully_sharded), ("allreduce", drive_allreduce)):
        config = TrainConfig(**{**SETTINGS, **settings, "policy": policy, "epochs": epochs})
        runs[policy] = driver(launch_of(config, [rows_of(p) for p in parts], LocalBackend()))
    fsdp, allreduce = runs["fsdp"], runs["allreduce"]
    assert fsdp.summary["updates"] == allreduce.summary["updates"] == epochs * ROWS // BATCH
    assert largest_difference(fsdp.state_dict, allreduce.state_dict) < tolerance
    assert list(fsdp.state_dict) == list(allreduce.state_dict)
    assert fsdp.summary["mode"] == Mode.FULLY_SHARDED.value
    # the losses the two report are the same steps' losses, at the same rates
    assert np.allclose(fsdp.history["loss"], allreduce.history["loss"], atol=1e-4)
    assert np.allclose(fsdp.history["lr"], allreduce.history["lr"])


class SharesRecorded(LocalBackend):
    """A local backend that keeps the size of what the driver shares with the tasks (the job spec)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def share(self, data: bytes) -> Any:
        self.sizes.append(len(data))
        return super().share(data)


def test_each_worker_holds_its_shards_only_and_the_driver_neither_builds_nor_ships_the_model(monkeypatch):
    launches: list[Launch] = []
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    monkeypatch.setitem(launcher.DRIVERS, Mode.FULLY_SHARDED,
                        lambda launch: launches.append(launch) or drive_fully_sharded(launch))
    config = TrainConfig(**FSDP)
    parts = data_parts(2)
    backend = SharesRecorded()
    result = launcher._train(backend, wide_model_fn, config, local_barrier_stage([rows_of(p) for p in parts]),
                             functools.partial(row_chunks, rules=DataRules()))
    (launch,) = launches
    assert all(p.is_meta for p in launch.template.parameters())   # the driver's template holds no weights
    total = sum(p.numel() for p in wide_model_fn().parameters())
    # the job spec carries the settings and the factory, not the 37,827 parameters' 151 KB
    assert backend.sizes and max(backend.sizes) < total
    held = [w["sharded_parameters"] for w in result.workers]
    assert sum(held) == total and max(held) <= total // 2 + 512, held
    _, final = single_process_sgd(wide_model_fn, parts, BATCH, ROWS // BATCH, config.epochs, config.learning_rate,
                                  config.seed)
    assert largest_difference(result.state_dict, final) < 1e-5


class Tied(nn.Module):
    """Two layers sharing one weight (as a language model's embedding and output layer do)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, FEATURES)
        self.middle = nn.Sequential(nn.Tanh(), nn.Linear(FEATURES, FEATURES))
        self.middle[1].weight = self.first.weight
        self.last = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(self.first(x))))


class OwnAndChildren(nn.Module):
    """Parameters of its own, made after its child's: the meta device cannot know that order."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(FEATURES, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, CLASSES)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(x) + self.bias))


class ScaledLinear(nn.Linear):
    """A layer with a buffer computed in __init__ (as rotary frequencies are), which reset_parameters() leaves."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__(features, out)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.scale)


def made_buffer_fn() -> nn.Module:
    return nn.Sequential(ScaledLinear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


@pytest.mark.parametrize("factory", [scaled_model_fn, Tied, OwnAndChildren, made_buffer_fn],
                         ids=["no-reset-parameters", "tied-weights", "own-and-children", "made-buffer"])
def test_a_model_the_meta_device_cannot_initialise_is_built_whole_then_sharded_from_the_same_start(factory):
    config = TrainConfig(**FSDP)
    parts = data_parts(2)
    launch = launch_of(config, [rows_of(p) for p in parts], LocalBackend())
    result = drive_fully_sharded(Launch(launch.backend, factory, config, launch.run_barrier_stage,
                                        launch.read_chunks, factory(), launch.started))
    _, final = single_process_sgd(factory, parts, BATCH, ROWS // BATCH, config.epochs, config.learning_rate,
                                  config.seed)
    assert list(result.state_dict) == list(final)   # a tied weight under both its names
    assert largest_difference(result.state_dict, final) < 1e-5


def test_a_scalar_parameter_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)

    class Temperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.temperature = model_fn(), nn.Parameter(torch.tensor(1.0))

    with pytest.raises(ValueError, match=r"\['temperature'\] are 0-dim: make them 1-element tensors"):
        launcher._train(LocalBackend(), Temperature, TrainConfig(**FSDP), local_barrier_stage([[], []]), row_chunks)


def test_bf16_mixed_computes_in_bfloat16_and_keeps_float32_master_weights():
    parts = data_parts(2)
    runs = {}
    for precision in ("32", "bf16-mixed"):
        config = TrainConfig(**{**FSDP, "precision": precision, "epochs": 4})
        runs[precision] = drive_fully_sharded(launch_of(config, [rows_of(p) for p in parts], LocalBackend()))
    mixed, full = runs["bf16-mixed"].state_dict, runs["32"].state_dict
    assert all(v.dtype == torch.float32 for v in mixed.values())
    # bfloat16 forward and backward (8 bits of mantissa) move the weights off the float32 run, not far
    assert 1e-5 < largest_difference(mixed, full) < 0.05
    losses = runs["bf16-mixed"].history["loss"]
    assert losses.iloc[-4:].mean() < losses.iloc[:4].mean()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_are_a_containers_members_or_the_classes_named_and_never_nested():
    model = Tiny()
    assert shard_blocks(model, None) == list(model.blocks)   # not the Sequential inside each block
    assert shard_blocks(model, "Block, Embedding") == [model.embed, *model.blocks]
    assert shard_blocks(model, "Linear") == [model.blocks[0].mlp[0], model.blocks[0].mlp[2], model.blocks[1].mlp[0],
                                             model.blocks[1].mlp[2], model.head]
    with pytest.raises(ValueError, match=r"shard_blocks names \['TransformerBlock'\], which the model does not use"):
        shard_blocks(model, "TransformerBlock")


def regrouped(parts: list[tuple[np.ndarray, np.ndarray]], workers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The rows of ``parts`` (2 partitions, batches of BATCH) cut into ``workers`` partitions whose batches of
    BATCH x 2 / workers together hold the same rows as the 2 partitions' batches: the same global batches."""
    if workers == 2:
        return parts
    share = BATCH * 2 // workers
    cut = []
    for x, y in parts:
        for piece in range(workers // 2):
            take = np.concatenate([np.arange(k * BATCH + piece * share, k * BATCH + (piece + 1) * share)
                                   for k in range(ROWS // BATCH)])
            cut.append((x[take], y[take]))
    return cut


def fsdp_run(workers: int, epochs: int, **settings: Any) -> Any:
    config = TrainConfig(**{**FSDP, "num_workers": workers, "batch_size": BATCH * 2 // workers, "epochs": epochs,
                            "momentum": 0.9, **settings})
    parts = regrouped(data_parts(2), workers)
    return drive_fully_sharded(launch_of(config, [rows_of(p) for p in parts], LocalBackend()))


@pytest.mark.parametrize("first, then", [(2, 4), (4, 2)])
def test_a_sharded_checkpoint_resumes_on_another_number_of_workers_as_if_undisturbed(tmp_path, first, then):
    """fp32 SGD with momentum: 2 epochs on ``first`` workers, a checkpoint, 2 more on ``then`` workers with the
    same global batch: the weights and every later step's loss of one undisturbed 4-epoch run."""
    undisturbed = fsdp_run(2, 4)
    before = fsdp_run(first, 2, checkpoint_dir=str(tmp_path), checkpoint_keep=1)
    assert before.summary["checkpoints_written"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["fsdp-epoch-000001"]   # the older one pruned
    after = fsdp_run(then, 4, resume_from=str(tmp_path))
    assert after.summary["resumed_from_version"] == 2 * ROWS // BATCH and after.summary["updates"] == 2 * ROWS // BATCH
    assert largest_difference(after.state_dict, undisturbed.state_dict) < 1e-5
    assert np.allclose(after.history["loss"], undisturbed.history["loss"].iloc[-len(after.history):], atol=1e-5)
    # and the resumed part moved the weights: it did not just load the end of the undisturbed run
    assert largest_difference(before.state_dict, undisturbed.state_dict) > 1e-3


def test_a_run_prunes_only_its_own_checkpoints_and_rewrites_an_epoch_it_finds(tmp_path):
    earlier = tmp_path / "fsdp-epoch-000009"
    earlier.mkdir()
    (earlier / ".metadata").write_bytes(b"an earlier run's")
    stale = tmp_path / "fsdp-epoch-000001"
    stale.mkdir()
    (stale / "__9_0.distcp").write_bytes(b"a failed attempt's")
    fsdp_run(2, 3, checkpoint_dir=str(tmp_path), checkpoint_keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp-epoch-000002", "fsdp-epoch-000009"]
    fsdp_run(2, 2, checkpoint_dir=str(tmp_path), checkpoint_keep=2)
    assert not (tmp_path / "fsdp-epoch-000001" / "__9_0.distcp").exists()


def test_a_checkpoint_of_another_global_batch_is_refused_before_launch(tmp_path):
    fsdp_run(2, 1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"global batch of 16 rows; this run's is batch_size x num_workers = 4 x 2"):
        drive_fully_sharded(launch_of(TrainConfig(**{**FSDP, "batch_size": 4, "resume_from": str(tmp_path)}),
                                      [rows_of(p) for p in data_parts(2)], LocalBackend()))


class FailsOnce(nn.Module):
    """The drivers' model, whose rank 0 fails at its ``at``-th forward unless ``marker`` exists (then made)."""

    def __init__(self, marker: str, at: int) -> None:
        super().__init__()
        self.net = model_fn()
        self.marker, self.at, self.calls = Path(marker), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and torch.distributed.get_rank() == 0 and not self.marker.exists():
            self.marker.touch()
            raise RuntimeError("worker 0 lost (injected)")
        return self.net(x)


def test_a_failed_attempt_resumes_from_the_runs_newest_checkpoint(tmp_path):
    """Rank 0 fails in epoch 2 of 4; the second attempt loads this run's checkpoint of epoch 1 (not an earlier
    run's found in the directory) and trains epochs 2-3."""
    steps = ROWS // BATCH
    runs = {}
    for name, marker in (("undisturbed", tmp_path / "never.marker"), ("failed", tmp_path / "failed.marker")):
        if name == "undisturbed":
            marker.touch()
        factory = functools.partial(FailsOnce, str(marker), 2 * steps + 2)
        earlier = tmp_path / name / "fsdp-epoch-000009"   # an earlier run's, newer by epoch: not this run's
        earlier.mkdir(parents=True)
        (earlier / ".metadata").write_bytes(b"an earlier run's")
        config = TrainConfig(**{**FSDP, "epochs": 4, "momentum": 0.9, "checkpoint_dir": str(tmp_path / name)})
        launch = launch_of(config, [rows_of(p) for p in data_parts(2)], LocalBackend())
        runs[name] = drive_fully_sharded(Launch(launch.backend, factory, config, launch.run_barrier_stage,
                                                launch.read_chunks, factory(), launch.started))
    failed, undisturbed = runs["failed"], runs["undisturbed"]
    assert failed.summary["attempts"] == 2 and undisturbed.summary["attempts"] == 1
    assert failed.summary["resumed_from_version"] == 2 * steps and failed.summary["updates"] == 2 * steps
    assert largest_difference(failed.state_dict, undisturbed.state_dict) < 1e-5


def layers_model_fn() -> nn.Module:
    """Seven 64 x 64 layers of 4,160 parameters between two small ones: 29,763 in all, 238 KB of weights and
    gradient."""
    return nn.Sequential(nn.Linear(FEATURES, 64), *[nn.Linear(64, 64) for _ in range(7)], nn.Linear(64, CLASSES))


def test_a_model_whose_replicas_exceed_the_task_memory_trains_sharded_and_the_need_is_counted(monkeypatch):
    """Under a 230 KiB task limit the replicas of allreduce (238 KB) are refused; 2 fsdp workers need their half of
    the weights, gradient and momentum plus one gathered layer (229 KB), and train; 1 fsdp worker is refused with
    its numbers, and so are 2 under a limit that only their halves would fit."""
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    parts = data_parts(2)

    def fit(limit: str = "230k", **settings: Any) -> Any:
        config = TrainConfig(**{**SETTINGS, "momentum": 0.9, **settings})
        return launcher._train(LocalBackend({"spark.executor.pyspark.memory": limit}), layers_model_fn, config,
                               local_barrier_stage([rows_of(p) for p in parts][:config.num_workers]),
                               functools.partial(row_chunks, rules=DataRules()))

    with pytest.raises(ClusterConfigError, match="its weights and gradient alone take 0 MiB"):
        fit(policy="allreduce")
    with pytest.raises(ClusterConfigError, match=r"each of the 1 fsdp workers needs 0\.4 MiB .* 29,763 parameters' "
                                                 r"weights, gradient and optimizer state \(0\.3 MiB\) and the largest "
                                                 r"block's 4,160 parameters .*\(num_workers >= 2\)"):
        fit(policy="fsdp", num_workers=1)
    # 200 KiB: the halves (179 KB) would fit, the gathered layer (50 KB) on top does not
    with pytest.raises(ClusterConfigError, match=r"each of the 2 fsdp workers needs 0\.2 MiB"):
        fit("200k", policy="fsdp")
    result = fit(policy="fsdp")
    assert sum(w["sharded_parameters"] for w in result.workers) == 29_763


_FREED_BLOCKS = """
import sys
import torch
from sparkdl._internal.memory import return_large_blocks_when_freed, rss_bytes
if sys.argv[1] == "fixed":
    assert return_large_blocks_when_freed()
torch.set_num_threads(1)
start = rss_bytes()
block = torch.ones(4 << 20)     # a 16 MiB block, mapped and freed: glibc then keeps blocks below 16 MiB in its heap
del block
gathered = [torch.ones(2 << 20) for _ in range(20)]    # twenty 8 MiB blocks, as a step's gathered layers
del gathered
print((rss_bytes() - start) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_blocks_freed_by_a_fully_sharded_worker_leave_its_resident_memory():
    def kept_mib(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _FREED_BLOCKS, mode], capture_output=True, text=True, check=True)
        return int(done.stdout.split()[-1])

    # glibc's own threshold kept 17-161 MiB of the 160 MiB freed here resident (why it is fixed); fixed, none
    assert kept_mib("fixed") <= 8
