"""Embedding tables in shared memory (shared_tables, Hogwild) through the launcher on a local barrier stage (no
Spark): one worker steps its rows exactly as the PS would, with no message for them; several workers step one
table with no round trip but the push, and every worker's steps are counted."""
from __future__ import annotations

import pytest
import torch

from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.modes import launcher
from sparkdl._internal.ps.server.checkpoint import checkpoint_path
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire.shared_tables import SharedTable, table_file_name
from sparkdl._internal.ps.worker.shared_rows import SharedRows
from sparkdl.config import TrainConfig
from tests.unit.conftest import SECRET, connect, rows_steps_against
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage
from tests.unit.modes.test_tables_over_shards import DENSE, STEPS, TABLES, WORKERS, Pairs, largest_difference, partitions


def async_config(**settings) -> TrainConfig:
    return TrainConfig(**{"num_workers": WORKERS, "policy": "async", "epochs": 1, "batch_size": 4, "loss": "mse",
                          "optimizer": "adam", "learning_rate": 0.05, "embedding_optimizer": "lazy_adam",
                          "shuffle": False, "seed": 4, "timeout_s": 60, "verbose": False, **settings})


def train_locally(monkeypatch, run_config: TrainConfig, workers: int = WORKERS):
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    return launcher._train(LocalBackend(), Pairs, run_config, local_barrier_stage(partitions()[:workers]), row_chunks)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy_adam", "adagrad"])
def test_one_worker_steps_shared_tables_as_the_ps_steps_their_pushed_rows(monkeypatch, optimizer):
    one = async_config(num_workers=1, embedding_optimizer=optimizer, lr_schedule="cosine")
    pushed = train_locally(monkeypatch, one, workers=1)
    shared = train_locally(monkeypatch, one.replace(shared_tables=True), workers=1)
    assert pushed.summary["shared_tables_workers"] == 0 and shared.summary["shared_tables_workers"] == 1
    # the same updates, at the same (scheduled) rates and lazy Adam step counts: only where they run differs
    assert largest_difference(shared.state_dict, pushed.state_dict, TABLES + DENSE) < 1e-6
    # no table row travels: a step waits on its push only, where the message path pulls too
    assert shared.summary["round_trips_per_step"] == 1.0 < pushed.summary["round_trips_per_step"]


@pytest.mark.slow
def test_workers_step_shared_tables_together_and_every_step_is_counted(monkeypatch, tmp_path):
    shared = train_locally(monkeypatch, async_config(shared_tables=True, checkpoint_dir=str(tmp_path)))
    summary = shared.summary
    assert summary["shared_tables_workers"] == WORKERS and summary["round_trips_per_step"] == 1.0
    assert summary["updates"] == WORKERS * STEPS
    # every push touched both tables, and each worker counted its own steps: the PS's final checkpoint of the
    # shared tables holds their sum (lazy Adam's bias correction).  A push past the sample budget, which the PS
    # refuses, has stepped its rows already (a worker learns of the end from that push's reply)
    final = torch.load(checkpoint_path(tmp_path, summary["updates"]), weights_only=False)
    assert [table["steps"] for table in final["tables"]] == [summary["pushes"]] * 2
    assert largest_difference(shared.state_dict, {name: final["tables"][i]["weight"]
                                                  for i, name in enumerate(TABLES)}, TABLES) == 0.0


@pytest.mark.parametrize("settings", [{"policy": "sync"}, {"policy": "softsync", "softsync_size": 2},
                                      {"ps_transport": "tcp"}, {"ps_hosts": "executors", "ps_shards": 2}])
def test_shared_tables_are_refused_where_workers_cannot_step_them_alone(monkeypatch, settings):
    with pytest.raises(ValueError, match="shared_tables"):
        train_locally(monkeypatch, async_config(shared_tables=True, **settings))


def test_a_ps_shares_its_tables_under_their_names_while_it_runs_and_removes_them_at_stop():
    spec = TableSpec("users", rows=50, dim=4, optimizer="adagrad")
    table = EmbeddingTable(spec, learning_rate=0.1)
    rows = table.weight.clone()
    run_config = async_config(num_workers=2, shared_tables=True)
    server = ParameterServer(run_config, torch.zeros(3), SECRET, ServerSetup(tables=[table]))
    server.start()
    name = table_file_name(SECRET, server.port, 0)
    try:
        mapped = SharedTable.attach(name, spec, run_config.worker_slots + 1)
        assert mapped is not None and torch.equal(mapped.weight, rows)
        mapped.weight[7] += 1.0                  # a worker's write is the PS's row, and its Adagrad state: one memory
        mapped.state[0][7] += 2.0
        assert torch.equal(table.weight[7], rows[7] + 1.0) and table.state_sum is not None
        assert torch.equal(table.state_sum[7], torch.full((4,), 2.0))
    finally:
        server.stop()
    assert SharedTable.attach(name, spec, run_config.worker_slots + 1) is None


@pytest.mark.parametrize("mapped", [True, False])
def test_a_worker_steps_shared_rows_itself_or_sends_them_and_the_ps_steps_the_same_memory(make_server, monkeypatch,
                                                                                          mapped):
    # a worker that cannot map the tables (another /dev/shm) pulls and pushes its rows as messages, and the PS
    # steps them in the shared files, where the workers that could map them read them
    if not mapped:
        monkeypatch.setattr(SharedRows, "attach", classmethod(lambda cls, *args: None))
    spec = TableSpec("users", rows=20, dim=3, optimizer="lazy_adam")
    table, reference = EmbeddingTable(spec, learning_rate=0.1), EmbeddingTable(spec, learning_rate=0.1)
    server = make_server(num_params=2, learning_rate=0.1, policy="async", shared_tables=True,
                         server_args={"tables": [table]})
    client = connect(server)
    client.hello(64, torch.zeros(2), shared_memory=True, tables=[spec], table_slots=server.config.worker_slots + 1)
    assert (client.shared_rows is not None) == mapped
    rows_steps_against(client, reference)
    assert torch.allclose(table.weight, reference.weight, atol=1e-7) and table.steps == 3
    assert client.round_trips == (3 if mapped else 6)     # mapped: only the pushes wait on the PS
    in_memory = SharedTable.attach(table_file_name(SECRET, server.port, 0), spec, server.config.worker_slots + 1)
    assert in_memory is not None and torch.equal(in_memory.weight, table.weight)
    assert torch.equal(in_memory.state[1], table.exp_avg_sq) and int(in_memory.steps.sum()) == 3


def test_workers_stepping_one_shared_table_in_turn_count_each_others_steps():
    # lazy Adam's bias correction takes the table's step count: the sum over every writer's counter, so two
    # workers stepping in turn take the steps one table would, where each counting only its own would not
    spec = TableSpec("users", rows=20, dim=3, optimizer="lazy_adam")
    table, reference = EmbeddingTable(spec, learning_rate=0.1), EmbeddingTable(spec, learning_rate=0.1)
    shared = SharedTable.create(spec, slots=3)
    assert shared is not None
    try:
        table.share(shared)
        workers = [SharedRows([shared], worker) for worker in (0, 1)]
        generator = torch.Generator().manual_seed(0)
        for step in range(6):
            ids, grads = torch.randperm(20, generator=generator)[:5].sort().values, torch.randn(5, 3, generator=generator)
            workers[step % 2].step(0, ids, grads, 0.1)
            reference.apply(ids, grads, 1.0, 0.1)
        assert shared.steps.tolist() == [0, 3, 3] and table.steps == reference.steps == 6
        assert torch.allclose(shared.weight, reference.weight, atol=1e-6)
        assert torch.allclose(shared.state[1], reference.exp_avg_sq, atol=1e-7)
    finally:
        shared.remove()
