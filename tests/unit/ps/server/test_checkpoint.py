"""Atomic checkpoints: interrupted writes never damage what was there; restore is exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparkdl._internal.ps.server import checkpoint
from sparkdl._internal.ps.server.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl.config import TrainConfig


def state(version: int) -> dict:
    return {"version": version, "weights": torch.full((8,), float(version))}


def test_keeps_the_newest_and_loads_the_latest(tmp_path):
    for version in (10, 20, 30, 40):
        save_checkpoint(tmp_path, state(version), keep=2)
    assert [Path(p).name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000030.pt", "ckpt-000000000040.pt"]
    latest = load_latest_checkpoint(tmp_path)
    assert latest["version"] == 40 and torch.equal(latest["weights"], torch.full((8,), 40.0))


def test_a_write_interrupted_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(10))
    real_save = torch.save

    def crash_half_way(obj, handle):
        real_save(obj, handle)
        handle.truncate(handle.tell() // 2)     # half the bytes reached the disk ...
        raise OSError("No space left on device")  # ... then the write died

    monkeypatch.setattr(checkpoint.torch, "save", crash_half_way)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, state(20))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000000010.pt"]   # no temp file left behind
    assert load_latest_checkpoint(tmp_path)["version"] == 10


def test_a_damaged_newest_file_falls_back_to_the_previous(tmp_path):
    save_checkpoint(tmp_path, state(10))
    good = save_checkpoint(tmp_path, state(20))
    data = Path(good).read_bytes()
    (tmp_path / "ckpt-000000000030.pt").write_bytes(data[: len(data) // 3])   # e.g. a half-finished copy
    assert load_latest_checkpoint(tmp_path)["version"] == 20
    assert load_latest_checkpoint(tmp_path / "missing") is None


def test_server_restores_weights_optimizer_version_and_positions(tmp_path):
    config = TrainConfig(num_workers=2, policy="async", optimizer="adam", learning_rate=0.1,
                         checkpoint_dir=str(tmp_path))
    first = ParameterServer(config, torch.zeros(4), b"k" * 32)
    first.core.optimizer.step(torch.ones(4))
    first.core.policy.version = 7
    first.core.members.slots[0].consumed, first.core.members.slots[1].consumed = 4, 3
    first.write_checkpoint()
    second = ParameterServer(config, torch.zeros(4), b"k" * 32)
    second.restore(load_latest_checkpoint(tmp_path))
    assert second.version == 7 and second.positions() == [4, 3]
    assert torch.equal(second.weights(), first.weights())
    moment = second.core.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moment, first.core.optimizer.state_dict()["state"][0]["exp_avg"])
    wrong = ParameterServer(config.replace(num_workers=3), torch.zeros(4), b"k" * 32)
    with pytest.raises(ValueError, match="run with 2 workers"):
        wrong.restore(load_latest_checkpoint(tmp_path))
