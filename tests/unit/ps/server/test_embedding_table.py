"""Embedding tables held as rows: row-wise SGD, Adagrad and lazy Adam equal PyTorch's sparse optimizers, the
stand-in module pulls and pushes only the touched rows, sharding and sync averaging leave the result unchanged."""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.tables import INIT_BLOCK_ROWS, TableSpec, initial_rows, table_bytes
from sparkdl._internal.ps.worker.remote_embedding import swap_tables, table_spec
from sparkdl.errors import DataError, ParameterServerError
from tests.unit.conftest import connect, rows_steps_against

USERS, ITEMS, DIM = 50, 40, 8


class Factorisation(nn.Module):
    """A biased factorisation model over user and item ids, plus a bag of an item's tags."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, DIM, sparse=True)
        self.items = nn.Embedding(ITEMS, DIM, sparse=True, padding_idx=0)
        self.tags = nn.EmbeddingBag(30, DIM, mode="mean", sparse=True)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, users, items, tags):
        item = self.items(items) + self.tags(tags)
        return (self.users(users) * item).sum(-1) + self.bias


class Tables:
    """The PS side in one process: the tables by name, split over ``shards`` PS shards by row stride."""

    def __init__(self, model: nn.Module, optimizer: str, lr: float, shards: int = 1) -> None:
        self.shards = shards
        self.tables: dict[str, list[EmbeddingTable]] = {}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                spec = table_spec(name, module, optimizer, seed=0)
                weight = module.weight.detach()
                self.tables[name] = [EmbeddingTable(spec, s, shards, lr, rows=weight[s::shards].clone())
                                     for s in range(shards)]
        self.pulled_rows: dict[str, int] = {}

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        self.pulled_rows[table] = self.pulled_rows.get(table, 0) + ids.numel()
        out = torch.empty((ids.numel(), self.tables[table][0].spec.dim))
        for shard, held in enumerate(self.tables[table]):
            mine = ids % self.shards == shard
            out[mine] = held.gather(ids[mine])
        return out

    def pull_tables(self, requests):
        return [self.pull_rows(table, ids) for table, ids in requests]

    def apply(self, table: str, ids: torch.Tensor, grads: torch.Tensor, grad_scale: float = 1.0) -> None:
        for shard, held in enumerate(self.tables[table]):
            mine = ids % self.shards == shard
            held.apply(ids[mine], grads[mine], grad_scale)

    def weight(self, table: str) -> torch.Tensor:
        held = self.tables[table]
        rows = held[0].spec.rows
        out = torch.empty((rows, held[0].spec.dim))
        for shard, part in enumerate(held):
            out[shard::self.shards] = part.weight
        return out


def batch(generator: torch.Generator, size: int):
    users = torch.randint(0, USERS, (size,), generator=generator)
    items = torch.randint(0, 6, (size,), generator=generator)          # few items: repeated rows and padding 0
    tags = torch.randint(0, 30, (size, 3), generator=generator)
    target = torch.randn(size, generator=generator)
    return users, items, tags, target


REFERENCE_OPTIMIZERS = {"sgd": lambda p, lr: torch.optim.SGD(p, lr=lr),
                        "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr),
                        "lazy_adam": lambda p, lr: torch.optim.SparseAdam(p, lr=lr)}


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "lazy_adam"])
def test_row_wise_optimizers_equal_pytorchs_sparse_ones(optimizer, shards):
    torch.manual_seed(0)
    reference = Factorisation()
    remote = copy.deepcopy(reference)
    lr = 0.05
    tables = Tables(reference, optimizer, lr, shards)
    swapped = swap_tables(remote, tables)
    assert set(swapped) == {"users", "items", "tags"} and not any(
        isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in remote.modules())
    embeddings = [reference.users.weight, reference.items.weight, reference.tags.weight]
    reference_optimizer = REFERENCE_OPTIMIZERS[optimizer](embeddings, lr)
    generator = torch.Generator().manual_seed(1)
    for _ in range(25):   # 16 of 50 users a step: untouched rows with moments, where lazy Adam differs from Adam
        users, items, tags, target = batch(generator, 16)
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(users, items, tags), target).backward()
        reference_optimizer.step()
        pulled_before = dict(tables.pulled_rows)
        nn.functional.mse_loss(remote(users, items, tags), target).backward()
        distinct = {"users": users.unique().numel(), "items": items.unique().numel(), "tags": tags.unique().numel()}
        for name, module in swapped.items():
            touched = module.take_touched()
            # only the batch's distinct rows went each way
            assert tables.pulled_rows[name] - pulled_before.get(name, 0) == distinct[name] == touched.ids.numel()
            tables.apply(name, touched.ids, touched.grads)
    for name, weight in (("users", reference.users.weight), ("items", reference.items.weight),
                         ("tags", reference.tags.weight)):
        assert torch.allclose(tables.weight(name), weight.detach(), atol=1e-5), name
    assert tables.weight("items")[0].abs().max() == 0     # the padding row stays zero


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_workers_halves_in_one_sync_update_equal_one_batch_of_both(optimizer):
    """The PS sums the workers' row gradients (each its mean x its samples) and divides by the global batch:
    a row both workers touched gets the dense update's mean."""
    torch.manual_seed(0)
    single = Factorisation()
    pair = copy.deepcopy(single)
    lr = 0.1
    whole, split = Tables(single, optimizer, lr), Tables(pair, optimizer, lr, shards=2)
    whole_modules, split_modules = swap_tables(single, whole), swap_tables(pair, split)
    generator = torch.Generator().manual_seed(2)
    for _ in range(10):
        users, items, tags, target = batch(generator, 16)
        nn.functional.mse_loss(single(users, items, tags), target).backward()
        for name, module in whole_modules.items():
            touched = module.take_touched()
            whole.apply(name, touched.ids, touched.grads)
        pushes: dict[str, list] = {name: [] for name in split_modules}
        for half in (slice(0, 8), slice(8, 16)):
            nn.functional.mse_loss(pair(users[half], items[half], tags[half]), target[half]).backward()
            for name, module in split_modules.items():
                touched = module.take_touched()
                pushes[name].append((touched.ids, touched.grads * 8))     # gradient x samples, as a push
        for name, pushed in pushes.items():
            split.apply(name, torch.cat([ids for ids, _ in pushed]), torch.cat([g for _, g in pushed]), grad_scale=16)
    for name in whole_modules:
        assert torch.allclose(split.weight(name), whole.weight(name), atol=1e-6), name


def test_initial_rows_depend_on_the_seed_and_table_not_on_the_sharding():
    spec = TableSpec("items", rows=INIT_BLOCK_ROWS + 1000, dim=2, seed=3, padding_idx=5)
    whole = initial_rows(spec)
    assert whole.shape == (INIT_BLOCK_ROWS + 1000, 2) and whole[5].abs().max() == 0
    assert 0.95 < float(whole.std()) < 1.05     # nn.Embedding's N(0, 1)
    parts = [initial_rows(spec, shard, 3) for shard in range(3)]
    interleaved = torch.empty_like(whole)
    for shard, part in enumerate(parts):
        interleaved[shard::3] = part
    assert torch.equal(interleaved, whole)
    assert not torch.equal(initial_rows(TableSpec("users", rows=100, dim=2, seed=3)), whole[:100])
    assert not torch.equal(initial_rows(TableSpec("items", rows=100, dim=2, seed=4)), whole[:100])


def test_an_id_outside_the_table_fails_before_anything_is_pulled_or_written():
    torch.manual_seed(0)
    model = Factorisation()
    tables = Tables(model, "adagrad", 0.1)
    swap_tables(model, tables)
    users, items, tags, _ = batch(torch.Generator().manual_seed(0), 4)
    users[2] = USERS
    with pytest.raises(DataError, match=r"table 'users' has 50 rows, but the batch holds id 50 at position \(2,\)"):
        model(users, items, tags)
    assert "users" not in tables.pulled_rows
    users[2] = -1
    with pytest.raises(DataError, match="id -1"):
        model(users, items, tags)
    with pytest.raises(DataError, match="int64 or int32 ids"):
        model(users.float(), items, tags)


def test_a_push_naming_a_row_of_another_shard_or_outside_the_table_changes_no_row():
    spec = TableSpec("users", rows=10, dim=4, optimizer="adagrad")
    shard = EmbeddingTable(spec, shard=1, shards=2, learning_rate=0.1)
    before = shard.weight.clone()
    for ids in ([1, 3, 4], [1, 11], [-1]):
        with pytest.raises(ValueError, match="id (4|11|-1) is"):
            shard.apply(torch.tensor(ids), torch.ones(len(ids), 4))
    assert torch.equal(shard.weight, before) and shard.state_sum is None and shard.steps == 0
    shard.apply(torch.tensor([1, 9, 1]), torch.ones(3, 4))
    assert torch.equal(shard.weight[[1, 2, 3]], before[[1, 2, 3]]) and not torch.equal(shard.weight[0], before[0])


def test_checkpointed_rows_and_state_restore_the_same_updates():
    spec = TableSpec("users", rows=20, dim=3, optimizer="lazy_adam")
    table = EmbeddingTable(spec, learning_rate=0.1)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 20, (6,), generator=generator) for _ in range(6)]
    grads = [torch.randn(6, 3, generator=generator) for _ in range(6)]
    for i, g in zip(ids[:3], grads[:3]):
        table.apply(i, g)
    restored = EmbeddingTable(spec, learning_rate=0.1)
    restored.load_state_dict(table.state_dict())
    for i, g in zip(ids[3:], grads[3:]):
        table.apply(i, g)
        restored.apply(i, g)
    assert torch.equal(restored.weight, table.weight) and restored.steps == 6
    # resumed with another row optimizer: its own state starts afresh, the other's is neither kept nor sent
    adagrad = EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="adagrad"), learning_rate=0.1)
    adagrad.load_state_dict(table.state_dict())
    assert adagrad.exp_avg is None and adagrad.state_sum is None and torch.equal(adagrad.weight, table.weight)
    adagrad.apply(ids[0], grads[0])
    assert set(adagrad.changes_since(0)) == {"rows", "weight", "steps", "state_sum"}


def test_memory_counts_rows_and_optimizer_state_per_shard():
    assert table_bytes(10_000_000, 64, "sgd") == 10_000_000 * 64 * 4
    assert table_bytes(10_000_000, 64, "adagrad") == 2 * 10_000_000 * 64 * 4
    assert table_bytes(10_000_001, 64, "lazy_adam", shards=2) == 3 * 5_000_001 * 64 * 4


def test_options_a_ps_held_table_cannot_keep_are_refused_and_scoring_keeps_no_rows():
    with pytest.raises(ValueError, match="max_norm"):
        swap_tables(nn.Sequential(nn.Embedding(5, 2, sparse=True, max_norm=1.0)), Tables(nn.Sequential(), "sgd", 0.1))
    model = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Embedding(5, 2))
    swapped = swap_tables(model, Tables(model, "sgd", 0.1))
    assert list(swapped) == ["0"] and isinstance(model[1], nn.Embedding)      # only sparse=True is a table
    with torch.no_grad():
        model[0](torch.tensor([1, 2]))
    assert swapped["0"].take_touched() is None


def test_rows_cross_the_wire_with_their_push_and_a_refused_push_leaves_its_rows_out(make_server):
    spec = TableSpec("users", rows=20, dim=3, optimizer="sgd")
    table = EmbeddingTable(spec, learning_rate=0.1)
    server = make_server(num_params=2, num_workers=2, max_staleness=0, server_args={"tables": [table]})
    first, second = connect(server, 0), connect(server, 1)
    weights = torch.zeros(2)
    with ThreadPoolExecutor(2) as pool:     # the plan needs every worker's hello
        list(pool.map(lambda client: client.hello(64, torch.zeros(2)), (first, second)))
    before = table.weight.clone()
    assert torch.equal(first.pull_rows(0, torch.tensor([2, 5]), 3), before[[2, 5]])
    second.push_rows(0, torch.tensor([5, 7]), torch.ones(2, 3))
    assert second.push_pull(torch.ones(2), 0, 8, 0.0, 0, weights) == (1, True)
    expected = before.clone()
    expected[[5, 7]] -= 0.1
    assert torch.allclose(table.weight, expected)
    # worker 0 computed on version 0, now one behind: refused (max_staleness=0), and its rows with it
    first.push_rows(0, torch.tensor([2]), torch.ones(1, 3))
    assert first.push_pull(torch.ones(2), 0, 8, 0.0, 0, weights) == (1, False)
    assert torch.allclose(table.weight, expected)
    assert first.bytes_pulled > 0 and first.transport == "tcp"


class _CountingSocket:
    """The client's socket, recording each system call that writes to it."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.writes: list[str] = []

    def sendall(self, data) -> None:
        self.writes.append("sendall")
        self._sock.sendall(data)

    def sendmsg(self, buffers) -> int:
        self.writes.append("sendmsg")
        return self._sock.sendmsg(buffers)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def test_a_steps_rows_of_every_table_leave_with_its_push_in_one_write(make_server):
    tables = [EmbeddingTable(TableSpec(name, rows=20, dim=3, optimizer="sgd"), learning_rate=0.1)
              for name in ("users", "items")]
    server = make_server(num_params=2, server_args={"tables": tables})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    expected = [table.weight.clone() for table in tables]
    counting = client.sock = _CountingSocket(client.sock)
    client.push_rows(0, torch.tensor([1, 4]), torch.ones(2, 3))
    client.push_rows(1, torch.tensor([2]), torch.ones(1, 3))
    assert counting.writes == []                   # the rows wait for the push
    assert client.push_pull(torch.ones(2), 0, 8, 0.0, 0, torch.zeros(2)) == (1, True)
    assert counting.writes == ["sendmsg"]          # rows of both tables and the push: one write
    expected[0][[1, 4]] -= 0.1
    expected[1][2] -= 0.1
    for table, rows in zip(tables, expected):
        assert torch.allclose(table.weight, rows)


def test_a_peer_naming_a_row_outside_the_table_loses_its_connection_and_changes_nothing(make_server):
    table = EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="adagrad"), learning_rate=0.1)
    server = make_server(num_params=2, server_args={"tables": [table]})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    before = table.weight.clone()
    with pytest.raises(ParameterServerError):
        client.pull_rows(0, torch.tensor([3, 20]), 3)
    assert server.stats.protocol_errors == 1
    other = connect(server)   # the retried attempt of the same worker
    other.hello(64, torch.zeros(2), task_attempt=1)
    with pytest.raises(ParameterServerError):
        other.push_rows(0, torch.tensor([-1]), torch.ones(1, 3))
        other.push_pull(torch.ones(2), 0, 8, 0.0, 0, torch.zeros(2))
    assert torch.equal(table.weight, before) and table.state_sum is None


@pytest.mark.parametrize("ids", [[4, 20], [-2, 4], [4, 7], [2, 5, 6]],
                         ids=["past-the-end", "negative", "last-on-the-other-shard", "middle-on-the-other-shard"])
def test_a_shard_refuses_a_message_naming_a_row_outside_it_and_changes_nothing(make_server, ids):
    """Shard 0 of 2 holds the even rows: an odd id (even one between two of its own) or one outside the table
    loses the connection, on a pull and on a push."""
    table = EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="adagrad"), shard=0, shards=2,
                           learning_rate=0.1)
    server = make_server(num_params=2, server_args={"tables": [table]})
    before = table.weight.clone()
    for attempt, pull in enumerate((True, False)):
        client = connect(server)
        client.hello(64, torch.zeros(2), task_attempt=attempt)
        with pytest.raises(ParameterServerError):
            if pull:
                client.pull_rows(0, torch.tensor(ids), 3)
            else:
                client.push_rows(0, torch.tensor(ids), torch.ones(len(ids), 3))
                client.push_pull(torch.ones(2), 0, 8, 0.0, 0, torch.zeros(2))
    assert server.stats.protocol_errors == 2
    assert torch.equal(table.weight, before) and table.state_sum is None
    assert torch.equal(table.local_index(torch.tensor([0, 8, 18]), increasing=True), torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("ids", [[5, 2], [2, 2]], ids=["out-of-order", "repeated"])
def test_a_peer_naming_rows_out_of_order_or_twice_loses_its_connection_and_changes_nothing(make_server, ids):
    """A message's ids come as a worker's torch.unique gives them: that one check lets its rows step unsorted."""
    table = EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="adagrad"), learning_rate=0.1)
    server = make_server(num_params=2, server_args={"tables": [table]})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    before = table.weight.clone()
    with pytest.raises(ParameterServerError):   # the ERROR, or the closed socket if it comes first
        client.push_rows(0, torch.tensor(ids), torch.ones(2, 3))
        client.push_pull(torch.ones(2), 0, 8, 0.0, 0, torch.zeros(2))
    assert server.stats.protocol_errors == 1
    assert torch.equal(table.weight, before) and table.state_sum is None


@pytest.mark.parametrize("optimizer", ["adagrad", "lazy_adam"])
def test_one_workers_rows_step_without_a_sort_and_as_the_sorted_path_does(make_server, monkeypatch, optimizer):
    from sparkdl._internal.ps import row_steps
    sorted_calls = []
    coalesce = row_steps.coalesce_rows
    monkeypatch.setattr(row_steps, "coalesce_rows", lambda *a: sorted_calls.append(1) or coalesce(*a))
    spec = TableSpec("users", rows=20, dim=3, optimizer=optimizer)
    table, reference = EmbeddingTable(spec, learning_rate=0.1), EmbeddingTable(spec, learning_rate=0.1)
    server = make_server(num_params=2, learning_rate=0.1, server_args={"tables": [table]})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    rows_steps_against(client, reference)
    assert len(sorted_calls) == 3                   # the reference's only
    assert torch.equal(table.weight, reference.weight)
    assert client.round_trips == 6                  # a pull and a push per step; ROWS goes one way


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_table_looked_up_twice_in_one_forward_pushes_each_row_once_with_both_gradients():
    torch.manual_seed(0)
    reference = nn.Embedding(10, 4, sparse=True)
    holder = nn.Module()
    holder.pairs = copy.deepcopy(reference)
    tables = Tables(holder, "adagrad", 0.1)
    remote = swap_tables(holder, tables)["pairs"]
    optimizer = torch.optim.Adagrad([reference.weight], lr=0.1)
    for _ in range(5):
        left, right = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 1])
        optimizer.zero_grad()
        (reference(left) * reference(right)).sum().backward()
        optimizer.step()
        (holder.pairs(left) * holder.pairs(right)).sum().backward()
        touched = remote.take_touched()
        assert touched.ids.tolist() == [1, 2, 3, 4]
        tables.apply("pairs", touched.ids, touched.grads)
    assert torch.allclose(tables.weight("pairs"), reference.weight.detach(), atol=1e-5)


def table_core(table_optimizer: str = "sgd", **settings):
    from sparkdl._internal.ps.server.core import PSCore
    from sparkdl.config import TrainConfig

    config = TrainConfig(**{"num_workers": 2, "learning_rate": 0.1, **settings})
    table = EmbeddingTable(TableSpec("users", rows=10, dim=2, optimizer=table_optimizer), learning_rate=0.1,
                           rows=torch.zeros(10, 2))
    core = PSCore(config, torch.zeros(1), tables=[table])
    return core, [core.hello(w, 0, 64) for w in range(2)], table


def push_rows(core, worker, token, ids, value, computed_on=None):
    from sparkdl._internal.ps.server.core import PushMeta

    rows = [(0, torch.tensor(ids), torch.full((len(ids), 2), value))]
    return core.push(worker, token, PushMeta(core.version if computed_on is None else computed_on, 8, 1.0, 0),
                     torch.zeros(1), True, rows)


def test_a_sync_round_abandoned_by_a_lost_worker_takes_its_rows_with_it():
    core, tokens, table = table_core(policy="sync")
    push_rows(core, 0, tokens[0], [1, 2], 1.0)
    core.lost(1, tokens[1], "disconnected")
    assert core.stats.discarded_on_loss == 1 and torch.equal(table.weight, torch.zeros(10, 2))
    tokens = [core.hello(w, 1, 64) for w in range(2)]       # the retried stage redoes the round
    push_rows(core, 0, tokens[0], [1, 2], 1.0)
    push_rows(core, 1, tokens[1], [2, 3], 3.0)
    # rows averaged over the round's 16 samples: row 2 holds both workers' gradients
    assert torch.allclose(table.weight[1:4, 0], torch.tensor([-0.05, -0.2, -0.15]))
    assert core.snapshots.take()["tables"][0]["weight"].equal(table.weight)


def test_softsync_rows_wait_for_their_update_and_take_the_staleness_factor():
    core, tokens, table = table_core(policy="softsync", softsync_size=2, staleness_lr="inverse")
    push_rows(core, 0, tokens[0], [4], 2.0)
    assert torch.equal(table.weight, torch.zeros(10, 2))            # buffered with the dense gradient
    push_rows(core, 1, tokens[1], [4], 2.0)
    assert core.version == 1 and torch.allclose(table.weight[4], torch.full((2,), -0.2))
    push_rows(core, 0, tokens[0], [5], 2.0)                         # fresh
    push_rows(core, 1, tokens[1], [5], 2.0, computed_on=0)          # staleness 1: factor 1/1
    push_rows(core, 0, tokens[0], [6], 2.0)
    push_rows(core, 1, tokens[1], [6], 2.0, computed_on=0)          # staleness 2: factor 1/2
    assert torch.allclose(table.weight[6], torch.full((2,), -0.1 * (2.0 + 1.0) / 2))


def test_a_whole_tables_checkpoint_splits_over_shards_by_stride_and_merges_back():
    from sparkdl._internal.ps.shards.ranges import merge_snapshots, split_snapshot

    table = EmbeddingTable(TableSpec("users", rows=11, dim=2, optimizer="adagrad"), learning_rate=0.1)
    table.apply(torch.tensor([0, 3, 10]), torch.ones(3, 2))
    whole = {"version": 4, "weights": torch.arange(6.0), "num_params": 6, "time_s": 1.0,
             "optimizer": {"state": {}, "param_groups": [{}]}, "tables": [table.state_dict()]}
    parts = split_snapshot(whole, [(0, 3), (3, 6)])
    # shard 1 holds rows 1, 3, 5, 7, 9: the rows a PS shard's EmbeddingTable(shard=1, shards=2) holds
    held = EmbeddingTable(table.spec, shard=1, shards=2, rows=parts[1]["tables"][0]["weight"])
    assert torch.equal(held.gather(torch.tensor([3, 9])), table.gather(torch.tensor([3, 9])))
    merged = merge_snapshots(parts)["tables"][0]
    for key in ("weight", "state_sum"):
        assert torch.equal(merged[key], whole["tables"][0][key]), key
    assert merged["steps"] == 1


class ScaledEmbedding(nn.Embedding):
    def forward(self, input):
        return super().forward(input) * 2


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.decode = nn.Linear(4, 10, bias=False)
        self.decode.weight = self.embed.weight


@pytest.mark.parametrize("model, reason", [
    (nn.Sequential(ScaledEmbedding(10, 4, sparse=True)), "has a forward of its own"),
    (nn.Sequential(nn.Embedding.from_pretrained(torch.zeros(10, 4), freeze=True, sparse=True)), "is frozen"),
    (Tied(), r"shared with \['embed.weight', 'decode.weight'\]"),
])
def test_a_table_the_ps_cannot_hold_as_rows_is_refused_with_the_reason(model, reason):
    with pytest.raises(ValueError, match=reason):
        swap_tables(model, Tables(nn.Sequential(), "sgd", 0.1))


def test_a_shards_snapshots_carry_only_the_rows_changed_since_the_last_and_rebuild_the_table():
    from sparkdl._internal.ps.shards.ranges import apply_table_changes

    core, tokens, table = table_core("adagrad", policy="async")
    core.snapshots.table_changes_only, core.snapshots.every = True, (2,)
    start = table.state_dict()
    for worker, ids in ((0, [1, 2]), (1, [2, 3])):
        push_rows(core, worker, tokens[worker], ids, 1.0)
    first = core.snapshots.take_due()
    assert first["tables"][0]["rows"].tolist() == [1, 2, 3] and first["tables_after"] == 0
    for worker, ids in ((0, [5]), (1, [5, 6]), (0, [7]), (1, [8])):    # the snapshot at 4 is never taken out
        push_rows(core, worker, tokens[worker], ids, 1.0)
    second = core.snapshots.take_due()
    assert second["version"] == 6 and second["tables_after"] == 2
    assert second["tables"][0]["rows"].tolist() == [5, 6, 7, 8]      # the replaced snapshot's rows too
    for snapshot in (first, second):
        apply_table_changes(start, snapshot["tables"][0])
    whole = table.state_dict()
    assert torch.equal(start["weight"], whole["weight"]) and torch.equal(start["state_sum"], whole["state_sum"])
    assert start["steps"] == whole["steps"] == 6
    final = core.snapshots.take("since_start")
    assert final["tables"][0]["rows"].tolist() == [1, 2, 3, 5, 6, 7, 8] and final["tables_after"] == 0
    rows_only = core.snapshots.take("since_start", table_optimizer_state=False)["tables"][0]   # a result, no checkpoint
    assert "state_sum" not in rows_only and torch.equal(rows_only["weight"], final["tables"][0]["weight"])
    assert core.snapshots.take("changed")["tables"][0]["rows"].numel() == 0
