"""Behaviours the parameter server promises, each driven by scripted events and each failing when it is removed:
Zhang et al.'s staleness factor on table rows (async) and on the dense gradient of the buffered path (n-softsync),
local SGD's deltas averaged over several workers, and tables that follow the learning-rate schedule and return
with the best epoch's weights."""
import pytest
import torch

from sparkdl._internal.ps.server.core import PSCore, PushMeta
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.tables import TableSpec
from sparkdl.config import TrainConfig


def core_with_table(**settings) -> tuple[PSCore, list[int], EmbeddingTable]:
    config = TrainConfig(**{"num_workers": 2, "policy": "async", "learning_rate": 0.1, "batch_size": 8,
                            "sample_budget": "per_worker", **settings})
    table = EmbeddingTable(TableSpec("users", rows=10, dim=2, optimizer="sgd"), learning_rate=config.learning_rate,
                           rows=torch.zeros(10, 2))
    core = PSCore(config, torch.zeros(1), tables=[table])
    return core, [core.hello(w, 0, 8 * 100) for w in range(config.num_workers)], table


def push(core: PSCore, worker: int, token: int, computed_on: int, dense: float = 0.0, row: int | None = None,
         value: float = 0.0):
    rows = [] if row is None else [(0, torch.tensor([row]), torch.full((1, 2), value))]
    return core.push(worker, token, PushMeta(computed_on, 8, 1.0, 0), torch.full((1,), dense), True, rows)


def test_async_scales_a_stale_gradients_table_rows_by_one_over_tau():
    """Zhang et al. 2016 (staleness_lr='inverse'): alpha_0 / tau for the rows as for the dense gradient."""
    core, tokens, table = core_with_table(staleness_lr="inverse")
    for _ in range(3):
        push(core, 0, tokens[0], core.version)                    # three updates move the version to 3
    push(core, 1, tokens[1], computed_on=0, dense=1.0, row=4, value=1.0)   # tau = 3
    assert core.log.updates[-1].lr_scale == pytest.approx(1 / 3)
    assert torch.allclose(table.weight[4], torch.full((2,), -0.1 / 3))
    assert core.weights().item() == pytest.approx(-0.1 / 3)


@pytest.mark.parametrize("policy", ["softsync", "softsync_nodes"])
def test_the_buffered_path_scales_a_stale_dense_gradient_by_one_over_tau(policy):
    """n-softsync (Zhang et al.'s rule inside it): the c gradients of an update each take their own factor."""
    core, tokens, _ = core_with_table(policy=policy, softsync_size=2, staleness_lr="inverse")
    push(core, 0, tokens[0], 0)
    push(core, 1, tokens[1], 0)                                   # version 1
    push(core, 0, tokens[0], 1)
    push(core, 1, tokens[1], 1)                                   # version 2
    before = core.weights().item()
    push(core, 0, tokens[0], 2, dense=1.0)                        # fresh: factor 1
    push(core, 1, tokens[1], 0, dense=1.0)                        # tau = 2: factor 1/2
    assert core.version == 3
    assert core.weights().item() - before == pytest.approx(-0.1 * (1.0 + 0.5) / 2)


@pytest.mark.parametrize("policy, settings", [("sync", {}), ("softsync", {"softsync_size": 2})])
def test_local_sgd_averages_several_workers_deltas(policy, settings):
    core, tokens, _ = core_with_table(policy=policy, local_update="sgd", **settings)
    push(core, 0, tokens[0], 0, dense=1.0)
    push(core, 1, tokens[1], 0, dense=3.0)
    assert core.version == 1 and core.weights().item() == pytest.approx(-2.0)   # the mean delta, not the sum


def test_tables_step_at_the_scheduled_learning_rate():
    core, tokens, table = core_with_table(num_workers=1, learning_rate=1.0, lr_warmup_updates=4)
    for step in range(4):
        push(core, 0, tokens[0], core.version, row=step, value=1.0)
    assert [row.lr for row in core.log.updates] == [0.25, 0.5, 0.75, 1.0]
    assert table.weight[:4, 0].tolist() == pytest.approx([-0.25, -0.5, -0.75, -1.0])


def test_restore_best_weights_returns_the_best_epochs_tables_too():
    core, tokens, table = core_with_table(num_workers=1, validation_fraction=0.2, restore_best_weights=True)
    push(core, 0, tokens[0], 0, dense=1.0, row=2, value=1.0)
    core.validation(0, tokens[0], epoch=0, samples=4, loss_sum=4.0, metric_total=0.0)      # the best epoch
    push(core, 0, tokens[0], 1, dense=1.0, row=2, value=1.0)
    core.validation(0, tokens[0], epoch=1, samples=4, loss_sum=8.0, metric_total=0.0)
    assert table.weight[2, 0].item() == pytest.approx(-0.2)                               # the last
    assert core.final_tables()["users"][2, 0].item() == pytest.approx(-0.1)                # the best
    assert core.final_weights().item() == pytest.approx(-0.1)
