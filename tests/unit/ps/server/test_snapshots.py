"""Snapshots driven by scripted updates: when one is due, what a "changed" snapshot carries, and the restore of
one (with its refusals of another model's or another run's checkpoint)."""
import pytest
import torch

from sparkdl._internal.ps.server.core import PSCore, PushMeta
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.tables import TableSpec
from sparkdl.config import TrainConfig


def make_core(tmp_path, **settings) -> PSCore:
    config = TrainConfig(**{"num_workers": 1, "policy": "async", "learning_rate": 0.1, "checkpoint_dir": str(tmp_path),
                            "checkpoint_every": 2, **settings})
    table = EmbeddingTable(TableSpec("emb", rows=6, dim=2, optimizer="sgd"), learning_rate=0.1)
    return PSCore(config, torch.zeros(3), tables=[table])


def step(core: PSCore, token: int, row: int) -> None:
    rows = [(0, torch.tensor([row]), torch.ones(1, 2))]
    core.push(0, token, PushMeta(core.version, 4, 1.0, 0), torch.ones(3), True, rows)


def test_a_snapshot_is_due_at_every_checkpoint_version_and_taken_once(tmp_path):
    core = make_core(tmp_path)
    token = core.hello(0, 0, 16)
    step(core, token, 1)
    assert core.snapshots.take_due() is None
    step(core, token, 2)
    due = core.snapshots.take_due()
    assert due["version"] == 2 and due["consumed"] == [2] and due["samples_consumed"] == 8
    assert torch.equal(due["weights"], torch.full((3,), -0.2)) and due["tables"][0]["steps"] == 2
    assert core.snapshots.take_due() is None


def test_a_changed_snapshot_carries_the_rows_changed_since_the_previous_one(tmp_path):
    core = make_core(tmp_path)
    core.snapshots.table_changes_only = True
    token = core.hello(0, 0, 16)
    step(core, token, 1)
    step(core, token, 2)
    first = core.snapshots.take_due()
    step(core, token, 4)
    step(core, token, 4)
    second = core.snapshots.take_due()
    assert first["tables"][0]["rows"].tolist() == [1, 2] and first["tables_after"] == 0
    assert second["tables"][0]["rows"].tolist() == [4] and second["tables_after"] == 2
    since_start = core.snapshots.take("since_start")
    assert since_start["tables"][0]["rows"].tolist() == [1, 2, 4]


def test_a_restore_continues_the_run_and_refuses_another_models_checkpoint(tmp_path):
    core = make_core(tmp_path)
    token = core.hello(0, 0, 16)
    for row in (1, 2, 3):
        step(core, token, row)
    saved = core.snapshots.take()
    resumed = make_core(tmp_path)
    resumed.snapshots.restore(saved)
    assert resumed.version == 3 and resumed.members.positions() == [3] and resumed.members.samples_consumed == 12
    assert torch.equal(resumed.weights(), core.weights()) and torch.equal(resumed.tables[0].weight, core.tables[0].weight)
    assert resumed.stats.updates == 3 and [e["event"] for e in resumed.log.events] == ["resumed"]
    with pytest.raises(ValueError, match="another model"):
        PSCore(resumed.config, torch.zeros(4)).snapshots.restore(saved)
    with pytest.raises(ValueError, match="num_workers=1"):
        PSCore(resumed.config.replace(num_workers=2), torch.zeros(3), tables=resumed.tables).snapshots.restore(saved)
